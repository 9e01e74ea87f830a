"""Multi-LoRA: PEFT adapters on the tiny checkpoints against Hugging Face + PEFT (goldens from
scripts/make_lora_goldens.py), mixed batches, more adapters than slots, no recompiles, the prefix
cache, adapters that cannot run, and the server's `model` field."""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from driver import drive

from jaxrunner import LLM, LoRARequest, Runner, RunnerConfig, SamplingParams
from jaxrunner.bench.throughput import random_adapter
from jaxrunner.config import LoraConfig
from jaxrunner.checkpoints.loader import load_model
from jaxrunner.lora.adapters import Adapters
from jaxrunner.lora.slots import projection_parts
from jaxrunner.models.llama import lora_delta, slot_mask
from jaxrunner.step_io import NewRequestData, SchedulerOutput

DATA = Path(__file__).parent / "data"
GOLDENS = np.load(DATA / "goldens" / "lora.npz")
LLAMA_ADAPTERS = ["llama-qv-r4", "llama-all-r8", "llama-mlp-r16-rslora"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
ENGINE = dict(skip_tokenizer_init=True, dtype="float32", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=128,
              num_gpu_blocks_override=64)  # several engines at once on a GPU: a fixed cache each


def lora(name: str, lora_id: int, path: Path | None = None) -> LoRARequest:
    return LoRARequest(name, lora_id, str(path or DATA / "loras" / name))


def prompts(base: str) -> list[list[int]]:
    g = np.load(DATA / "goldens" / f"{base}.npz")
    return [g[f"prompt_{i}"].tolist() for i in range(4)]


def base_greedy(base: str) -> list[list[int]]:
    g = np.load(DATA / "goldens" / f"{base}.npz")
    return [g[f"greedy_{i}"].tolist() for i in range(4)]


@pytest.fixture(scope="module")
def llama():
    """Two slots for three adapters: a batch of all of them cycles the slots."""
    with LLM(str(DATA / "models" / "tiny-llama"), enable_lora=True, max_loras=2, max_lora_rank=16, **ENGINE) as llm:
        yield llm


def test_lora_delta_matches_a_per_token_reference():
    """Every slot's adapter in one pair of matmuls, masked per token, equals each token's own
    x @ A_slot @ B_slot (slot 0: no delta), on random inputs."""
    rng = np.random.default_rng(0)
    num_slots, rank, width, outs, tokens = 3, 4, 24, (16, 8, 8), 40
    # per slot and part: A [width, rank] and B [rank, out], laid out as models.lora keeps them
    a_parts = rng.normal(size=(num_slots, len(outs), width, rank)).astype(np.float32)
    b_parts = [[rng.normal(size=(rank, out)).astype(np.float32) for out in outs] for _ in range(num_slots)]
    a = a_parts.transpose(2, 0, 1, 3).reshape(width, -1)
    b = np.zeros((num_slots * len(outs) * rank, sum(outs)), np.float32)
    for s in range(num_slots):
        for p, out in enumerate(outs):
            row, col = (s * len(outs) + p) * rank, sum(outs[:p])
            b[row : row + rank, col : col + out] = b_parts[s][p]
    x = rng.normal(size=(tokens, width)).astype(np.float32)
    slots = rng.integers(0, num_slots + 1, size=tokens).astype(np.int32)
    with jax.default_matmul_precision("highest"):
        got = np.asarray(lora_delta(jnp.asarray(x), {"a": jnp.asarray(a), "b": jnp.asarray(b)},
                                    slot_mask(jnp.asarray(slots), num_slots, jnp.float32)))
    want = np.zeros((tokens, sum(outs)), np.float32)
    for t, s in enumerate(slots):
        if s > 0:
            want[t] = np.concatenate([x[t] @ a_parts[s - 1, p] @ b_parts[s - 1][p] for p in range(len(outs))])
    assert np.abs(want[slots == 0]).max() == 0 and np.abs(want[slots > 0]).max() > 1
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_adapters_match_peft_greedy_and_logprobs(llama):
    """One batch: the base model and every adapter on every prompt, two slots for three adapters.
    Greedy tokens equal PEFT's, prompt logprobs equal PEFT's logits' log-softmax, and the
    adapters change the output (the base model's tokens differ)."""
    asked, loras, want, logits = [], [], [], []
    requests = [None] + [lora(n, i) for i, n in enumerate(LLAMA_ADAPTERS, 1)]
    for i, prompt in enumerate(prompts("tiny-llama")):
        for req in requests:
            asked.append(prompt)
            loras.append(req)
            want.append(base_greedy("tiny-llama")[i] if req is None else GOLDENS[f"greedy_{req.lora_name}_{i}"].tolist())
            logits.append(None if req is None else GOLDENS[f"logits_{req.lora_name}_{i}"])
    writes = llama.llm_engine.runner.adapters.num_slot_writes
    outs = llama.generate(asked, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, prompt_logprobs=0),
                          use_tqdm=False, lora_request=loras)
    assert [o.outputs[0].token_ids for o in outs] == want
    for out, ref in zip(outs, logits):
        if ref is None:
            continue
        ref = np.asarray(jax.nn.log_softmax(jnp.asarray(ref), axis=-1))
        got = [d[t].logprob for t, d in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]
        np.testing.assert_allclose(got, ref[np.arange(len(got)), out.prompt_token_ids[1:]], atol=2e-4)
    for i in range(4):
        base, *adapted = want[4 * i : 4 * i + 4]
        assert all(tokens != base for tokens in adapted)
    assert llama.llm_engine.runner.adapters.num_slot_writes - writes >= 3  # more adapters than slots: reloads


