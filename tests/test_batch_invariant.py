"""`batch_invariant=True`: a request's tokens and logprobs are the same bits alone and in any batch.

Random weights in a shape whose matmuls XLA:CPU sums differently by the number of rows (hidden 576,
as SmolLM2's; the tiny shapes are too small to show it). Hypothesis draws the batch around a target
request (how many others, their lengths, the target's place, greedy or seeded sampling); the engine
chunks long prefills and the prefix cache serves the target's prompt once it ran alone.
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxrunner import LLM, ModelConfig, SamplingParams
from jaxrunner.bench.throughput import random_adapter
from jaxrunner.config import Kernels
from jaxrunner.lora_request import LoRARequest
from jaxrunner.models.llama import rms_norm
from jaxrunner.models.moe import moe_mlp
from jaxrunner.models.quantization import matmul, quantize
from jaxrunner.models.row_tiles import fixed_tile_matmul, per_row, row_tiled, tiling
from jaxrunner.runner.programs import SAMPLE
from jaxrunner.runner.step import logits_matmul, moe_matmul, projection_matmul
from pallas_kernels.common import tree_sum
from pallas_kernels.ragged_paged_attention import decode_config, reference_ragged_paged_attention

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1024, "hidden_size": 576,
          "intermediate_size": 1536, "num_hidden_layers": 2, "num_attention_heads": 9, "num_key_value_heads": 3,
          "head_dim": 64, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
TARGET = [int(t) for t in np.random.default_rng(7).integers(3, 1024, 41)]
REPEATING = TARGET[:9] * 4  # n-gram lookup finds drafts in it
ENGINE = dict(load_format="dummy", skip_tokenizer_init=True, max_model_len=160, max_num_seqs=8,
              max_num_batched_tokens=64, num_gpu_blocks_override=96)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("invariant")
    (path / "config.json").write_text(json.dumps(CONFIG))
    return str(path)


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(model_dir, batch_invariant=True, **ENGINE) as llm:
        yield llm


def params(seeded: bool, temperature: float = 1.0) -> SamplingParams:
    return SamplingParams(temperature=temperature if seeded else 0.0, seed=11 if seeded else None, max_tokens=10,
                          ignore_eos=True, logprobs=4)


def run(llm: LLM, prompts: list[list[int]], sampling: SamplingParams, at: int, **kw) -> tuple[list[int], list]:
    """Prompt `at`'s tokens, and per token its (token id, logprob as the float's bytes) pairs."""
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False, **kw)[at].outputs[0]
    return out.token_ids, [sorted((t, np.float32(lp.logprob).tobytes()) for t, lp in step.items()) for step in out.logprobs]


@pytest.fixture(scope="module")
def alone(model_dir):
    """The target alone on an engine without a prefix cache: greedy, and seeded; and the repeating
    prompt's (what n-gram speculation must give too)."""
    with LLM(model_dir, batch_invariant=True, enable_prefix_caching=False, **ENGINE) as llm:
        found = {seeded: run(llm, [TARGET], params(seeded), 0) for seeded in (False, True)}
        found |= {("repeating", seeded): run(llm, [REPEATING], params(seeded, 0.1), 0) for seeded in (False, True)}
        yield found, llm.llm_engine.runner


@pytest.mark.parametrize("seeded", [False, True])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(others=st.lists(st.integers(1, 90), max_size=5), place=st.integers(0, 5))
def test_a_request_gives_the_same_bits_in_any_batch(llm, alone, seeded, others, place):
    """In batches drawn by hypothesis, its prompt chunked with the others' (64 tokens a step) or
    served from the prefix cache after the first batch."""
    rng = np.random.default_rng(len(others) * 100 + place)
    batch = [[int(t) for t in rng.integers(3, 1024, n)] for n in others]
    place = min(place, len(batch))
    batch.insert(place, TARGET)
    tokens, logprobs = run(llm, batch, params(seeded), place)
    want_tokens, want_logprobs = alone[0][seeded]
    assert tokens == want_tokens and logprobs == want_logprobs  # bitwise, not within a tolerance


