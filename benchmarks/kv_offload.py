"""Time to first token when a long prefix comes back after the device's prefix cache evicted it:
computed again, or copied back from the host tier (`kv_offloading_size`); and the decode speed of
other requests meanwhile.

Each of `--users` conversations has a prefix of `--prefix` tokens (a list: the users take its
lengths in turn). The device's cache holds the decoding requests at their longest, the longest
prefix, and a quarter of what the other users' prefixes take beyond it and beyond the room the
decoders hold for tokens they have not made yet, so that visiting the users in turn evicts each
prefix before it comes back. Two engines live in one process, one recomputing and one
with the host tier, and take turns, so that the host's speed, which drifts by tens of percent
within a run, weighs on both alike. Each engine computes every prefix once, then `--decoders`
requests decode all along: `--windows` windows of `--window` steps with nothing else (their
tokens/s alone), the engines alternating; then `--warm-rounds` and `--rounds` rounds of visits
to every user, a prefix plus `--message` new tokens and one output token each (TTFT from adding
the request to its token), the engines alternating which goes first. The warm rounds run each
program of a visit for the first time (its first run costs the host far more than its later ones,
`first_dispatches`); the TTFT median counts the later rounds, and the warm rounds' are listed too.

    PYTHONPATH=$PWD python3 benchmarks/kv_offload.py [--shape llama3-8b] [--prefix 8192[,16384...]] [--users 4]
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

# Per step: ms, ms of it in the tier's copies, decoder tokens, after it: the visit waiting for its
# loads, the visit running, the load batches arrived; ms of the step in each part of `PARTS`; and
# the host's ms dispatching each kind of program.
PARTS = ("output_wait", "write_arrived", "start_copies", "gather", "stack", "scatter", "schedule", "execute", "sample",
         "process", "other_programs")
COLUMNS = ["ms", "tier_ms", "decoder_tokens", "loading", "running", "arrived", *PARTS, "programs"]


class Mode:
    """One engine of the comparison, its requests and what it measured."""

    def __init__(self, args: argparse.Namespace, tier: bool) -> None:
        users = [_blocks(args, p) for p in args.lengths]
        longest, others = max(users), min(sum(users) - n for n in users)
        decoders = args.decoders * -(-(args.decoder_prompt + args.decoder_tokens) // 16)
        unmade = args.decoders * (args.decoder_tokens // 16)
        self.engine = LLMEngine(EngineArgs(
            model=args.shape, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
            max_model_len=max(args.lengths) + args.message + 16, max_num_seqs=args.decoders + 2,
            max_num_batched_tokens=args.chunk,
            num_gpu_blocks_override=decoders + longest + max(others - longest - unmade, 0) // 4 + 1,
            kv_offloading_size=args.host_gib if tier else None, enforce_eager=not args.warm_up))
        self.args, self.tier = args, tier
        self.copies = self.engine.runner.host_kv.stats if tier else None
        self.parts, self.dispatches = _time_parts(self.engine, tier)
        self.decoding = {f"decode-{i}" for i in range(args.decoders)}
        self.visits: list[list[list]] = []  # each visit's steps (`COLUMNS`)
        self.window_steps: list[list] = []
        self.ttfts: list[float] = []
        self.alone = [0, 0.0]  # the decoders' tokens and seconds in the windows
        self.during = [0, 0.0]  # in the counted rounds' visits

    def step(self, rows: list[list], rid: str = "") -> list:
        _timing[0] = self.parts
        copies, engine = self.copies, self.engine
        began, copying, parts = time.perf_counter(), copies.seconds if copies else 0.0, dict(self.parts)
        programs = _programs[0] = {}
        outs = engine.step()
        rows.append([round(1e3 * (time.perf_counter() - began), 2),
                     round(1e3 * ((copies.seconds if copies else 0.0) - copying), 2),
                     sum(out.request_id in self.decoding for out in outs),
                     rid in engine.scheduler.loading, any(r.req_id == rid for r in engine.scheduler.running),
                     engine.runner.host_kv.arrived() if copies else 0,
                     *(round(1e3 * (self.parts[k] - parts[k]), 2) for k in PARTS),
                     {name: round(1e3 * ms, 2) for name, ms in programs.items()}])
        return outs

    def visit(self, rid: str, prompt: list[int]) -> tuple[float, list[list]]:
        """Adds the request and steps until its first token: the seconds that took, and the steps."""
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        self.engine.add_request(rid, {"prompt_token_ids": prompt}, one)
        start, rows = time.perf_counter(), []
        while not any(out.request_id == rid and out.outputs[0].token_ids for out in self.step(rows, rid)):
            pass
        return time.perf_counter() - start, rows

    def revisit(self, rid: str, prompt: list[int], counted: bool) -> None:
        seconds, rows = self.visit(rid, prompt)
        self.ttfts.append(seconds)
        self.visits.append(rows)
        if counted:
            self.during[0] += sum(row[2] for row in rows)
            self.during[1] += seconds

    def start_decoders(self, rng: np.random.Generator) -> None:
        long = SamplingParams(temperature=0.0, max_tokens=self.args.decoder_tokens, ignore_eos=True)
        vocab = self.engine.model_config.vocab_size
        for rid in sorted(self.decoding):
            self.engine.add_request(rid, {"prompt_token_ids": rng.integers(3, vocab, self.args.decoder_prompt).tolist()},
                                    long)
        for _ in range(8):  # the decoders' prefills, out of the windows
            self.engine.step()

    def window(self) -> None:
        start = time.perf_counter()
        for _ in range(self.args.window):
            self.step(self.window_steps)
            self.alone[0] += self.window_steps[-1][2]
        self.alone[1] += time.perf_counter() - start

    def report(self) -> dict:
        args, engine = self.args, self.engine
        warm = args.warm_rounds * args.users
        counted = self.ttfts[warm:]
        stats = engine.stats()
        load_rate = _load_rate(engine.runner.host_kv, 2 * _blocks(args, max(args.lengths))) if self.tier else {}
        # The steps with a visit's loads in flight from start to end, and only the decoders running.
        loading = [row[0] for rows in self.visits[warm:] for before, row in zip(rows, rows[1:])
                   if before[3] and row[3]]
        engine.abort_request(list(self.decoding), final_output=False)
        engine.close()
        return {
            "ttft_ms_median": round(1e3 * statistics.median(counted), 1),
            "ttft_ms_median_by_prefix": {p: round(1e3 * statistics.median(
                t for i, t in enumerate(counted) if args.lengths[i % args.users] == p), 1) for p in sorted(set(args.lengths))},
            "ttft_ms_warm_rounds": [round(1e3 * t, 1) for t in self.ttfts[:warm]],
            "ttft_ms": [round(1e3 * t, 1) for t in counted],
            "decoders_tokens_per_s_alone": round(self.alone[0] / self.alone[1], 1),
            "decoders_tokens_per_s_during_visits": round(self.during[0] / self.during[1], 1),
            "window_step_ms_median": round(statistics.median(row[0] for row in self.window_steps), 2),
            "loading_step_ms_median": round(statistics.median(loading), 2) if loading else None,
            "loading_steps": len(loading),
            "prefix_cache_hits": stats.prefix_cache_hits, "kv_offload_hits": stats.kv_offload_hits,
            "kv_offload_gb_loaded": round(stats.kv_offload_bytes_loaded / 1e9, 3),
            "kv_offload_gb_saved": round(stats.kv_offload_bytes_saved / 1e9, 3),
            "kv_offload_seconds": round(stats.kv_offload_seconds, 3), **load_rate,
            "compiled_on_use": engine.runner.programs.compiled_on_use,
            "first_dispatches": _first_dispatches(self.dispatches),
            "visit_step_columns": COLUMNS, "visit_steps": self.visits, "window_steps": self.window_steps,
        }


_timing: list[dict[str, float]] = [{}]  # the parts of the mode stepping now: the engines share classes
_programs: list[dict[str, float]] = [{}]  # the step's dispatch seconds by kind of program


def _time_parts(engine: LLMEngine, tier: bool) -> tuple[dict[str, float], dict[tuple, list[float]]]:
    """Seconds spent so far in the parts of a step that could hold the host up (wrapped here):
    waiting for a step's output; with the tier, writing arrived pieces, starting copies and each
    of the tier's programs; the engine's parts (`execute` holds the tier's write and gathers), and
    the dispatch of the step's other programs. Then each program's dispatches, in seconds: a
    program's first run on the GPU may cost the host far more than its later ones."""
    spent = dict.fromkeys(PARTS, 0.0)

    def timed(name, fn, into=lambda: spent):
        fn = getattr(fn, "__wrapped__", fn)  # the class's method: wrapped by an earlier engine

        @functools.wraps(fn)
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                into()[name] += time.perf_counter() - start
        return run

    PendingOutput.get = timed("output_wait", PendingOutput.get, lambda: _timing[0])
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
            dispatches.setdefault(key, []).append(seconds := time.perf_counter() - start)
            _programs[0][kind.name] = _programs[0].get(kind.name, 0.0) + seconds
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


def _blocks(args: argparse.Namespace, prefix: int) -> int:
    """The blocks of a visit with a prefix of `prefix` tokens."""
    return -(-(prefix + args.message + 1) // 16)


def measure(args: argparse.Namespace) -> dict:
    """Both modes, taking turns (see the module's docstring)."""
    modes = {"recompute": Mode(args, tier=False), "host_tier": Mode(args, tier=True)}
    rng = np.random.default_rng(0)
    vocab = modes["recompute"].engine.model_config.vocab_size
    prefixes = [rng.integers(3, vocab, n).tolist() for n in args.lengths]

    def in_turn(i: int) -> list[Mode]:
        return list(modes.values())[:: 1 if i % 2 == 0 else -1]

    for mode in modes.values():
        for u, prefix in enumerate(prefixes):  # the first visits: computed either way
            mode.visit(f"first-{u}", prefix)
        mode.start_decoders(np.random.default_rng(1))
    for w in range(args.windows):
        for mode in in_turn(w):
            mode.window()
    for r in range(args.warm_rounds + args.rounds):
        for u, prefix in enumerate(prefixes):
            prompt = prefix + rng.integers(3, vocab, args.message).tolist()
            for mode in in_turn(r * args.users + u):
                mode.revisit(f"visit-{r}-{u}", prompt, counted=r >= args.warm_rounds)
    return {name: mode.report() for name, mode in modes.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--prefix", type=lambda s: [int(n) for n in s.split(",")], default=[8192],
                        help="tokens, or a comma-separated list the users take in turn")
    parser.add_argument("--message", type=int, default=64)
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--warm-rounds", type=int, default=1, help="rounds of visits left out of the TTFT median")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--decoders", type=int, default=16)
    parser.add_argument("--decoder-prompt", type=int, default=128)
    parser.add_argument("--decoder-tokens", type=int, default=512, help="more than they reach in the run")
    parser.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--windows", type=int, default=4, help="windows of the decoders alone, per engine")
    parser.add_argument("--window", type=int, default=32, help="steps in each window")
    parser.add_argument("--warm-up", action="store_true", help="compile every program at start (the GPU default)")
    args = parser.parse_args()
    per_block = bytes_per_block(shape(args.shape), EngineArgs(dtype="bfloat16").create_runner_config(
        num_blocks=1, dtype="bfloat16"))
    args.lengths = [args.prefix[u % len(args.prefix)] for u in range(args.users)]
    args.host_gib = 1.25 * sum(_blocks(args, n) for n in args.lengths) * per_block / 2**30
    result = {"device": jax.devices()[0].device_kind, **vars(args), **measure(args)}
    for mode in ("recompute", "host_tier"):
        shown = {k: v for k, v in result[mode].items() if not k.startswith(("visit_step", "window_steps", "first_"))}
        print(mode, json.dumps(shown), flush=True)
    tier, recompute = result["host_tier"], result["recompute"]
    result["ttft_speedup"] = round(recompute["ttft_ms_median"] / tier["ttft_ms_median"], 2)
    result["ttft_speedup_by_prefix"] = {p: round(recompute["ttft_ms_median_by_prefix"][p] / ms, 2)
                                        for p, ms in tier["ttft_ms_median_by_prefix"].items()}
    result["decoders_alone_tier_over_recompute"] = round(
        tier["decoders_tokens_per_s_alone"] / recompute["decoders_tokens_per_s_alone"], 3)
    print(json.dumps({k: result[k] for k in ("device", "shape", "prefix", "users", "ttft_speedup",
                                             "ttft_speedup_by_prefix", "decoders_alone_tier_over_recompute")}))
    if out := os.environ.get("OUT"):
        with open(os.path.join(out, "kv_offload.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