def test_qwen3_adapter_matches_peft():
    """q/k norms, a tied head and head_dim != hidden / heads, with an adapter on k, o and down."""
    with LLM(str(DATA / "models" / "tiny-qwen3"), enable_lora=True, max_loras=1, max_lora_rank=8, **ENGINE) as llm:
        outs = llm.generate(prompts("tiny-qwen3"), GREEDY, use_tqdm=False, lora_request=lora("qwen3-kod-r8", 7))
    assert [o.outputs[0].token_ids for o in outs] == [GOLDENS[f"greedy_qwen3-kod-r8_{i}"].tolist() for i in range(4)]


def test_mixed_batch_gives_each_request_its_solo_tokens(llama):
    """Seeded sampling: base requests and three adapters in one batch (arriving together, prompts
    interleaved), each request exactly as when it runs alone."""
    params = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, seed=100 + i, ignore_eos=True) for i in range(8)]
    requests = [None, lora(LLAMA_ADAPTERS[0], 1), lora(LLAMA_ADAPTERS[1], 2), lora(LLAMA_ADAPTERS[2], 3)] * 2
    asked = [prompts("tiny-llama")[i % 4] for i in range(8)]
    together = llama.generate(asked, params, use_tqdm=False, lora_request=requests)
    for prompt, sp, req, out in zip(asked, params, requests, together):
        alone = llama.generate(prompt, sp, use_tqdm=False, lora_request=req)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids


def test_slots_are_reused_least_recently_used_first():
    cfg, _ = load_model(DATA / "models" / "tiny-llama")
    adapters = Adapters(cfg, LoraConfig(max_loras=2, max_lora_rank=16))
    for i, name in enumerate(LLAMA_ADAPTERS, 1):
        adapters.add(lora(name, i))
    slots, writes = adapters.activate({1, 2})
    assert slots == {1: 1, 2: 2} and [s for s, _ in writes] == [0, 1]
    assert adapters.activate({1}) == ({1: 1}, [])  # resident: no write; 2 is now the least recently used
    slots, writes = adapters.activate({3})
    assert slots == {3: 2} and [(s, a.request.lora_int_id) for s, a in writes] == [(1, 3)]
    slots, writes = adapters.activate({2, 3})  # 1 is evicted, not 3, which the step uses
    assert slots == {2: 1, 3: 2} and [(s, a.request.lora_int_id) for s, a in writes] == [(0, 2)]
    with pytest.raises(ValueError, match="more than max_loras=2"):
        adapters.activate({1, 2, 3})


