"""Copies between pinned host memory and the device, as the host tier could make them: 1 GB (an
8k-token prefix of the 8B shape) in pieces of 2 MB (a block) up to one piece, each way. Per size:
the host's time to start the copies, their GB/s, and how long a queue of matmuls that alone takes
about `--work-ms` takes when queued just after them (equal: the copies run beside the device's
programs; plus the copy's time: the programs waited for them), then the same queue fed by a small
array put on the device after the copies started, as a step's inputs are, and the queue with a row
of its result read back to the host, as a step's sampled tokens are.

    PYTHONPATH=$PWD python3 benchmarks/host_copies.py [--total-mb 1024]
Writes $OUT/host_copies.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mb", type=int, default=1024)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[2, 8, 32, 128, 1024])
    parser.add_argument("--work-ms", type=float, default=20.0)
    args = parser.parse_args()
    device = jax.devices()[0]
    on_device = jax.sharding.SingleDeviceSharding(device)
    pinned = on_device.with_memory_kind("pinned_host")
    x = jnp.ones((4096, 4096), jnp.bfloat16)
    step = jax.jit(lambda a: (a @ a) * (1 / 4096))
    jax.block_until_ready(step(x))

    def work(n: int, fed: bool = False) -> jax.Array:
        y = x + jax.device_put(np.zeros(4096, np.float32), device).astype(x.dtype) if fed else x
        for _ in range(n):
            y = step(y)
        return y

    start = time.perf_counter()
    jax.block_until_ready(work(16))
    per_matmul = (time.perf_counter() - start) / 16
    matmuls = max(1, round(args.work_ms / 1e3 / per_matmul))

    def timed_work(fed: bool = False, read: bool = False) -> float:
        """ms until the queue is done; with `read`, until a row of its result is on the host, as a
        step's sampled tokens come back."""
        start = time.perf_counter()
        y = work(matmuls, fed)
        if read:
            row = y[0]
            row.copy_to_host_async()
            np.asarray(row)
        jax.block_until_ready(y)
        return 1e3 * (time.perf_counter() - start)

    timed_work(True, True)  # the feeding's and reading's own programs compiled
    results = {"device": device.device_kind, "matmuls": matmuls, "work_alone_ms": round(timed_work(), 2),
               "work_fed_alone_ms": round(timed_work(True), 2), "work_read_alone_ms": round(timed_work(read=True), 2),
               "sizes": []}
    for mb in args.sizes_mb:
        n = max(1, args.total_mb // mb)
        rows = jnp.zeros((n, mb << 20), jnp.uint8) + jnp.arange(n, dtype=jnp.uint8)[:, None]
        pieces = [rows[i] for i in range(n)]
        jax.block_until_ready(pieces)
        del rows
        found = {"piece_mb": mb, "pieces": n}
        for way, src, dst in (("to_host", pieces, pinned), ("to_device", None, on_device)):
            src = src if src is not None else held
            jax.block_until_ready(jax.device_put(src[:1], [dst]))  # the path's first use
            start = time.perf_counter()
            moved = jax.device_put(src, [dst] * n)
            started = time.perf_counter() - start
            jax.block_until_ready(moved)
            seconds = time.perf_counter() - start
            beside = {}
            for form in ("work", "work_fed", "work_read"):
                moved_again = jax.device_put(src, [dst] * n)
                beside[form] = round(timed_work(form == "work_fed", form == "work_read"), 2)
                jax.block_until_ready(moved_again)
            found[way] = {"start_ms": round(1e3 * started, 2), "gb_per_s": round(n * (mb << 20) / seconds / 1e9, 2),
                          **{f"{form}_beside_ms": ms for form, ms in beside.items()}}
            if way == "to_host":
                held = moved
                assert int(np.asarray(held[-1])[0]) == (n - 1) % 256, "the copy's bytes differ"
            else:
                found[way] |= _dispatch_beside(held, on_device)
        del pieces, held, moved, moved_again
        results["sizes"].append(found)
        print(json.dumps(found), flush=True)
    print(json.dumps({k: v for k, v in results.items() if k != "sizes"}))
    if out := os.environ.get("OUT"):
        with open(os.path.join(out, "host_copies.json"), "w") as f:
            json.dump(results, f, indent=1)


def _dispatch_beside(held: list[jax.Array], on_device: jax.sharding.Sharding) -> dict:
    """Host ms to dispatch a program writing the first piece to arrive into a cache as large as
    the pieces, while the rest are on their way: donating the cache (as the host tier's scatter
    donates the state) and not, donating it with a piece that arrived long before, and with the
    piece copied first by a program that donates nothing; then the ms until every piece had
    arrived. A dispatch that takes about the copies' time waits for all of them, not only its own."""
    n = len(held)
    cache = jnp.zeros((n, held[0].size), jnp.uint8)
    donated = jax.jit(lambda c, p: c.at[0].set(p), donate_argnums=0)
    kept = jax.jit(lambda c, p: c[0] + p)
    stage = jax.jit(lambda p: p + 0)  # the piece copied by a program that donates nothing
    old = jax.block_until_ready(stage(jax.device_put(held[:1], [on_device])[0]))  # and `stage` compiled
    found = {}
    for name, fn in (("donated", donated), ("kept", kept), ("donated_old_piece", donated), ("donated_staged", donated)):
        out = fn(cache, old)  # compiled
        cache = out if fn is donated else cache
        jax.block_until_ready(cache)
        start = time.perf_counter()
        moved = jax.device_put(held, [on_device] * n)
        while not moved[0].is_ready():
            pass
        arrived = time.perf_counter()
        piece = old if name == "donated_old_piece" else stage(moved[0]) if name == "donated_staged" else moved[0]
        out = fn(cache, piece)
        found[f"{name}_dispatch_ms"] = round(1e3 * (time.perf_counter() - arrived), 2)
        cache = out if fn is donated else cache
        jax.block_until_ready(moved)
        found[f"{name}_all_arrived_ms"] = round(1e3 * (time.perf_counter() - start), 2)
        jax.block_until_ready(out)
    return found


if __name__ == "__main__":
    main()
