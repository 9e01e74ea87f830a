"""Tensor parallelism on four CPU devices (tests/conftest.py): greedy tokens at TP 2 and 4 equal to
Hugging Face's (TP 1's) on the tiny checkpoints, GQA with fewer KV heads than devices included; a
vocabulary the split does not divide, padded; the params and the cache really split; the compiled
step's collectives; MoE models' experts split by expert; sizes that cannot split; two processes of two devices each running as one mesh."""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from driver import drive
from jax.sharding import PartitionSpec as P

from jaxrunner import LLM, Runner, RunnerConfig, SamplingParams
from jaxrunner.config import SamplerConfig
from jaxrunner.checkpoints.loader import load_model
from jaxrunner.runner.programs import SAMPLE

DATA = Path(__file__).parent / "data"
CONFIG = dict(max_num_seqs=4, max_num_batched_tokens=128, max_model_len=128, block_size=8, num_blocks=96)
pytestmark = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (tests/conftest.py makes 4 CPU devices)")


def goldens(name: str) -> tuple[list[list[int]], list[list[int]]]:
    g = np.load(DATA / "goldens" / f"{name}.npz")
    return [g[f"prompt_{i}"].tolist() for i in range(4)], [g[f"greedy_{i}"].tolist() for i in range(4)]


def collectives(text: str) -> dict[str, int]:
    return {op: len(re.findall(rf"= \S+ {op}(?:-start)?\(", text)) for op in ("all-reduce", "all-gather", "all-to-all",
                                                                              "collective-permute", "reduce-scatter")}


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3", "tiny-qwen3-moe", "tiny-mixtral"])
@pytest.mark.parametrize("tp", [2, 4])
def test_greedy_tokens_equal_tp1(name, tp):
    """tiny-llama has 2 KV heads (repeated at TP 4), tiny-qwen2 one (q/k/v biases), tiny-qwen3 q/k
    norms and a tied head, tiny-gemma3 one KV head, Gemma's extra norms and a sliding and a global
    layer; tiny-qwen3-moe (8 experts) and tiny-mixtral (4) split their experts by expert; chunked
    prefill and staggered arrivals as elsewhere."""
    cfg, params = load_model(DATA / "models" / name, "float32")
    runner = Runner(cfg, params, RunnerConfig(**CONFIG, tensor_parallel_size=tp))
    prompts, want = goldens(name)
    assert drive(runner, prompts, 32, chunk=11, stagger=1) == want


ODD_VOCAB = 509  # a prime: TP 2 pads it to 510 tokens, TP 4 to 512
ODD_PARAMS = [
    SamplingParams(temperature=0.0, logprobs=5, prompt_logprobs=-1),
    SamplingParams(temperature=0.0, logprobs=-1, prompt_logprobs=3),
    SamplingParams(temperature=0.0, logprobs=-1),
    SamplingParams(temperature=0.0, logprobs=2),
    SamplingParams(temperature=0.8, seed=3, top_k=40, top_p=0.9, repetition_penalty=1.2,
                   logit_bias={ODD_VOCAB - 1: 2.0}, logprobs=-1),
]


def odd_vocab_generate(tp: int, untied: bool = False) -> tuple[Runner, list[list[int]], list]:
    """tiny-qwen3 cut to its first ODD_VOCAB tokens at TP `tp`: (the runner, the tokens of the goldens'
    four prompts and of the second again, with ODD_PARAMS, every RunnerOutput). Every prompt and
    greedy token of the goldens is below ODD_VOCAB and the cut leaves those tokens' logits as they
    were, so Hugging Face's greedy tokens are still the goldens'. `untied`: the head stored apart from
    the embedding (the same numbers), so that the LM head is padded too."""
    cfg, params = load_model(DATA / "models" / "tiny-qwen3", "float32")
    embed = params["embed"][:ODD_VOCAB]
    params = dict(params, embed=embed) | ({"lm_head": embed.T} if untied else {})
    cfg = dataclasses.replace(cfg, vocab_size=ODD_VOCAB, tie_word_embeddings=not untied)
    config = RunnerConfig(**CONFIG | dict(max_num_seqs=8, request_buckets=(8,)), sampler=SamplerConfig(max_logprobs=-1),
                          tensor_parallel_size=tp)
    runner = Runner(cfg, params, config)
    prompts, _ = goldens("tiny-qwen3")
    outputs = []
    tokens = drive(runner, prompts + prompts[1:2], 32, params=ODD_PARAMS, chunk=11, stagger=1, outputs=outputs)
    return runner, tokens, outputs


