"""Time to first token when a long prefix comes back after the device's prefix cache evicted it:
computed again, or copied back from the host tier (`kv_offloading_size`); and the decode speed of
other requests meanwhile.

Each of `--users` conversations has a prefix of `--prefix` tokens. The device's cache holds the
decoding requests at their longest and one and a half prefixes, so visiting the users in turn
evicts each prefix before it comes back. Per mode (a fresh engine each): every prefix once, then `--decoders` requests
decoding all along; a window of steps with nothing else (their tokens/s alone), then `--rounds`
visits of every user, a prefix plus `--message` new tokens and one output token each (TTFT from
adding the request to its token, with the decoders' tokens/s over the visits).

    PYTHONPATH=$PWD python3 benchmarks/kv_offload.py [--shape llama3-8b] [--prefix 8192] [--users 4]
Writes $OUT/kv_offload.json when OUT is set.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

import jax
import numpy as np

from jaxrunner.checkpoints.dummy import SHAPES, shape
from jaxrunner.engine.engine import LLMEngine
from jaxrunner.engine.engine_args import EngineArgs
from jaxrunner.runner.memory import bytes_per_block
from jaxrunner.runner.pending_output import PendingOutput
from jaxrunner.sampling_params import SamplingParams


def run(args: argparse.Namespace, tier: bool) -> dict:
    block_size = 16
    per_user = -(-(args.prefix + args.message + 1) // block_size)
    decoders = args.decoders * -(-(args.decoder_prompt + args.decoder_tokens) // block_size)
    engine = LLMEngine(EngineArgs(
        model=args.shape, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
        max_model_len=args.prefix + args.message + 16, max_num_seqs=args.decoders + 2,
        max_num_batched_tokens=args.chunk, num_gpu_blocks_override=decoders + per_user * 3 // 2 + 1,
        kv_offloading_size=args.host_gib if tier else None, enforce_eager=not args.warm_up))
    rng = np.random.default_rng(0)
    vocab = engine.model_config.vocab_size
    prefixes = [rng.integers(3, vocab, args.prefix).tolist() for _ in range(args.users)]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    copies = engine.runner.host_kv.stats if tier else None
    in_parts, dispatches = _time_parts(engine, tier)
    # Per step of the visits (and of the decoders' window alone): ms, ms of it in the tier's copies,
    # decoder tokens, after it: the visit waiting for its loads, the visit running, the load batches
    # arrived; then ms of the step in each of `in_parts` (the host's time in each).
    steps: list[list] = []
    window_steps: list[list] = []

    def step(rows: list[list], counting: set[str], rid: str = "") -> list:
        began, copying, parts = time.perf_counter(), copies.seconds if copies else 0.0, dict(in_parts)
        outs = engine.step()
        scheduler = engine.scheduler
        rows.append([round(1e3 * (time.perf_counter() - began), 2),
                     round(1e3 * ((copies.seconds if copies else 0.0) - copying), 2),
                     sum(out.request_id in counting for out in outs),
                     rid in scheduler.loading, any(r.req_id == rid for r in scheduler.running),
                     engine.runner.host_kv.arrived() if copies else 0,
                     *(round(1e3 * (in_parts[k] - parts[k]), 2) for k in in_parts)])
        return outs

    def visit(rid: str, prefix: list[int], counting: set[str]) -> tuple[float, int]:
        """Seconds to the visit's first token, and the tokens the decoders made meanwhile."""
        engine.add_request(rid, {"prompt_token_ids": prefix + rng.integers(3, vocab, args.message).tolist()}, one)
        start, made, rows = time.perf_counter(), 0, steps if counting else []
        while True:
            outs = step(rows, counting, rid)
            made += rows[-1][2]
            if any(out.request_id == rid and out.outputs[0].token_ids for out in outs):
                return time.perf_counter() - start, made

    for u, prefix in enumerate(prefixes):  # the first visits: computed either way
        visit(f"first-{u}", prefix, set())
    long = SamplingParams(temperature=0.0, max_tokens=args.decoder_tokens, ignore_eos=True)
    decoding = {f"decode-{i}" for i in range(args.decoders)}
    for rid in decoding:
        engine.add_request(rid, {"prompt_token_ids": rng.integers(3, vocab, args.decoder_prompt).tolist()}, long)
    for _ in range(8):  # the decoders' prefills, out of the windows
        engine.step()
    start, made = time.perf_counter(), 0
    for _ in range(args.window):
        made += sum(out.request_id in decoding for out in step(window_steps, decoding))
    alone = made / (time.perf_counter() - start)
    ttfts, made, spent = [], 0, 0.0
    for r in range(args.rounds):
        for u, prefix in enumerate(prefixes):
            seconds, tokens = visit(f"visit-{r}-{u}", prefix, decoding)
            ttfts.append(seconds)
            made, spent = made + tokens, spent + seconds
    stats = engine.stats()
    load_rate = _load_rate(engine.runner.host_kv, 2 * per_user) if tier else {}
    engine.abort_request(list(decoding), final_output=False)
    engine.close()
    return {
        "ttft_ms_median": round(1e3 * statistics.median(ttfts), 1), "ttft_ms": [round(1e3 * t, 1) for t in ttfts],
        "decoders_tokens_per_s_alone": round(alone, 1), "decoders_tokens_per_s_during_visits": round(made / spent, 1),
        "prefix_cache_hits": stats.prefix_cache_hits, "kv_offload_hits": stats.kv_offload_hits,
        "kv_offload_gb_loaded": round(stats.kv_offload_bytes_loaded / 1e9, 3),
        "kv_offload_gb_saved": round(stats.kv_offload_bytes_saved / 1e9, 3),
        "kv_offload_seconds": round(stats.kv_offload_seconds, 3), **load_rate,
        "compiled_on_use": engine.runner.programs.compiled_on_use,
        "first_dispatches": _first_dispatches(dispatches),
        "visit_step_columns": ["ms", "tier_ms", "decoder_tokens", "loading", "running", "arrived", *in_parts],
        "visit_steps": steps, "window_steps": window_steps,
    }