@pytest.mark.parametrize("seeded", [False, True])
def test_without_logprobs_the_batch_samples_whole_and_keeps_the_tokens(llm, alone, seeded):
    """A sampler that sums no row (no logprobs, no top-p) takes the batch whole, not a tile of rows
    at a time (`test_the_mode_tiles_the_rows`): its maxima, argmax and noise are exact in any batch,
    so the target's tokens are those it drew alone with logprobs, through the tiles."""
    sampling = SamplingParams(temperature=1.0 if seeded else 0.0, seed=11 if seeded else None, max_tokens=10,
                              ignore_eos=True)
    for others, seed in ((3, 4), (6, 5)):
        batch, place = random_batch(TARGET, others, seed)
        out = llm.generate([{"prompt_token_ids": p} for p in batch], sampling, use_tqdm=False)[place].outputs[0]
        assert list(out.token_ids) == alone[0][seeded][0]


@pytest.mark.parametrize("budget", [16, 128])
def test_other_chunk_sizes_keep_the_bits(model_dir, alone, budget):
    """A token budget of 16 (the 41-token prompt in three chunks) or 128 (in one) where the reference
    had 64: the same bits, greedy and seeded."""
    with LLM(model_dir, batch_invariant=True, **(ENGINE | {"max_num_batched_tokens": budget})) as llm:
        for seeded in (False, True):
            assert run(llm, [TARGET], params(seeded), 0) == alone[0][seeded]


def random_batch(target: list[int], others: int, seed: int) -> tuple[list[list[int]], int]:
    rng = np.random.default_rng(seed)
    batch = [[int(t) for t in rng.integers(3, 1024, n)] for n in rng.integers(1, 90, others)]
    place = int(rng.integers(0, others + 1))
    return batch[:place] + [target] + batch[place:], place


@pytest.mark.parametrize("seeded", [False, True])
def test_ngram_speculation_gives_the_bits_of_plain_sampling_in_any_batch(model_dir, alone, seeded):
    """With n-gram drafts (accepted ones among them), the repeating prompt's tokens and logprobs
    are those of plain sampling alone, bitwise, alone and in batches: the drafts only decide how
    many positions a step settles. Seeded at temperature 0.1, where this random model accepts drafts."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    with LLM(model_dir, batch_invariant=True, speculative_config=spec, **ENGINE) as llm:
        for others, seed in ((0, 0), (3, 1), (5, 2)):
            batch, place = random_batch(REPEATING, others, seed)
            assert run(llm, batch, params(seeded, 0.1), place) == alone[0][("repeating", seeded)]
        assert llm.llm_engine.stats().spec_decoding["num_accepted_tokens"] > 0


def test_a_draft_models_drafts_keep_the_bits_of_plain_sampling(model_dir, alone, tmp_path):
    """A draft model of its own (one layer, other random weights), seeded at temperature 1: its drafts
    are verified as n-gram drafts are, so the target's tokens and logprobs are plain sampling's,
    alone and in batches, with drafts accepted and rejected (min(1, p / q) would accept most of
    them, near-uniform as both models are, and change the tokens)."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIG | {"num_hidden_layers": 1}))
    spec = {"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 3}
    with LLM(model_dir, batch_invariant=True, speculative_config=spec, **ENGINE) as llm:
        for others, seed in ((0, 3), (4, 4)):
            batch, place = random_batch(TARGET, others, seed)
            assert run(llm, batch, params(True), place) == alone[0][True]
        stats = llm.llm_engine.stats().spec_decoding
        assert llm.llm_engine.runner.init_state().draft_probs.size == 0  # q is not kept: the rule does not read it
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]


@pytest.mark.parametrize("seeded", [False, True])
def test_multi_step_decode_keeps_the_bits_of_single_steps(model_dir, alone, seeded):
    """Decoding 4 steps a call (its rounds in one program), alone and in a batch: the bits of one
    step at a time."""
    with LLM(model_dir, batch_invariant=True, num_scheduler_steps=4, **ENGINE) as llm:
        for others, seed in ((0, 6), (4, 7)):
            batch, place = random_batch(TARGET, others, seed)
            assert run(llm, batch, params(seeded), place) == alone[0][seeded]
        assert any(key[0] == "decode_loop" for key in llm.llm_engine.runner.programs.asked)  # rounds in one call


