"""Attention benchmark for one H200: ragged paged attention against its peers, in one run.

    PYTHONPATH=$PWD python benchmarks/attention.py [--no-sweep] [--quick] [--w1-sweep]

Sections (all bf16, Llama-3-8B heads: 32 query heads, 8 KV heads, D=128, page size 16):
- copy: device copy bandwidth, the yardstick for everything memory-bound;
- decode: batch {1, 16, 64, 256} x context {512, 4k, 32k}; time and GB/s on the KV bytes read, for
  ours (`ragged_paged_attention_decode`, Triton-lowered), XLA on the dense (pre-gathered) cache, and
  `jax.experimental.pallas.ops.gpu.paged_attention` (head-major copy of the same pages);
- prefill: 8k tokens as one request and as 16 x 512; TFLOP/s (causal FLOPs) for ours
  (`ragged_paged_attention`, Triton-lowered, and `mosaic_prefill_attention`, Mosaic GPU, in the form
  the runner takes) against
  cuDNN and XLA `jax.nn.dot_product_attention` on dense inputs;
- kv write: `write_kv` (Pallas, aliased) against the XLA scatter, caches updated in a loop carry;
- sweep (unless --no-sweep): a few kernel tilings for decode 64 x 4k and prefill 8k, so one run
  shows which tiling to make the default;
- --fp8 alone: decode at batch 64 and 256 x 4k with bf16 and with fp8 (e4m3) pages, our kernel
  (it widens fp8 pages as it reads them; GB/s counts the bytes read, half as many for fp8);
- mixed: a 2048-token prompt chunk beside 63 decodes at 4k keys, the Triton kernel against the
  Mosaic one (the runner's `kernels="mosaic"`: its decodes through the Triton kernel, and with
  them in tiles of their own);
- --prefill alone: the prefill and mixed sections and (unless --no-sweep) a sweep of the Mosaic
  kernel's tilings at both prefill shapes;
- --mosaic-form FIELD=VALUE,... alone: only the Mosaic kernel at both prefill shapes, in the
  runner's form with those `MosaicConfig` fields changed (empty: the form itself); the quick way to
  set a branch's or a field's form beside another, each run from its own tree in one call;
- --profile DIR alone: the Mosaic kernel at 16 x 512 under Mosaic GPU's profiler, each named phase's
  time per warpgroup and how long its pairs of 1, 2, ... key blocks take (traces in DIR);
- --page N: pages of N tokens instead of 16 (the runner's `block_size`), in every section;
- --w1-sweep alone: decode tilings for one sequence at 129 and 385 keys (W1's short contexts, the
  query padded to 16 tokens as the runner pads it), and the default at 64 x 4k.

Timing runs the op `iters` times inside one jitted `fori_loop` (no per-call dispatch in the
figure); an optimisation barrier on the inputs keeps XLA from hoisting the op out of the loop.
Our kernel and the paged peer read a different copy of the pages on each iteration when the KV
set is smaller than 256 MiB, so the L2 cache (50 MiB) cannot serve them; the dense XLA peer is not
rotated (it may be L2-resident on the smallest cases, which flatters it).

Every measured variant is wrapped: a failure prints an error row and the run goes on. The table
is printed at the end and written to $OUT/attention.json when OUT is set.
"""

from __future__ import annotations

import argparse
import ast
import collections
import dataclasses
import functools
import glob
import json
import math
import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrunner import platform
from jaxrunner.models.attention import mosaic_config
from pallas_kernels import (
    FP8,
    KernelConfig,
    MosaicConfig,
    mosaic_prefill_attention,
    ragged_paged_attention,
    ragged_paged_attention_decode,
    write_kv,
)

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
GROUP = NUM_Q_HEADS // NUM_KV_HEADS
DTYPE = jnp.bfloat16
SCALE = 1 / math.sqrt(HEAD_DIM)
ROTATE_BYTES = 256 << 20
ROWS: list[dict] = []


# ------------------------------------------------------------------------------------ timing