def test_adapters_come_and_go_without_a_recompile():
    """After warm-up, four adapters cycling through one slot compile nothing. One adapter a step, so
    one request a step: a request slot, one request bucket to warm up."""
    with LLM(str(DATA / "models" / "tiny-llama"), enable_lora=True, max_loras=1, max_lora_rank=16, enforce_eager=False,
             skip_tokenizer_init=True, dtype="float32", max_model_len=64, max_num_seqs=1, max_num_batched_tokens=32,
             num_gpu_blocks_override=16) as llm:
        programs = llm.llm_engine.runner.programs
        assert any(key[0] == "write_lora" for key in programs.warm)
        requests = [lora(n, i) for i, n in enumerate(LLAMA_ADAPTERS, 1)] + [lora("llama-qv-r4-again", 9, DATA / "loras" / "llama-qv-r4")]
        outs = llm.generate([prompts("tiny-llama")[0]] * 4, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                            use_tqdm=False, lora_request=requests)
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
        assert outs[0].outputs[0].token_ids == outs[3].outputs[0].token_ids  # the same adapter under another id
        assert llm.llm_engine.runner.adapters.num_slot_writes >= 4
        assert programs.compiled_on_use == 0


def test_prefix_cache_keys_include_the_adapter(llama):
    prompt = list(range(3, 3 + 40))  # two full blocks of 16 tokens
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    first = llama.generate(prompt, sp, use_tqdm=False, lora_request=lora(LLAMA_ADAPTERS[0], 1))[0]
    again = llama.generate(prompt, sp, use_tqdm=False, lora_request=lora(LLAMA_ADAPTERS[0], 1))[0]
    other = llama.generate(prompt, sp, use_tqdm=False, lora_request=lora(LLAMA_ADAPTERS[1], 2))[0]
    base = llama.generate(prompt, sp, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0


def broken_adapter(tmp_path: Path, name: str, config: dict | None = None, rename: tuple[str, str] | None = None,
                   drop_weights: bool = False) -> Path:
    path = tmp_path / name
    shutil.copytree(DATA / "loras" / "llama-all-r8", path)
    if config is not None:
        (path / "adapter_config.json").write_text(json.dumps(config) if isinstance(config, dict) else config)
    if rename is not None:
        tensors = load_file(path / "adapter_model.safetensors")
        save_file({k.replace(*rename): v for k, v in tensors.items()}, path / "adapter_model.safetensors")
    if drop_weights:
        (path / "adapter_model.safetensors").unlink()
    return path


def test_an_adapter_that_cannot_run_fails_its_request_alone(llama, tmp_path):
    good_config = json.loads((DATA / "loras" / "llama-all-r8" / "adapter_config.json").read_text())
    cases = {
        "rank above max_lora_rank": (broken_adapter(tmp_path, "r32", good_config | {"r": 32}), "exceeds max_lora_rank=16"),
        "unknown module": (broken_adapter(tmp_path, "emb", rename=("mlp.up_proj", "mlp.up_projection")),
                           "unknown target module 'up_projection'"),
        "missing weights": (broken_adapter(tmp_path, "nofile", drop_weights=True), "adapter_model.safetensors is missing"),
        "malformed config": (broken_adapter(tmp_path, "badjson", "{not json"), "cannot read adapter_config.json"),
        "another model's adapter": (DATA / "loras" / "qwen3-kod-r8", "expected"),
        "no directory": (tmp_path / "nowhere", "no such directory"),
    }
    asked = prompts("tiny-llama")[:2]
    for i, (case, (path, message)) in enumerate(cases.items()):
        requests = [lora(LLAMA_ADAPTERS[0], 1), lora(case, 100 + i, path)]
        outs = llama.generate(asked, GREEDY, use_tqdm=False, lora_request=requests)
        assert outs[0].outputs[0].token_ids == GOLDENS[f"greedy_{LLAMA_ADAPTERS[0]}_0"].tolist(), case
        assert outs[1].outputs[0].finish_reason == "error" and message in outs[1].error, (case, outs[1].error)
    assert not llama.llm_engine.has_unfinished_requests()


def test_lora_requests_need_lora_on():
    with LLM(str(DATA / "models" / "tiny-llama"), **ENGINE) as llm:
        with pytest.raises(ValueError, match="enable_lora=True"):
            llm.generate(prompts("tiny-llama")[0], GREEDY, use_tqdm=False, lora_request=lora(LLAMA_ADAPTERS[0], 1))
    with pytest.raises(ValueError, match="lora_int_id must be at least 1"):
        LoRARequest("x", 0, "/tmp")


def test_runner_refuses_more_adapters_than_slots_and_stays_usable():
    cfg, params = load_model(DATA / "models" / "tiny-llama")
    runner = Runner(cfg, params, RunnerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=8,
                                              num_blocks=32, lora=LoraConfig(max_loras=1, max_lora_rank=16)))
    state = runner.init_state()
    prompt = prompts("tiny-llama")[0]

    def new(rid: str, req: LoRARequest, blocks: list[int]) -> NewRequestData:
        return NewRequestData(rid, prompt, (blocks,), sampling_params=GREEDY, lora_request=req)

    two = [new("a", lora(LLAMA_ADAPTERS[0], 1), [0]), new("b", lora(LLAMA_ADAPTERS[1], 2), [1])]
    bad = SchedulerOutput(two, num_scheduled_tokens={"a": 5, "b": 5}, total_num_scheduled_tokens=10)
    with pytest.raises(ValueError, match="more than max_loras=1"):
        runner.step(state, bad)
    one = SchedulerOutput(two[:1], num_scheduled_tokens={"a": 5}, total_num_scheduled_tokens=5)
    state, out = runner.step(state, one)
    assert out.sampled_token_ids == [[GOLDENS[f"greedy_{LLAMA_ADAPTERS[0]}_0"][0]]]