@functools.cache
def odd_vocab_tp1() -> tuple[list[list[int]], list]:
    return odd_vocab_generate(1)[1:]


def logprob_rows(outputs: list) -> dict[tuple[str, str], list[dict[int, float]]]:
    """The logprob rows of each request's sampled tokens and of its prompt, by (request id,
    "sampled" or "prompt"), each row as {token id: logprob}."""
    rows: dict[tuple[str, str], list[dict[int, float]]] = {}
    for out in outputs:
        for kind, found in (("sampled", out.logprobs), ("prompt", out.prompt_logprobs_dict)):
            for rid, lp in found.items():
                rows.setdefault((rid, kind), []).extend(
                    dict(zip(ids.tolist(), values.tolist())) for ids, values in zip(lp.token_ids, lp.logprobs))
    return rows


@pytest.mark.parametrize("tp, untied, padded", [(2, False, 510), (4, True, 512)])
def test_a_vocabulary_the_split_does_not_divide_is_padded_and_never_seen(tp, untied, padded):
    """HF's greedy tokens, and TP 1's sampled ones (top-k, top-p, a penalty and a logit bias on the
    last real token); the logprobs TP 1's, of real tokens only: top-k, the whole vocabulary
    (max_logprobs=-1: exactly ODD_VOCAB of them), and the prompt's."""
    runner, tokens, outputs = odd_vocab_generate(tp, untied)
    tp1_tokens, tp1_outputs = odd_vocab_tp1()
    embed, hidden = runner.params["embed"], runner.model_config.hidden_size
    assert runner.model_config.padded_vocab_size == padded and embed.shape == (padded, hidden)
    assert {s.data.shape for s in embed.addressable_shards} == {(padded // tp, hidden)}
    assert not np.asarray(embed)[ODD_VOCAB:].any()
    if untied:
        head = runner.params["lm_head"]
        assert {s.data.shape for s in head.addressable_shards} == {(hidden, padded // tp)}
        assert not np.asarray(head)[:, ODD_VOCAB:].any()

    _, want = goldens("tiny-qwen3")
    assert tokens[:4] == tp1_tokens[:4] == want and tokens[4] == tp1_tokens[4]
    got, tp1 = logprob_rows(outputs), logprob_rows(tp1_outputs)
    whole = {("0", "prompt"), ("1", "sampled"), ("2", "sampled"), ("4", "sampled")}  # logprobs=-1
    assert got.keys() == tp1.keys() == whole | {("0", "sampled"), ("1", "prompt"), ("3", "sampled")}
    assert all(len(row) == ODD_VOCAB for key in whole for row in got[key])
    for key, rows in tp1.items():
        assert len(got[key]) == len(rows)
        for row, tp1_row in zip(got[key], rows):
            assert row.keys() == tp1_row.keys() and max(row) < ODD_VOCAB
            np.testing.assert_allclose([row[t] for t in tp1_row], list(tp1_row.values()), rtol=0, atol=1e-4)


def test_params_and_cache_are_split_over_the_devices():
    cfg, params = load_model(DATA / "models" / "tiny-llama", "float32")  # 4 q heads, 2 KV heads, head_dim 16
    runner = Runner(cfg, params, RunnerConfig(**CONFIG, tensor_parallel_size=4))
    layer = runner.params["layers"][0]
    assert layer["wqkv"].sharding.spec == P(None, "model") and layer["w_down"].sharding.spec == P("model", None)
    # each device: its q head and one KV head (each of the 2 repeated for 2 devices), q|k|v side by side
    assert {s.data.shape for s in layer["wqkv"].addressable_shards} == {(64, 16 * 3)}
    assert {s.data.shape for s in runner.params["embed"].addressable_shards} == {(128, 64)}  # 512 tokens / 4
    assert runner.model_config.num_kv_heads == 4 and runner.model_config.shards == 4
    state = runner.init_state()
    assert {s.data.shape for s in state.kv[0][0].addressable_shards} == {(96, 8, 1, 16)}
    assert len({s.device for s in state.kv[0][0].addressable_shards}) == 4


def test_the_step_all_reduces_twice_a_layer_and_never_gathers_weights():
    cfg, params = load_model(DATA / "models" / "tiny-llama", "float32")
    runner = Runner(cfg, params, RunnerConfig(**CONFIG, tensor_parallel_size=2))
    forward = collectives(runner.compile_forward(16).as_text())
    # o and down end in an all-reduce each; the vocabulary-split embedding lookup adds one
    assert forward == {"all-reduce": 2 * cfg.num_layers + 1, "all-gather": 0, "all-to-all": 0,
                       "collective-permute": 0, "reduce-scatter": 0}
    # the sampler: each device's slice of the logits, gathered ([B, V]: not the LM head's weight)
    ctx, flags = runner.ctx, runner.ctx.sampler_variants[0]
    sample = runner.programs.program(SAMPLE, params=ctx.params, token_ids=ctx.state.token_ids,
                                     last_hidden=ctx.last_hidden(), samples=ctx.samples(4, flags), flags=flags)
    text = runner.programs.executable(sample).as_text()
    assert collectives(text) == {"all-reduce": 0, "all-gather": 1, "all-to-all": 0, "collective-permute": 0,
                                 "reduce-scatter": 0}
    assert re.search(rf"= f32\[4,{cfg.vocab_size}\]\S* all-gather\(", text)


def test_moe_splits_its_experts_and_all_reduces_twice_a_layer():
    """Expert parallelism in the gather-compute-reduce form: each device holds a quarter of
    tiny-qwen3-moe's experts (the router whole), and the MoE MLP ends in one all-reduce, as the dense
    MLP's down projection does; no weight is gathered."""
    cfg, params = load_model(DATA / "models" / "tiny-qwen3-moe", "float32")
    runner = Runner(cfg, params, RunnerConfig(**CONFIG, tensor_parallel_size=4))
    layer = runner.params["layers"][0]
    for name in ("experts_gate_up", "experts_down"):
        assert layer[name].sharding.spec == P("model", None, None)
        assert {s.data.shape[0] for s in layer[name].addressable_shards} == {cfg.num_experts // 4}
    assert layer["router"].sharding.spec == P()
    forward = collectives(runner.compile_forward(16).as_text())
    assert forward == {"all-reduce": 2 * cfg.num_layers + 1, "all-gather": 0, "all-to-all": 0,
                       "collective-permute": 0, "reduce-scatter": 0}


def test_sizes_that_cannot_split_fail_at_start_naming_them():
    cfg, params = load_model(DATA / "models" / "tiny-llama", "float32")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide the model's num_attention_heads=4, "
                                         r"intermediate_size=128, num_key_value_heads=2"):
        Runner(cfg, params, RunnerConfig(**CONFIG, tensor_parallel_size=3))
    with pytest.raises(ValueError, match="tensor_parallel_size=8 needs 8 devices, but 4 CPU device"):
        Runner(cfg, params, RunnerConfig(**CONFIG, tensor_parallel_size=8))
    moe, moe_params = load_model(DATA / "models" / "tiny-mixtral", "float32")
    with pytest.raises(ValueError, match=r"does not divide the model's num_attention_heads=4, num_local_experts=4,"):
        Runner(moe, moe_params, RunnerConfig(**CONFIG, tensor_parallel_size=3))


@pytest.mark.parametrize("mode", [dict(num_scheduler_steps=4),
                                  dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3})])
def test_engine_at_tp2_matches_hf_with_multistep_decode_and_drafts(mode):
    prompts, want = goldens("tiny-qwen3")
    with LLM(str(DATA / "models" / "tiny-qwen3"), skip_tokenizer_init=True, dtype="float32", max_model_len=128,
             tensor_parallel_size=2, **mode) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want


def test_two_processes_of_two_devices_generate_as_one_mesh(tmp_path):
    """The multi-host path on one machine: two processes joined by `jax.distributed.initialize`
    (gloo on CPU), TP 4 over both, each running the same engine; both get HF's tokens. They keep
    their compiled programs apart from this process's (made for two devices, not four: XLA:CPU
    fails to run such an executable here)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = Path(__file__).parent / "multihost_worker.py"
    env = dict(os.environ, JAXRUNNER_CACHE=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, str(worker), str(rank), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for rank in range(2)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    _, want = goldens("tiny-llama")
    for result in results:
        assert result["devices"] == 4 and result["local_devices"] == 2 and result["tokens"] == want


@pytest.mark.parametrize("tp", [1, 2])
def test_data_parallel_replicas_share_the_requests_and_keep_their_tokens(tp):
    """DP 2 x TP 1 and DP 2 x TP 2 (all four devices): every request's tokens are HF's, and both
    replicas ran requests, each on devices of its own."""
    prompts, want = goldens("tiny-llama")
    with LLM(str(DATA / "models" / "tiny-llama"), skip_tokenizer_init=True, dtype="float32", max_model_len=128,
             data_parallel_size=2, tensor_parallel_size=tp) as llm:
        outs = llm.generate(prompts * 2, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False)
        replicas = llm.llm_engine.replicas
        served = [r.block_manager.stats.requests for r in replicas]
        devices = [{d.id for s in r.state.kv[0][0].addressable_shards for d in [s.device]} for r in replicas]
    assert [o.outputs[0].token_ids for o in outs] == want * 2
    assert served == [4, 4] and devices == ([{0}, {1}] if tp == 1 else [{0, 1}, {2, 3}])


def test_more_replicas_than_devices_fail_at_start():
    with pytest.raises(ValueError, match="replica 1 of tensor_parallel_size=4 needs 8 devices, but 4 CPU"):
        LLM(str(DATA / "models" / "tiny-llama"), skip_tokenizer_init=True, dtype="float32", max_model_len=128,
            data_parallel_size=2, tensor_parallel_size=4)


def test_replicas_warmed_from_the_program_cache_run_on_their_own_devices(tmp_path, monkeypatch, fresh_jax_cache):
    """A replica's programs are cached apart from another's (replica 0's would run on device 0). A
    request slot per replica: one request bucket to compile and store."""
    monkeypatch.setenv("JAXRUNNER_CACHE", str(tmp_path))
    prompts, want = goldens("tiny-llama")
    args = dict(skip_tokenizer_init=True, dtype="float32", max_model_len=64, max_num_seqs=1, max_num_batched_tokens=32,
                data_parallel_size=2, enforce_eager=False)
    for round_ in range(2):  # compiled and stored, then (the first engines gone) loaded from the cache
        llm = LLM(str(DATA / "models" / "tiny-llama"), **args)
        outs = llm.generate(prompts[:2] * 2, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        replicas = llm.llm_engine.replicas
        loaded = [r.runner.programs.loaded for r in replicas]
        programs = [len(r.runner.programs.warm) for r in replicas]
        devices = [{s.device.id for s in r.state.kv[0][0].addressable_shards} for r in replicas]
        llm.close()
        del llm, replicas
        gc.collect()
        assert [o.outputs[0].token_ids for o in outs] == [w[:8] for w in want[:2]] * 2 and devices == [{0}, {1}]
        if round_ == 0:
            assert len(list(tmp_path.rglob("*.jaxexe"))) == sum(programs)
    assert loaded == programs
