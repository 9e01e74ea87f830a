"""The Mixture-of-Experts MLP against a loop over experts, on fresh random weights, and the MoE
configs read (expert parallelism: tests/test_tensor_parallel.py; LoRA: tests/test_lora.py)."""

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrunner import Runner, RunnerConfig
from jaxrunner.checkpoints.dummy import random_params, shape
from jaxrunner.config import Kernels, ModelConfig
from jaxrunner.models.moe import moe_mlp, route
from jaxrunner.platform import H200
from jaxrunner.runner import step
from pallas_kernels.quantized_matmul import grouped_dense_matmul
from tests.driver import drive

MODELS = Path(__file__).parent / "data" / "models"


def loop_reference(x, router, gate_up, down, k, normalize):
    """Each token through each of its top-k experts in turn (numpy, float64)."""
    x, router, gate_up, down = (np.asarray(a, np.float64) for a in (x, router, gate_up, down))
    logits = x @ router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        chosen = np.argsort(-probs[t])[:k]
        w = probs[t, chosen] / (probs[t, chosen].sum() if normalize else 1.0)
        for e, weight in zip(chosen, w):
            gate, up = np.split(x[t] @ gate_up[e], 2)
            out[t] += weight * ((gate / (1 + np.exp(-gate)) * up) @ down[e])
    return out


@pytest.mark.parametrize("tokens, experts, k, normalize", [(37, 8, 2, True), (5, 4, 1, False), (64, 16, 4, True)])
def test_grouped_matmuls_equal_a_loop_over_experts(tokens, experts, k, normalize):
    rng = np.random.default_rng(tokens)
    h, inter = 24, 16
    x = rng.standard_normal((tokens, h)).astype(np.float32)
    router = rng.standard_normal((h, experts)).astype(np.float32)
    gate_up = (0.3 * rng.standard_normal((experts, h, 2 * inter))).astype(np.float32)
    down = (0.3 * rng.standard_normal((experts, inter, h))).astype(np.float32)
    cfg = ModelConfig("MixtralForCausalLM", 64, h, inter, 1, 2, 1, 12, num_experts=experts, num_experts_per_tok=k,
                      norm_topk_prob=normalize)
    valid = rng.random(tokens) < 0.7  # the rest: a bucket's padding, routed to no expert
    want = loop_reference(x, router, gate_up, down, k, normalize)
    with jax.default_matmul_precision("highest"):
        got = moe_mlp(jnp.asarray(x), jnp.asarray(router), jnp.asarray(gate_up), jnp.asarray(down), jax.nn.silu, cfg)
        masked = moe_mlp(jnp.asarray(x), jnp.asarray(router), jnp.asarray(gate_up), jnp.asarray(down), jax.nn.silu, cfg,
                         jnp.asarray(valid))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(masked), np.where(valid[:, None], want, 0.0), rtol=1e-4, atol=1e-4)
    _, chosen = route(jnp.asarray(x @ router), k, normalize)
    assert len(np.unique(np.asarray(chosen))) > k  # the tokens spread over several experts


def test_router_weights():
    logits = jnp.asarray([[0.0, 1.0, 2.0, 3.0]])
    weights, experts = route(logits, 2, normalize=True)
    assert experts.tolist() == [[3, 2]] and np.isclose(float(weights.sum()), 1.0)
    raw, _ = route(logits, 2, normalize=False)
    np.testing.assert_allclose(np.asarray(raw), np.asarray(jax.nn.softmax(logits)[:, [3, 2]]), rtol=1e-6)


def test_qwen3_moe_config_and_its_dense_layers_refused(tmp_path):
    qwen = ModelConfig.from_hf(MODELS / "tiny-qwen3-moe")
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.intermediate_size, qwen.qk_norm) == (8, 2, 32, True)
    config = (MODELS / "tiny-qwen3-moe" / "config.json").read_text().replace('"mlp_only_layers": []', '"mlp_only_layers": [1]')
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(ValueError, match="mlp_only_layers"):
        ModelConfig.from_hf(tmp_path)


def test_the_runner_runs_an_moe_decode_through_the_mosaic_kernel(monkeypatch):
    """kernels="mosaic": the experts' grouped matmuls take the Mosaic GPU kernel (simulated here) and
    give the Triton kernel's tokens, in bf16 on random weights, a prefill chunk beside decodes."""
    traced = []

    def counted(*args, **kwargs):
        traced.append(args[1].shape)
        return grouped_dense_matmul(*args, **kwargs)

    monkeypatch.setattr(step, "grouped_dense_matmul", counted)
    model = dataclasses.replace(shape("tiny"), architecture="MixtralForCausalLM", intermediate_size=64, num_experts=8,
                                num_experts_per_tok=2)
    params = random_params(model, "bfloat16", 5)
    config = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=96, num_blocks=48,
                          dtype="bfloat16", token_buckets=(4, 32), request_buckets=(4,))
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 500, n).tolist() for n in (40, 12, 25)]
    tokens = {kernels: drive(Runner(model, params, dataclasses.replace(config, kernels=kernels)), prompts, 4,
                             chunk=16, stagger=1)
              for kernels in ("mosaic", "pallas")}
    assert {(8, 64, 128), (8, 64, 64)} <= set(traced)  # gate|up and down, each token bucket's
    assert tokens["mosaic"] == tokens["pallas"]


@pytest.mark.parametrize("mosaic", [False, True])
def test_an_moe_layer_for_the_gpu_runs_no_loop(mosaic):
    """The MLP as a GPU step runs it (Qwen3-30B-A3B's shape at a decode of 16 tokens; the Triton
    kernel, or with kernels="mosaic" the Mosaic form), lowered on the CPU: no while loop, whose
    every iteration costs kernel launches on a GPU in every layer (a binary search planned the
    tiles before)."""
    cfg = shape("qwen3-30b-a3b")
    kernels = Kernels(pallas=True, interpret=False, num_sms=132, mosaic=mosaic)
    h, e, i = cfg.hidden_size, cfg.num_experts, cfg.intermediate_size
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((16, h), (h, e), (e, h, 2 * i), (e, i, h))]
    mlp = functools.partial(moe_mlp, act=jax.nn.silu, cfg=cfg, grouped_matmul=step.moe_matmul(kernels, cfg))
    with jax.sharding.use_abstract_mesh(H200):
        text = jax.jit(mlp).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert ("mosaic_gpu" in text) == mosaic and ("__gpu$xla.gpu.triton" in text) != mosaic
    assert "stablehlo.while" not in text