def device_time(fn, args, *, est_seconds: float, repeats: int = 3) -> float:
    """Seconds per call of fn(i, *args), run back to back inside one jitted loop."""
    iters = int(np.clip(0.25 / max(est_seconds, 1e-6), 3, 200))

    @jax.jit
    def loop(*args):
        def body(i, acc):
            a = lax.optimization_barrier((args, i))[0]
            out = fn(i, *a)
            return acc + out.reshape(-1)[0].astype(jnp.float32)
        return lax.fori_loop(0, iters, body, jnp.float32(0))

    loop(*args).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        loop(*args).block_until_ready()
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def record(section: str, case: str, impl: str, fn, **extra):
    """Run one measurement; keep a row with its result or its error."""
    row = dict(section=section, case=case, impl=impl, **extra)
    try:
        row.update(fn())
    except Exception as e:  # one failing variant must not stop the run
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        traceback.print_exc()
    ROWS.append(row)
    print(_format(row), flush=True)
    return row


def _format(row) -> str:
    parts = [f"{row['section']:8s} {row['case']:22s} {row['impl']:28s}"]
    if "error" in row:
        return parts[0] + f" ERROR {row['error']}"
    parts.append(f"{row['time_us']:10.1f} us")
    if "gbps" in row:
        parts.append(f"{row['gbps']:8.0f} GB/s")
    if "copy_frac" in row:
        parts.append(f"{100 * row['copy_frac']:5.1f}% of copy")
    if "tflops" in row:
        parts.append(f"{row['tflops']:7.1f} TFLOP/s")
    for peer, ratio in row.get("vs", {}).items():
        parts.append(f"x{ratio:.2f} vs {peer}")
    return "  ".join(parts)


# -------------------------------------------------------------------------------------- copy