def test_server_model_field_names_an_adapter_and_adapters_load_while_serving(tmp_path):
    from test_server import post, start_server, stop_server

    loras = DATA / "loras"
    (tmp_path / "roots").mkdir()
    (tmp_path / "roots" / "outside").symlink_to(tmp_path)  # a link out of the roots
    proc, url = start_server(str(DATA / "models" / "tiny-llama"), "--skip-tokenizer-init", "--dtype", "float32",
                             "--max-model-len", "128", "--enable-lora", "--max-loras", "2",
                             "--lora-modules", f"qv={loras / LLAMA_ADAPTERS[0]}", f"all={loras / LLAMA_ADAPTERS[1]}",
                             "--allow-runtime-lora-updating", "--lora-roots", str(loras), str(tmp_path / "roots"))
    prompt = prompts("tiny-llama")[1]

    def complete(model: str) -> tuple[int, dict]:
        return post(f"{url}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                                              "ignore_eos": True, "logprobs": 0})

    def manage(route: str, body: dict) -> tuple[int, str]:
        """The adapter routes answer in plain text (vLLM's), errors in OpenAI's JSON."""
        request = urllib.request.Request(f"{url}/v1/{route}", json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())["error"]["message"]

    def tokens(reply: dict) -> list[int]:
        return [int(t.removeprefix("token_id:")) for t in reply["choices"][0]["logprobs"]["tokens"]]

    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
            cards = json.loads(r.read())["data"]
        assert [c["id"] for c in cards][1:] == ["qv", "all"] and cards[2]["parent"] == cards[0]["id"]
        assert str(loras) not in json.dumps(cards)  # no server paths shown
        for model, name in (("qv", LLAMA_ADAPTERS[0]), ("all", LLAMA_ADAPTERS[1])):
            code, reply = complete(model)
            assert code == 200 and reply["model"] == model
            assert tokens(reply) == GOLDENS[f"greedy_{name}_1"][:8].tolist()
        code, reply = complete(cards[0]["id"])
        assert tokens(reply) == base_greedy("tiny-llama")[1][:8]
        code, reply = complete("mlp")
        assert code == 404 and "'mlp' does not exist" in reply["error"]["message"]

        assert manage("load_lora_adapter", {"lora_name": "mlp", "lora_path": str(loras / LLAMA_ADAPTERS[2])})[0] == 200
        code, reply = complete("mlp")
        assert code == 200 and tokens(reply) == GOLDENS[f"greedy_{LLAMA_ADAPTERS[2]}_1"][:8].tolist()
        refusals = {manage("load_lora_adapter", {"lora_name": "x", "lora_path": path})[1].replace(path, "PATH")
                    for path in ("/etc", "/no/such/dir", str(tmp_path / "roots" / "outside"), str(loras / ".." / ".."))}
        assert len(refusals) == 1 and "--lora-roots" in refusals.pop()  # the same words whether it exists or not
        broken = broken_adapter(tmp_path / "roots", "r32", {"peft_type": "LORA", "r": 32, "lora_alpha": 8})
        code, message = manage("load_lora_adapter", {"lora_name": "big", "lora_path": str(broken)})
        assert code == 400 and "exceeds max_lora_rank=16" in message
        assert complete("big")[0] == 404
        assert manage("unload_lora_adapter", {"lora_name": "mlp"})[0] == 200 and complete("mlp")[0] == 404
    finally:
        stop_server(proc)


@pytest.mark.parametrize("mode", [dict(num_scheduler_steps=4),
                                  dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3})])
