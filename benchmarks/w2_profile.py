"""Where W2's time goes: its timed `generate` (`jaxrunner bench throughput`) under JAX's profiler, the
GPU's time split by program and by kind of kernel, and the time the GPU stood idle between kernels
(the host's share of the run), each gap counted against the programs on either side of it.

    PYTHONPATH=$PWD python3 benchmarks/w2_profile.py [--kernels auto|mosaic] [--num-prompts 256]
    PYTHONPATH=$PWD python3 benchmarks/w2_profile.py --from w2_trace.npz   # read a saved run again

Writes $OUT/w2_profile.json (the breakdown) and $OUT/w2_trace.npz (every kernel's name, program and
interval) when OUT is set. The profiler's own work widens the gaps somewhat: the untraced figure
is `jaxrunner bench throughput`'s.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import tempfile

import numpy as np

from benchmarks.profile import busy_ns, gpu_events
from jaxrunner.bench import throughput
from jaxrunner.config import KERNEL_CHOICES

KINDS = (  # the first pattern a kernel's name matches gives its kind
    ("attention", r"attention"),
    ("kv write", r"write_kv"),
    ("matmul", r"gemm|nvjet|xmma|cutlass|matmul|cublas|sm90_"),
    ("copy", r"[Mm]emcpy|[Mm]emset"),
    ("sampler tally", r"sampler_tally"),
)
GAPS_US = (5, 50, 500)  # the idle gaps' size classes


def kernel_kind(name: str) -> str:
    """A kernel's kind, by its name (KINDS): what the breakdown's columns count."""
    return next((kind for kind, pattern in KINDS if re.search(pattern, name)), "other (XLA fusions)")


def program_name(module: str) -> str:
    """`jit_decode_loop.12` -> `decode_loop`: the runner's step function the kernel ran under."""
    return re.sub(r"^jit_|[.(]\d+\)?$", "", module) or "(none)"


def read_trace(trace_dir: str) -> tuple[list[tuple[str, str, int, int]], list[str]]:
    """(kernel name, program, start ns, end ns) of every kernel and copy, in start order, the program
    read from the kernel's `hlo_module` annotation ("(none)" for a copy between programs); and the
    names of the GPU's trace lines."""
    kernels, lines = [], set()
    for line, e in gpu_events(trace_dir):
        lines.add(line)
        if line.startswith("Stream"):
            module = str(dict(e.stats).get("hlo_module", ""))
            kernels.append((e.name, program_name(module), int(e.start_ns), int(e.end_ns)))
    return sorted(kernels, key=lambda k: k[2]), sorted(lines)


def breakdown(kernels: list[tuple[str, str, int, int]], wall_s: float, top: int = 30) -> dict:
    """The run's GPU time by program and kind of kernel, its idle gaps by size and by the programs
    around them, and the kernels that take the most time; every figure in seconds of the whole run."""
    if not kernels:
        raise SystemExit("the trace holds no GPU kernel: W2's profile needs a GPU")
    by_program = collections.defaultdict(collections.Counter)
    by_kernel = collections.defaultdict(lambda: [0, 0])
    for name, program, s, e in kernels:
        by_program[program][kernel_kind(name)] += e - s
        by_kernel[name][0] += e - s
        by_kernel[name][1] += 1
    gaps = collections.Counter()
    gap_classes = collections.Counter()
    end, before = None, None
    for name, program, s, e in kernels:
        if end is not None and s > end:
            gaps[f"{before} -> {program}"] += s - end
            gap_classes[next((f"< {b} us" for b in GAPS_US if s - end < b * 1e3), f">= {GAPS_US[-1]} us")] += s - end
        if end is None or e > end:
            end, before = e, program
    span = max(k[3] for k in kernels) - kernels[0][2]
    busy = busy_ns([(n, s, e) for n, _, s, e in kernels])
    sec = lambda ns: round(ns / 1e9, 4)  # noqa: E731
    return {
        "wall_s": round(wall_s, 4),
        "gpu_span_s": sec(span),
        "gpu_busy_s": sec(busy),
        "gpu_idle_s": sec(span - busy),
        "kernels": len(kernels),
        "programs": {
            program: {"busy_s": sec(sum(kinds.values())), **{kind: sec(t) for kind, t in kinds.most_common()}}
            for program, kinds in sorted(by_program.items(), key=lambda kv: -sum(kv[1].values()))
        },
        "idle_by_gap_size": {size: sec(t) for size, t in sorted(gap_classes.items())},
        "idle_between_programs": {pair: sec(t) for pair, t in gaps.most_common(12)},
        "top_kernels": [
            {"name": name[:120], "s": sec(t), "calls": n}
            for name, (t, n) in sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:top]
        ],
    }


def save(path: str, kernels: list[tuple[str, str, int, int]], wall_s: float) -> None:
    """The kernels as arrays (names and programs by index), compressed: a W2 run's fits in a few MB."""
    names, name_ids = np.unique([k[0] for k in kernels], return_inverse=True)
    programs, program_ids = np.unique([k[1] for k in kernels], return_inverse=True)
    np.savez_compressed(path, names=names, name_ids=name_ids.astype(np.int32), programs=programs,
                        program_ids=program_ids.astype(np.int16), start=np.array([k[2] for k in kernels]),
                        end=np.array([k[3] for k in kernels]), wall_s=wall_s)


def load(path: str) -> tuple[list[tuple[str, str, int, int]], float]:
    """The kernels and wall seconds `save` wrote."""
    f = np.load(path)
    names, programs = f["names"].tolist(), f["programs"].tolist()
    kernels = [(names[n], programs[p], int(s), int(e))
               for n, p, s, e in zip(f["name_ids"], f["program_ids"], f["start"], f["end"])]
    return kernels, float(f["wall_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="saved", help="a w2_trace.npz written by an earlier run")
    parser.add_argument("--kernels", choices=KERNEL_CHOICES, default="auto")
    parser.add_argument("--num-prompts", type=int, default=256)
    args = parser.parse_args()
    out = os.environ.get("OUT")
    if args.saved:
        kernels, wall_s = load(args.saved)
        result = {}
    else:
        with tempfile.TemporaryDirectory() as trace_dir:
            run = throughput.run(num_prompts=args.num_prompts, peer=False, kernels=args.kernels, trace_dir=trace_dir)
            kernels, lines = read_trace(trace_dir)
        wall_s = run["elapsed_s"]
        result = {"device": run["device"], "tokens_per_s_traced": run["tokens_per_s"], "gpu_lines": lines, **vars(args)}
        if out:
            save(os.path.join(out, "w2_trace.npz"), kernels, wall_s)
    result |= breakdown(kernels, wall_s)
    print(json.dumps(result, indent=1))
    if out:
        with open(os.path.join(out, "w2_profile.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