def _time_parts(engine: LLMEngine, tier: bool) -> tuple[dict[str, float], dict[tuple, list[float]]]:
    """Seconds spent so far in the parts of a step that could hold the host up (wrapped here):
    waiting for a step's output; with the tier, writing arrived pieces, starting copies and each
    of the tier's programs; the engine's parts (`execute` holds the tier's write and gathers), and
    the dispatch of the step's other programs. Then each program's dispatches, in seconds: a
    program's first run on the GPU may cost the host far more than its later ones."""
    spent = {"output_wait": 0.0, "write_arrived": 0.0, "start_copies": 0.0, "gather": 0.0, "stack": 0.0, "scatter": 0.0,
             "schedule": 0.0, "execute": 0.0, "sample": 0.0, "process": 0.0, "other_programs": 0.0}

    def timed(name, fn):
        fn = getattr(fn, "__wrapped__", fn)  # the class's method: wrapped by an earlier run

        @functools.wraps(fn)
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start
        return run

    PendingOutput.get = timed("output_wait", PendingOutput.get)
    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)
    engine._process = timed("process", engine._process)
    runner = engine.runner
    runner.execute_model = timed("execute", runner.execute_model)
    runner.sample_tokens = timed("sample", runner.sample_tokens)
    run, kinds, dispatches = runner.programs.run, {}, {}
    if tier:
        runner.host_kv._write_arrived = timed("write_arrived", runner.host_kv._write_arrived)
        runner.host_kv.start_copies = timed("start_copies", runner.host_kv.start_copies)
        kinds = {name: timed(part, run) for name, part in
                 (("gather_blocks", "gather"), ("stack_pieces", "stack"), ("scatter_blocks", "scatter"))}
    others = timed("other_programs", run)

    def dispatch(kind, **named):
        key, start = runner.programs.program(kind, **named).key, time.perf_counter()
        try:
            return kinds.get(kind.name, others)(kind, **named)
        finally:
            dispatches.setdefault(key, []).append(time.perf_counter() - start)
    runner.programs.run = dispatch
    return spent, dispatches


def _first_dispatches(dispatches: dict[tuple, list[float]], top: int = 12) -> list[list]:
    """The programs whose first dispatch took the host longest: key, its first and its later
    dispatches' median (ms), runs."""
    rows = [[str(key), round(1e3 * ms[0], 2), round(1e3 * statistics.median(ms[1:]), 2) if ms[1:] else None, len(ms)]
            for key, ms in dispatches.items()]
    return sorted(rows, key=lambda row: -row[1])[:top]


def _load_rate(host_kv, n: int) -> dict:
    """Host seconds to start copying the pieces that hold `n` filled slots to the device, and GB/s
    until they are there (whether copies hold the device's programs back: `host_copies.py`)."""
    pieces = list({id(piece): piece for piece, _ in filter(None, host_kv.slots)}.values())
    while sum(piece.shape[0] for piece in pieces[:-1]) >= n:
        pieces.pop()
    if not pieces:
        return {}
    jax.block_until_ready(jax.device_put(pieces[:1], [host_kv.device]))
    start = time.perf_counter()
    blocks = jax.device_put(pieces, [host_kv.device] * len(pieces))
    started = time.perf_counter() - start
    jax.block_until_ready(blocks)
    seconds = time.perf_counter() - start
    return {"load_pieces": len(pieces), "load_blocks": sum(piece.shape[0] for piece in pieces),
            "load_start_ms": round(1e3 * started, 2),
            "load_gb_per_s": round(sum(piece.nbytes for piece in pieces) / seconds / 1e9, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--prefix", type=int, default=8192)
    parser.add_argument("--message", type=int, default=64)
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--decoders", type=int, default=16)
    parser.add_argument("--decoder-prompt", type=int, default=128)
    parser.add_argument("--decoder-tokens", type=int, default=512, help="about what they reach in the run")
    parser.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--window", type=int, default=64, help="steps of the decoders alone")
    parser.add_argument("--warm-up", action="store_true", help="compile every program at start (the GPU default)")
    args = parser.parse_args()
    per_block = bytes_per_block(shape(args.shape), EngineArgs(dtype="bfloat16").create_runner_config(
        num_blocks=1, dtype="bfloat16"))
    args.host_gib = 1.25 * args.users * -(-(args.prefix + args.message) // 16) * per_block / 2**30
    result = {"device": jax.devices()[0].device_kind, **vars(args)}
    for mode, tier in (("recompute", False), ("host_tier", True)):
        result[mode] = run(args, tier)
        shown = {k: v for k, v in result[mode].items() if not k.startswith(("visit_step", "window_steps", "first_"))}
        print(mode, json.dumps(shown), flush=True)
    result["ttft_speedup"] = round(result["recompute"]["ttft_ms_median"] / result["host_tier"]["ttft_ms_median"], 2)
    print(json.dumps({k: result[k] for k in ("device", "shape", "prefix", "users", "ttft_speedup")}))
    if out := os.environ.get("OUT"):
        with open(os.path.join(out, "kv_offload.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