def measure_copy() -> dict:
    """Device-to-device copy: 4 GiB read and 4 GiB written into a separate buffer, per call."""
    x = jnp.ones((1 << 31,), DTYPE)  # 4 GiB
    nbytes = x.nbytes
    copy = jax.jit(lambda x: x + 1)
    copy(x).block_until_ready()
    best = float("inf")
    for _ in range(10):
        start = time.perf_counter()
        copy(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    del x
    return dict(time_us=best * 1e6, gbps=2 * nbytes / best / 1e9)


# ------------------------------------------------------------------------------------ decode

def _paged_cache(key, num_pages):
    shape = (num_pages, PAGE, NUM_KV_HEADS, HEAD_DIM)
    kk, kv = jax.random.split(key)
    make = jax.jit(lambda k: jax.random.uniform(k, shape, DTYPE, -1.0, 1.0))
    return make(kk), make(kv)


def decode_case(batch: int, context: int, copy_gbps: float, configs: dict[str, KernelConfig] | None = None,
                tokens: int | None = None, kv_dtype=DTYPE):
    """`tokens` > batch pads q as the runner does (the smallest token bucket is 16 tokens)."""
    kv_dtype = jnp.dtype(kv_dtype)
    case = f"b{batch} x ctx{context}" + (f" T{tokens}" if tokens else "") + ("" if kv_dtype == DTYPE else f" {kv_dtype.name}")
    pages_per_seq = -(-context // PAGE)
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * kv_dtype.itemsize
    est = kv_bytes / (copy_gbps * 1e9)
    copies = max(1, -(-ROTATE_BYTES // kv_bytes))
    rng = np.random.default_rng(batch * 100003 + context)
    num_pages = copies * batch * pages_per_seq
    tables = jnp.asarray(rng.permutation(num_pages).reshape(copies, batch, pages_per_seq), jnp.int32)
    k_cache, v_cache = (c.astype(kv_dtype) for c in _paged_cache(jax.random.key(batch + context), num_pages))
    q = jax.random.normal(jax.random.key(1), (tokens or batch, NUM_Q_HEADS, HEAD_DIM), DTYPE)
    lens = jnp.full((batch,), context, jnp.int32)
    qsl = jnp.arange(batch + 1, dtype=jnp.int32)
    rate = lambda t: dict(time_us=t * 1e6, gbps=kv_bytes / t / 1e9, copy_frac=kv_bytes / t / 1e9 / copy_gbps)

    def ours(config=None):
        def fn(i, q, k_cache, v_cache, tables):
            return ragged_paged_attention_decode(q, k_cache, v_cache, qsl, lens, tables[i % copies],
                                                 jnp.int32(batch), sm_scale=SCALE, config=config,
                                                 num_sms=platform.num_sms())
        return rate(device_time(fn, (q, k_cache, v_cache, tables), est_seconds=est))

    if configs is not None:  # sweep mode: only our kernel, under each tiling
        for name, config in configs.items():
            record("sweep", case, f"ours {name}", functools.partial(ours, config))
        return
    mine = record("decode", case, "ours (pallas/triton)", ours)

    def xla_dense():
        pages = tables[0]
        dense = jax.jit(lambda c: c[pages].reshape(batch, context, NUM_KV_HEADS, HEAD_DIM))
        k, v = dense(k_cache), dense(v_cache)

        def fn(i, q, k, v):
            qg = q.reshape(batch, NUM_KV_HEADS, GROUP, HEAD_DIM)
            s = jnp.einsum("bkgd,blkd->bkgl", qg, k, preferred_element_type=jnp.float32) * SCALE
            s = jnp.where((jnp.arange(context) < lens[:, None])[:, None, None, :], s, -jnp.inf)
            p = jax.nn.softmax(s, axis=-1).astype(DTYPE)
            return jnp.einsum("bkgl,blkd->bkgd", p, v, preferred_element_type=jnp.float32)
        try:
            return rate(device_time(fn, (q, k, v), est_seconds=est))
        finally:
            k.delete()
            v.delete()

    def jax_paged():
        from jax.experimental.pallas.ops.gpu import paged_attention as jpa
        head_major = jax.jit(lambda c: jnp.transpose(c, (2, 0, 1, 3)))
        k, v = head_major(k_cache), head_major(v_cache)

        def fn(i, q, k, v, tables):
            return jpa.paged_attention(q * SCALE, k, v, tables[i % copies], lens)
        try:
            return rate(device_time(fn, (q, k, v, tables), est_seconds=est))
        finally:
            k.delete()
            v.delete()

    for name, fn in (("xla dense (pre-gathered)", xla_dense), ("jax ops.gpu.paged_attention", jax_paged)):
        peer = record("decode", case, name, fn)
        if "error" not in mine and "error" not in peer:
            mine.setdefault("vs", {})[name] = peer["time_us"] / mine["time_us"]
    k_cache.delete()
    v_cache.delete()


# ----------------------------------------------------------------------------------- prefill

def _prefill_inputs(num_seqs: int, seq_len: int):
    """num_seqs whole prompts of seq_len tokens: q, the pages, their tables, query_start_loc, seq_lens."""
    tokens = num_seqs * seq_len
    rng = np.random.default_rng(tokens + num_seqs)
    pages_per_seq = seq_len // PAGE
    num_pages = num_seqs * pages_per_seq
    tables = jnp.asarray(rng.permutation(num_pages).reshape(num_seqs, pages_per_seq), jnp.int32)
    k_cache, v_cache = _paged_cache(jax.random.key(tokens), num_pages)
    q = jax.random.normal(jax.random.key(2), (tokens, NUM_Q_HEADS, HEAD_DIM), DTYPE)
    qsl = jnp.arange(num_seqs + 1, dtype=jnp.int32) * seq_len
    lens = jnp.full((num_seqs,), seq_len, jnp.int32)
    return q, k_cache, v_cache, tables, qsl, lens


def prefill_case(num_seqs: int, seq_len: int, configs: dict[str, KernelConfig | MosaicConfig] | None = None):
    case = f"{num_seqs} x {seq_len}"
    flops = 4 * NUM_Q_HEADS * HEAD_DIM * num_seqs * seq_len * (seq_len + 1) / 2  # causal
    est = flops / 300e12
    q, k_cache, v_cache, tables, qsl, lens = _prefill_inputs(num_seqs, seq_len)
    rate = lambda t: dict(time_us=t * 1e6, tflops=flops / t / 1e12)

    def ours(config=None):
        def fn(i, q, k_cache, v_cache, tables):
            return ragged_paged_attention(q, k_cache, v_cache, qsl, lens, tables, jnp.int32(num_seqs),
                                          sm_scale=SCALE, config=config)
        return rate(device_time(fn, (q, k_cache, v_cache, tables), est_seconds=est))

    def mosaic(config=None):
        config = config or mosaic_config(q, k_cache, interpret=False)  # the runner's form

        def fn(i, q, k_cache, v_cache, tables):
            return mosaic_prefill_attention(q, k_cache, v_cache, qsl, lens, tables, jnp.int32(num_seqs),
                                            sm_scale=SCALE, config=config)
        return rate(device_time(fn, (q, k_cache, v_cache, tables), est_seconds=est))

    if configs is not None:
        for name, config in configs.items():
            kernel = mosaic if isinstance(config, MosaicConfig) else ours
            record("sweep", case, f"ours {name}", functools.partial(kernel, config))
        return
    mine = record("prefill", case, "ours (pallas/triton)", ours)
    theirs = record("prefill", case, "ours (mosaic)", mosaic)

    def dense(implementation):
        dense_kv = jax.jit(lambda c: c[tables].reshape(num_seqs, seq_len, NUM_KV_HEADS, HEAD_DIM))
        k, v = dense_kv(k_cache), dense_kv(v_cache)
        qd = q.reshape(num_seqs, seq_len, NUM_Q_HEADS, HEAD_DIM)

        def fn(i, q, k, v):
            return jax.nn.dot_product_attention(q, k, v, scale=SCALE, is_causal=True,
                                                implementation=implementation)
        return rate(device_time(fn, (qd, k, v), est_seconds=est))

    for impl in ("cudnn", "xla"):
        name = f"jax.nn.dpa {impl} (dense)"
        peer = record("prefill", case, name, functools.partial(dense, impl))
        for row in (mine, theirs):
            if "error" not in row and "error" not in peer:
                row.setdefault("vs", {})[name] = peer["time_us"] / row["time_us"]
    k_cache.delete()
    v_cache.delete()


def mixed_case(chunk: int, decodes: int, context: int):
    """A chunked prefill step: one prompt's `chunk` tokens (its first) beside `decodes` sequences
    decoding at `context` keys; ours through the Triton kernel and through the Mosaic one."""
    case = f"{chunk} chunk + {decodes} decodes x {context}"
    num_seqs, tokens = decodes + 1, -(-(chunk + decodes) // 8) * 8  # padded, as the runner's token buckets are
    pages_per_seq = max(chunk, context) // PAGE
    rng = np.random.default_rng(chunk + decodes)
    tables = jnp.asarray(rng.permutation(num_seqs * pages_per_seq).reshape(num_seqs, pages_per_seq), jnp.int32)
    k_cache, v_cache = _paged_cache(jax.random.key(5), num_seqs * pages_per_seq)
    q = jax.random.normal(jax.random.key(6), (tokens, NUM_Q_HEADS, HEAD_DIM), DTYPE)
    qsl = jnp.asarray(np.concatenate([[0], chunk + np.arange(num_seqs)]), jnp.int32)
    lens = jnp.asarray([chunk] + [context] * decodes, jnp.int32)
    est = 4 * NUM_Q_HEADS * HEAD_DIM * chunk * chunk / 2 / 300e12 + 2 * decodes * context * NUM_KV_HEADS * HEAD_DIM * 2 / 4e12

    def run(attend):
        def fn(i, q, k_cache, v_cache, tables):
            return attend(q, k_cache, v_cache, qsl, lens, tables, jnp.int32(num_seqs), sm_scale=SCALE)
        return dict(time_us=device_time(fn, (q, k_cache, v_cache, tables), est_seconds=est) * 1e6)

    triton = record("mixed", case, "ours (pallas/triton)", functools.partial(run, ragged_paged_attention))
    for impl, decode_queries in (("ours (mosaic)", 16), ("ours (mosaic, decodes too)", 0)):
        mosaic = record("mixed", case, impl, functools.partial(
            run, functools.partial(mosaic_prefill_attention, decode_queries=decode_queries,
                                   config=mosaic_config(q, k_cache, interpret=False))))
        if "error" not in triton and "error" not in mosaic:
            mosaic.setdefault("vs", {})["ours (pallas/triton)"] = triton["time_us"] / mosaic["time_us"]
    k_cache.delete()
    v_cache.delete()


# ---------------------------------------------------------------------------------- kv write

def profile_case(num_seqs: int, seq_len: int, profile_dir: str) -> None:
    """The Mosaic kernel once under Mosaic GPU's profiler, then each named phase's time summed over the
    run, per warpgroup (`mosaic_attention`'s scopes; warpgroups 0 and 1 consume, 2 produces), and a
    consumer's pairs by their key blocks: how long from a pair's start to the next one's."""
    q, k_cache, v_cache, tables, qsl, lens = _prefill_inputs(num_seqs, seq_len)
    os.makedirs(profile_dir, exist_ok=True)
    before = set(glob.glob(os.path.join(profile_dir, "*-trace.json")))
    jax.block_until_ready(jax.jit(functools.partial(
        mosaic_prefill_attention, sm_scale=SCALE, config=mosaic_config(q, k_cache, interpret=False),
        profile_dir=profile_dir))(q, k_cache, v_cache, qsl, lens, tables, jnp.int32(num_seqs)))
    jax.effects_barrier()
    [trace] = set(glob.glob(os.path.join(profile_dir, "*-trace.json"))) - before
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    opened, total, times = {}, collections.defaultdict(float), collections.defaultdict(list)
    pairs = collections.defaultdict(list)  # a consumer's pairs: [start, key blocks]
    for event in events:
        role = "producer" if (event["tid"] - 1) % 3 == 2 else "consumer"
        key = (event["tid"], event["name"])
        if event["ph"] == "B":
            opened[key] = event["ts"]
            if event["name"] == "pair":
                pairs[event["tid"]].append([event["ts"], 0])
            elif event["name"] == "scores":
                pairs[event["tid"]][-1][1] += 1
        else:
            total[role, event["name"]] += event["ts"] - opened.pop(key)
        times[event["pid"]].append(event["ts"])
    by_blocks = collections.defaultdict(list)
    for walk in pairs.values():
        for (start, blocks), (following, _) in zip(walk, walk[1:]):
            by_blocks[blocks].append(following - start)
    spans = [max(t) - min(t) for t in times.values()]
    print(f"profile {num_seqs} x {seq_len}: {len(spans)} CTAs, span mean {np.mean(spans):.1f} us, max {max(spans):.1f} us")
    for (role, name), us in sorted(total.items()):
        print(f"profile {num_seqs} x {seq_len}: {role:9s} {name:10s} "
              f"{us / len(spans) / (2 if role == 'consumer' else 1):8.1f} us per warpgroup")
    for blocks, durations in sorted(by_blocks.items()):
        print(f"profile {num_seqs} x {seq_len}: pairs of {blocks} key blocks: {len(durations)}, "
              f"{np.mean(durations):.2f} us each")


def kv_write_case(tokens: int, copy_gbps: float):
    num_pages = 8192
    k_cache, v_cache = _paged_cache(jax.random.key(3), num_pages)
    rng = np.random.default_rng(tokens)
    slots = jnp.asarray(rng.choice(num_pages * PAGE, tokens, replace=False), jnp.int32)
    k = jax.random.normal(jax.random.key(4), (tokens, NUM_KV_HEADS, HEAD_DIM), DTYPE)
    moved = 2 * 2 * k.nbytes  # read k, v; write them into the caches

    for impl in ("pallas", "xla"):
        def run(impl=impl):
            iters = 50

            @functools.partial(jax.jit, donate_argnums=(0, 1))
            def loop(kc, vc, k, slots):
                return lax.fori_loop(0, iters, lambda i, c: write_kv(*c, k, k, slots, impl=impl), (kc, vc))

            nonlocal k_cache, v_cache
            k_cache, v_cache = loop(k_cache, v_cache, k, slots)
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                k_cache, v_cache = loop(k_cache, v_cache, k, slots)
                k_cache.block_until_ready()
                best = min(best, (time.perf_counter() - start) / iters)
            return dict(time_us=best * 1e6, gbps=moved / best / 1e9, copy_frac=moved / best / 1e9 / copy_gbps)
        record("kv_write", f"{tokens} tokens", impl, run)


# -------------------------------------------------------------------------------------- main

def decode_tilings(variants: list[tuple[int, int, int, int]], min_split_keys: int) -> dict[str, KernelConfig]:
    """Decode tilings of 16 rows (4 tokens x the GQA group) per (keys per block, splits, warps, stages)."""
    return {
        f"k{block_k} s{splits} w{warps} st{stages}": KernelConfig(
            block_q=4, block_k=block_k, num_splits=splits, min_split_blocks=max(1, min_split_keys // block_k),
            num_warps=warps, num_stages=stages)
        for block_k, splits, warps, stages in variants
    }


def decode_sweep() -> dict[str, KernelConfig]:
    return decode_tilings([(64, 8, 4, 3), (64, 4, 4, 3), (64, 16, 4, 3), (32, 8, 4, 4),
                           (128, 8, 4, 2), (128, 8, 8, 3), (64, 8, 8, 3), (64, 8, 4, 2)], min_split_keys=512)


def w1_sweep() -> dict[str, KernelConfig]:
    return decode_tilings([(64, 1, 4, 3), (64, 1, 4, 2), (128, 1, 4, 2), (32, 1, 4, 3), (64, 2, 4, 3),
                           (64, 4, 4, 3), (32, 4, 4, 2), (32, 4, 2, 2), (64, 4, 2, 2)], min_split_keys=128)


def prefill_sweep() -> dict[str, KernelConfig]:
    out = {}
    for rows, block_k, warps, stages in [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3),
                                         (128, 32, 8, 4), (128, 64, 8, 2), (256, 64, 8, 3)]:
        out[f"rows{rows} k{block_k} w{warps} st{stages}"] = KernelConfig(
            block_q=rows // GROUP, block_k=block_k, num_warps=warps, num_stages=stages)
    return out


def mosaic_sweep() -> dict[str, MosaicConfig]:
    return {f"mosaic k{block_k} st{stages}{' regs' * registers}{' pingpong' * pingpong}":
            MosaicConfig(block_k, stages, registers, pingpong)
            for block_k, stages, registers, pingpong in [
                (64, 2, False, False), (64, 3, False, False), (64, 4, False, False), (128, 2, False, False),
                (64, 2, True, False), (64, 3, True, False), (128, 2, True, False),
                (64, 2, False, True), (64, 2, True, True), (128, 2, True, True)]}


def runner_form(fields: str) -> MosaicConfig:
    """The runner's Mosaic form at these heads with `fields` ("pingpong=True,stages=3") changed."""
    q = jax.ShapeDtypeStruct((8192, NUM_Q_HEADS, HEAD_DIM), DTYPE)
    pages = jax.ShapeDtypeStruct((1, PAGE, NUM_KV_HEADS, HEAD_DIM), DTYPE)
    changes = dict(field.split("=", 1) for field in fields.split(",") if field)
    return dataclasses.replace(mosaic_config(q, pages, interpret=False),
                               **{name.strip(): ast.literal_eval(value) for name, value in changes.items()})


def summary() -> list[str]:
    """Every ratio against a peer, then the issue's targets."""
    lines = []
    for row in ROWS:
        for peer, ratio in row.get("vs", {}).items():
            lines.append(f"{row['section']} {row['case']}: {row['impl']} x{ratio:.2f} faster than {peer}")

    def find(section, case, impl):
        return next((r for r in ROWS if (r["section"], r["case"], r["impl"]) == (section, case, impl)
                     and "error" not in r), None)

    nan = float("nan")
    if row := find("decode", "b64 x ctx4096", "ours (pallas/triton)"):
        vs_jax = row.get("vs", {}).get("jax ops.gpu.paged_attention", nan)
        lines.append(f"TARGET decode b64 x 4k: {100 * row['copy_frac']:.1f}% of copy "
                     f"(>= 80%), x{vs_jax:.2f} vs jax paged_attention (>= 1.5)")
    for case in ("1 x 8192", "16 x 512"):
        for impl in ("ours (pallas/triton)", "ours (mosaic)"):
            if row := find("prefill", case, impl):
                vs_cudnn = row.get("vs", {}).get("jax.nn.dpa cudnn (dense)", nan)
                lines.append(f"TARGET prefill {case}, {impl}: x{vs_cudnn:.2f} of cuDNN's speed (>= 0.9)")
    return lines


def main():
    global PAGE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-sweep", action="store_true", help="skip the tiling sweep")
    parser.add_argument("--quick", action="store_true", help="only the target cases")
    parser.add_argument("--w1-sweep", action="store_true", help="only tilings for W1's decode (batch 1, short context)")
    parser.add_argument("--fp8", action="store_true", help="only decode with bf16 against fp8 pages")
    parser.add_argument("--prefill", action="store_true", help="only prefill, and the Mosaic kernel's tilings")
    parser.add_argument("--mosaic-form", metavar="FIELD=VALUE,...", help="only the Mosaic kernel at both prefill "
                        "shapes, in the runner's form with these MosaicConfig fields changed ('' for the form itself)")
    parser.add_argument("--profile", metavar="DIR", help="only the Mosaic kernel at 16 x 512 under Mosaic GPU's "
                                                          "profiler (traces written to DIR): each phase's time")
    parser.add_argument("--page", type=int, default=16, help="tokens per page of the KV cache (the runner's "
                                                               "default block_size: 16)")
    args = parser.parse_args()
    PAGE = args.page
    print(f"devices: {jax.devices()}", flush=True)
    if args.profile:
        profile_case(16, 512, args.profile)
        return
    if args.mosaic_form is not None:
        config = runner_form(args.mosaic_form)
        for num_seqs, seq_len in ((1, 8192), (16, 512)):
            prefill_case(num_seqs, seq_len, configs={f"mosaic {config}": config})
        report()
        return

    copy = record("copy", "4 GiB -> 4 GiB", "xla", measure_copy)
    copy_gbps = copy.get("gbps", 4210.0)
    if args.fp8:
        for batch in (64, 256):
            for kv_dtype in (DTYPE, FP8):
                decode_case(batch, 4096, copy_gbps, configs={"default": None}, kv_dtype=kv_dtype)
    elif args.w1_sweep:
        for context in (129, 385):
            decode_case(1, context, copy_gbps, configs={"default": None} | w1_sweep(), tokens=16)
        decode_case(64, 4096, copy_gbps, configs={"default": None})
    elif args.prefill:
        for num_seqs, seq_len in ((1, 8192), (16, 512)):
            prefill_case(num_seqs, seq_len)
        mixed_case(2048, 63, 4096)
        if not args.no_sweep:
            for num_seqs, seq_len in ((1, 8192), (16, 512)):
                prefill_case(num_seqs, seq_len, configs=mosaic_sweep())
    if args.fp8 or args.w1_sweep or args.prefill:
        report()
        return
    batches = (64,) if args.quick else (1, 16, 64, 256)
    contexts = (4096,) if args.quick else (512, 4096, 32768)
    for context in contexts:
        for batch in batches:
            decode_case(batch, context, copy_gbps)
    for num_seqs, seq_len in ((1, 8192), (16, 512)):
        prefill_case(num_seqs, seq_len)
    mixed_case(2048, 63, 4096)
    for tokens in (256, 8192):
        kv_write_case(tokens, copy_gbps)
    if not args.no_sweep:
        decode_case(64, 4096, copy_gbps, configs=decode_sweep())
        prefill_case(1, 8192, configs=prefill_sweep() | mosaic_sweep())
    report()


def report() -> None:
    print("\n" + "=" * 110)
    for row in ROWS:
        print(_format(row))
    print("-" * 110)
    lines = summary()
    print("\n".join(lines))
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "attention.json")
        with open(path, "w") as f:
            json.dump(dict(device=str(jax.devices()[0]), rows=ROWS, summary=lines), f, indent=1)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