def test_multistep_decode_and_drafts_keep_each_adapters_tokens(mode):
    """The multi-step loop and the drafts' verification pass carry each token's slot too."""
    with LLM(str(DATA / "models" / "tiny-llama"), enable_lora=True, max_loras=3, max_lora_rank=16, **ENGINE, **mode) as llm:
        requests = [lora(n, i) for i, n in enumerate(LLAMA_ADAPTERS, 1)]
        asked = [p for p in prompts("tiny-llama") for _ in requests]
        outs = llm.generate(asked, GREEDY, use_tqdm=False, lora_request=requests * 4)
        stats = llm.llm_engine.stats()
    want = [GOLDENS[f"greedy_{r.lora_name}_{i}"].tolist() for i in range(4) for r in requests]
    assert [o.outputs[0].token_ids for o in outs] == want
    if "speculative_config" in mode:
        assert stats.spec_decoding["num_accepted_tokens"] > 0


def test_an_adapter_on_a_moe_models_attention_equals_its_merged_weights(tmp_path):
    """tiny-qwen3-moe with a random adapter on q, k, v and o: its greedy tokens equal the base
    model's with the adapter merged into the weights (W + A B, as PEFT merges), and differ from the
    base model's; an adapter on the MLP, whose experts take none, is refused by name."""
    path = DATA / "models" / "tiny-qwen3-moe"
    cfg, params = load_model(path, "float32")
    adapter_path = random_adapter(str(tmp_path / "attention"), cfg, 8, seed=3)
    config = LoraConfig(max_loras=1, max_lora_rank=8)
    parts = Adapters(cfg, config).add(lora("attention", 1, Path(adapter_path))).parts
    assert {name for _, name, _ in parts} == {"wqkv", "wo"}
    merged = [dict(layer) for layer in params["layers"]]
    for (i, name, part), (a, b) in parts.items():
        start = sum(projection_parts(cfg)[name][1][:part])
        merged[i][name] = merged[i][name].at[:, start : start + b.shape[1]].add(jnp.asarray(a @ b))
    runner = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=8, num_blocks=48)
    prompt_ids = [[5, 9, 13, 2, 7], [3, 1, 4, 1, 5, 9, 2, 6]]
    adapted = Runner(cfg, params, RunnerConfig(**runner, lora=config))
    with_adapter = drive(adapted, prompt_ids, 10, lora_request=lora("attention", 1, Path(adapter_path)))
    assert with_adapter == drive(Runner(cfg, dict(params, layers=tuple(merged)), RunnerConfig(**runner)), prompt_ids, 10)
    assert with_adapter != drive(Runner(cfg, params, RunnerConfig(**runner)), prompt_ids, 10)

    mlp = tmp_path / "mlp"
    mlp.mkdir()
    (mlp / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "target_modules": ["gate_proj"]}))
    prefix = "base_model.model.model.layers.0.mlp.gate_proj"
    save_file({f"{prefix}.lora_A.weight": np.zeros((4, cfg.hidden_size), np.float32),
               f"{prefix}.lora_B.weight": np.zeros((cfg.intermediate_size, 4), np.float32)},
              str(mlp / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="'gate_proj' is not in this model .*Mixture of Experts.*q_proj"):
        Adapters(cfg, config).add(lora("mlp", 2, mlp))