def test_a_lora_request_gives_the_same_bits_in_any_batch(model_dir, tmp_path):
    """A request with an adapter, alone and among requests with another adapter or none: the same
    bits, and not the base model's."""
    path = random_adapter(str(tmp_path / "a"), ModelConfig.from_hf(model_dir), 8, seed=1)
    other = random_adapter(str(tmp_path / "b"), ModelConfig.from_hf(model_dir), 8, seed=2)
    mine, theirs = LoRARequest("a", 1, path), LoRARequest("b", 2, other)
    with LLM(model_dir, batch_invariant=True, enable_lora=True, max_loras=2, max_lora_rank=8, **ENGINE) as llm:
        want = run(llm, [TARGET], params(True), 0, lora_request=mine)
        assert want[0] != run(llm, [TARGET], params(True), 0)[0]
        for others, seed in ((3, 3), (6, 4)):
            batch, place = random_batch(TARGET, others, seed)
            adapters = [[mine, theirs, None][i % 3] for i in range(len(batch))]
            adapters[place] = mine
            assert run(llm, batch, params(True), place, lora_request=adapters) == want


def test_the_pallas_kernels_keep_the_bits_too(model_dir):
    """The Pallas kernels (interpreted here): a decode runs the attention kernel a mixed batch runs
    (the decode kernel's KV splits would follow the batch), and the projections run the grouped
    matmul kernel in fixed tiles (where XLA's GPU matmul picks its algorithm by the row count), so
    the bits stay."""
    splits = {decode_config(jnp.bfloat16, 128, 16, queries_per_seq=1, num_tokens=n, num_kv_heads=8, max_context=4096,
                            num_sms=132).num_splits for n in (1, 256)}
    assert len(splits) == 2  # on an H200 the decode kernel splits a sequence by the batch's size
    assert projection_matmul(Kernels.choose("pallas", batch_invariant=True)).func is fixed_tile_matmul
    with LLM(model_dir, batch_invariant=True, kernels="pallas", **ENGINE) as llm:
        assert not llm.llm_engine.runner.ctx.decode_form
        want = run(llm, [TARGET], params(False), 0)
        for others, seed in ((4, 5),):
            batch, place = random_batch(TARGET, others, seed)
            assert run(llm, batch, params(False), place) == want


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (tests/conftest.py makes 4 CPU devices)")
@pytest.mark.parametrize("quantization", [None, "fp8", "int4"])
def test_split_over_devices_a_request_keeps_its_bits_and_its_sums_run_in_order(tmp_path, quantization):
    """Tensor parallelism (2) in each of two data-parallel replicas, dense and with quantized weights
    (fp8's without offsets, int4's with them): the target's bits alone and among others (on either
    replica), seeded; the forward pass adds o's and down's partial sums in device order (gathered,
    where the default mode all-reduces them: only the embedding's lookup is)."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIG | {"num_attention_heads": 6, "num_key_value_heads": 2,
                                                               "head_dim": 96}))
    with LLM(str(tmp_path), batch_invariant=True, tensor_parallel_size=2, data_parallel_size=2,
             quantization=quantization, **ENGINE) as llm:
        want = run(llm, [TARGET], params(True), 0)
        for others, seed in ((3, 1), (6, 2)):
            batch, place = random_batch(TARGET, others, seed)
            assert run(llm, batch, params(True), place) == want
        runner = llm.llm_engine.replicas[1].runner
        text = runner.compile_forward(16).as_text()
    layers = CONFIG["num_hidden_layers"]
    assert len(re.findall(r"= \S+ all-reduce(?:-start)?\(", text)) == 1
    assert len(re.findall(r"= \S+ all-gather(?:-start)?\(", text)) == 2 * layers


def test_the_moe_mlp_gives_each_token_its_own_bits():
    """The MoE MLP on its own, as the runner runs it batch-invariant (its grouped matmul in fixed
    tiles), where no bucket pads the batch: each token's output row is the same bits alone and at
    any place in batches of 2, 7 and 64 rows, some of them padding (the default form cuts its
    products by what the batch routes to each expert, and its bits move between one row and two)."""
    cfg = ModelConfig("MixtralForCausalLM", 100, 512, 384, 1, 8, 2, 64, num_experts=4, num_experts_per_tok=2)
    rng = np.random.default_rng(3)
    router, gate_up, down = (jnp.asarray(rng.standard_normal(s) * 0.05, jnp.float32)
                             for s in ((512, 4), (4, 512, 768), (4, 384, 512)))
    x = jnp.asarray(rng.standard_normal((200, 512)), jnp.float32)
    grouped = moe_matmul(Kernels.choose("reference", batch_invariant=True), cfg)

    @jax.jit
    @jax.default_matmul_precision("highest")  # a float32 model's, as the runner sets it (a GPU's default is TF32)
    def mlp(x: jax.Array, valid: jax.Array) -> jax.Array:
        return moe_mlp(x, router, gate_up, down, jax.nn.silu, cfg, valid, grouped, batch_invariant=True)

    rows = [0, 1, 2, 3, 4, 150, 190]  # in 200 rows an expert's copies fill more than one tile of 64
    alone = np.stack([np.asarray(mlp(x[i : i + 1], jnp.ones(1, bool)))[0] for i in rows])
    for n, real in ((2, 2), (7, 5), (64, 5), (200, 200)):
        out = np.asarray(mlp(x[:n], jnp.arange(n) < real))
        kept = [j for j, i in enumerate(rows) if i < real]
        np.testing.assert_array_equal(out[[rows[j] for j in kept]], alone[kept])
        assert not out[real:].any()  # padding goes to no expert
    with jax.default_matmul_precision("highest"):
        default = np.asarray(moe_mlp(x[:5], router, gate_up, down, jax.nn.silu, cfg))
    np.testing.assert_allclose(alone[:5], default, rtol=1e-5, atol=1e-5 * np.abs(default).max())  # one function
    with pytest.raises(ValueError, match="fixed tiles"):
        moe_mlp(x, router, gate_up, down, jax.nn.silu, cfg, batch_invariant=True)  # ragged_dot's follow the batch


def test_the_norms_give_each_row_its_own_bits():
    """RMSNorm over Qwen3's 16 query heads of 128 (`llama.rms_norm`, `ordered` as the mode runs it):
    each row the same bits in 16, 64 and 256 tokens. XLA:CPU's reduction moves a row's low bits
    between those sizes; the fixed tree of adds (`common.tree_sum`) does not."""
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.standard_normal((256, 16, 128)), jnp.bfloat16)
    weight = jnp.asarray(1 + 0.1 * rng.standard_normal(128), jnp.bfloat16)
    norm = jax.jit(lambda x: rms_norm(x, weight, 1e-6, ordered=True))
    whole = np.asarray(norm(x))
    for n in (16, 64):
        np.testing.assert_array_equal(np.asarray(norm(x[:n])), whole[:n])
    np.testing.assert_allclose(np.asarray(whole, np.float32), np.asarray(rms_norm(x, weight, 1e-6), np.float32),
                               rtol=1e-2, atol=1e-2)  # the same function: bf16's rounding apart
    assert np.asarray(tree_sum(jnp.arange(1.0, 577.0))) == 576 * 577 / 2  # a width that is no power of two


@pytest.mark.parametrize("kernels", ["reference", "pallas"])
def test_a_prompt_cut_into_other_chunks_keeps_its_bits_with_qwen3s_heads(tmp_path, kernels):
    """Qwen3-0.6B's attention (16 query heads, 8 KV heads of 128, q/k norms) in bf16: a 300-token
    prompt alone (chunks of 256 and 44 tokens) and behind a 500-token one (chunks starting at other
    tokens) gives the same prompt and sampled logprobs. Three sums moved its bits here before: the
    q-norm's and the reference's softmax (XLA:CPU chose their order by the token count), and the
    Pallas kernel's whole-block loop (which blocks a chunk sees whole follows where it starts)."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIG | {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512, "hidden_size": 256,
        "intermediate_size": 512, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 2048, "rope_theta": 1e6}))
    rng = np.random.default_rng(0)
    target, before, after = (rng.integers(3, 512, n).tolist() for n in (300, 500, 700))
    sampling = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    with LLM(str(tmp_path), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024,
             max_num_seqs=4, max_num_batched_tokens=256, batch_invariant=True, enable_prefix_caching=False,
             kernels=kernels) as llm:
        def logprobs(prompts: list[list[int]], at: int) -> tuple[list[float], list[float]]:
            found = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)[at]
            out = found.outputs[0]
            return ([lp[t].logprob for t, lp in zip(found.prompt_token_ids[1:], found.prompt_logprobs[1:])],
                    [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)])

        assert logprobs([before, target, after], 1) == logprobs([target], 0)


@pytest.mark.parametrize("seed", [2, 3, 5])
def test_the_reference_attention_gives_each_row_its_own_bits(seed):
    """The reference attention as the mode runs it (its softmax's sums in `common.tree_sum`'s
    order): 44 queries of a 300-token context, Qwen3-0.6B's 8 KV heads of 2 query heads, the same
    bits in 64 and 256 tokens. XLA:CPU's own sum moved them on these seeds' pages."""
    rng = np.random.default_rng(seed)
    kc, vc = (jnp.asarray(rng.standard_normal((40, 16, 8, 128)), jnp.bfloat16) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((64, 16, 128)), jnp.bfloat16)
    table = jnp.asarray(np.arange(40)[None].repeat(8, 0), jnp.int32)
    qsl, lens = jnp.asarray([0] + [44] * 8, jnp.int32), jnp.asarray([300] + [0] * 7, jnp.int32)

    def attend(q: jax.Array) -> np.ndarray:
        return np.asarray(reference_ragged_paged_attention(q, kc, vc, qsl, lens, table, jnp.int32(1), sm_scale=0.088,
                                                           batch_invariant=True))[:44]

    np.testing.assert_array_equal(attend(jnp.pad(q, ((0, 192), (0, 0), (0, 0)))), attend(q))


def test_the_fixed_tile_matmul_gives_each_row_its_own_bits():
    """A GPU's batch-invariant projection (`row_tiles.fixed_tile_matmul`, interpreted here): each
    row the same bits alone and in 2, 5 or 100 rows (two tiles), and the product x @ w, K in the
    ranges the weight's shape fixes; a quantized weight takes the row tiles."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((100, 512)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((512, 48)) * 0.1, jnp.float32)
    product = jax.jit(lambda x, w: fixed_tile_matmul(matmul, x, w, interpret=True))
    rows = [0, 1, 2, 3, 4, 70, 99]  # the last two in the second tile of 64
    alone = np.stack([np.asarray(product(x[i : i + 1], w))[0] for i in rows])
    for n in (2, 5, 100):
        kept = [j for j, i in enumerate(rows) if i < n]
        np.testing.assert_array_equal(np.asarray(product(x[:n], w))[[rows[j] for j in kept]], alone[kept])
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(np.asarray(product(x, w)), np.asarray(x @ w), rtol=1e-5, atol=1e-5)
    # 16 columns, 32 of float32's K a step, two ranges of 256 (a program each: 6 programs are few)
    assert "grouped_matmul_m64_n16_k32_s2_spread" in str(jax.make_jaxpr(product)(x, w))
    held = quantize(w, "int8")
    np.testing.assert_array_equal(np.asarray(product(x[:5], held)), np.asarray(row_tiled(matmul, x[:5], held)))


def test_the_tiling_follows_the_weights_shape():
    """`row_tiles.tiling` at Llama-3-8B's and Qwen3-0.6B's projections: 128 columns, and K ranges
    that bring a decode's tile of rows to some 256 programs; a wide head needs none."""
    assert tiling(4096, 6144, 2) == (128, 64, 8)  # q|k|v: 48 column blocks
    assert tiling(14336, 4096, 2) == (128, 64, 8)  # down
    assert tiling(4096, 28672, 2) == (128, 64, 2)  # gate|up
    assert tiling(1024, 4096, 2) == (128, 64, 4)  # Qwen3-0.6B's q|k|v: ranges of 256
    assert tiling(4096, 128256, 2) == (128, 64, 1)  # the LM head


@pytest.mark.parametrize("tied", [False, True])
def test_a_gpus_lm_head_runs_in_fixed_tiles_in_fp32(tied):
    """A GPU's batch-invariant logits (`step.logits_matmul` with the Pallas kernels, interpreted here):
    the grouped matmul's fixed tiles, a tied head read as the embedding [vocab, hidden] as it is
    held, fp32 out of bf16 operands; each row the same bits alone and among 100, and the product."""
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((100, 64)), jnp.bfloat16)
    head = jnp.asarray(rng.standard_normal((80, 64) if tied else (64, 80)) * 0.1, jnp.bfloat16)
    product = jax.jit(logits_matmul(Kernels.choose("pallas", batch_invariant=True)), static_argnums=2)
    rows = [0, 3, 70, 99]
    alone = np.stack([np.asarray(product(x[i : i + 1], head, tied))[0] for i in rows])
    got = np.asarray(product(x, head, tied))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got[rows], alone)
    w = np.asarray(head, np.float64)
    want = np.asarray(x, np.float64) @ (w.T if tied else w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert "grouped_matmul_m64" in str(jax.make_jaxpr(product, static_argnums=2)(x, head, tied))


@pytest.mark.parametrize("tp", [1, 2])
def test_a_moe_models_request_gives_the_same_bits_in_any_batch(tmp_path, tp):
    """A Mixtral-shaped model (4 experts, 2 per token), seeded: the target's bits alone and among
    others, on one device and with its experts split over two (whose outputs add in device order:
    the only all-reduce left is the embedding's)."""
    if len(jax.devices()) < tp:
        pytest.skip(f"needs {tp} devices")
    (tmp_path / "config.json").write_text(json.dumps(CONFIG | {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 512, "intermediate_size": 384,
        "num_attention_heads": 8, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2}))
    with LLM(str(tmp_path), batch_invariant=True, tensor_parallel_size=tp, **ENGINE) as llm:
        want = run(llm, [TARGET], params(True), 0)
        for others, seed in ((3, 1), (6, 2)):
            batch, place = random_batch(TARGET, others, seed)
            assert run(llm, batch, params(True), place) == want
        text = llm.llm_engine.runner.compile_forward(16).as_text()
    assert len(re.findall(r"= \S+ all-reduce(?:-start)?\(", text)) == (1 if tp == 2 else 0)


def test_the_mode_tiles_the_rows(alone):
    """Its programs run their row-sized products one tile at a time: a loop over the rows in the
    compiled sampler that sums rows (logprobs) and none in the one that does not, and in the
    forward pass a loop, or on a GPU the grouped matmul kernel's fixed tiles."""
    runner = alone[1]
    ctx = runner.ctx

    def sampler_text(flags) -> str:
        sampler = runner.programs.program(SAMPLE, params=ctx.params, token_ids=ctx.state.token_ids,
                                          last_hidden=ctx.last_hidden(), samples=ctx.samples(4, flags), flags=flags)
        return runner.programs.executable(sampler).as_text()

    plain, with_logprobs = ctx.sampler_variants[:2]
    assert with_logprobs.sums_rows and not plain.sums_rows
    tiles = r"grouped_matmul_m64" if ctx.kernels.pallas and not ctx.kernels.interpret else r"\bwhile\("
    assert re.search(tiles, runner.compile_forward(16).as_text())
    loops = {flags: len(re.findall(r"\bwhile\(", sampler_text(flags))) for flags in (plain, with_logprobs)}
    assert loops[with_logprobs] == loops[plain] + 1  # the logits' own row tiles (off a GPU) in both


@pytest.mark.gpu
def test_on_the_gpu_each_part_of_a_step_keeps_a_rows_bits():
    """On the GPU, at Qwen3-0.6B's shapes in bf16: each part a batch-invariant step runs gives row
    0 the same bits alone and among 6, 16, 300 and 2048 rows (XLA's reductions and fusions are
    chosen by the shapes). Lists every part that does not."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.standard_normal((2048, 1024)), jnp.bfloat16)
    w = jnp.asarray(0.03 * rng.standard_normal((1024, 4096)), jnp.bfloat16)
    embed = jnp.asarray(0.03 * rng.standard_normal((151936, 1024)), jnp.bfloat16)
    norm = jnp.asarray(1 + 0.1 * rng.standard_normal(1024), jnp.bfloat16)
    kernels = Kernels.choose("auto", batch_invariant=True)
    parts = {
        "rms_norm": lambda x: rms_norm(x, norm, 1e-6, ordered=True),
        "qk_norm": lambda x: rms_norm(x.reshape(-1, 8, 128), norm[:128], 1e-6, ordered=True).reshape(x.shape[0], -1),
        "projection": lambda x: projection_matmul(kernels)(x, w),
        "logits": lambda x: logits_matmul(kernels)(x, embed, True),
        "log_softmax_in_row_tiles": lambda x: per_row(lambda r: jax.nn.log_softmax(r.astype(jnp.float32), axis=-1), x, True),
    }
    broken = []
    for name, f in parts.items():
        f = jax.jit(f)
        alone = np.asarray(f(x[:1]))[0]
        for n in (6, 16, 300, 2048):
            if not np.array_equal(np.asarray(f(x[:n]))[0], alone):
                broken.append((name, n))
    assert not broken
