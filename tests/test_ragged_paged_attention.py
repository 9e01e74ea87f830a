"""Ragged paged attention and the KV write, on CPU: Pallas interpret mode against the references.

Interpret mode starts every output as NaN, and `tests/kernel_batches.py.make_batch` poisons the cache
and the padding queries with NaN, so an unwritten output or a stray read fails the comparison.
Each configuration compiles once (compilation dominates: XLA optimisations are switched off for
this module) and then runs several fresh random batches.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from kernel_batches import make_batch, naive_attention

from jaxrunner.platform import H200
from pallas_kernels import (
    KernelConfig,
    ragged_paged_attention,
    ragged_paged_attention_decode,
    reference_ragged_paged_attention,
    write_kv,
)
from pallas_kernels.ragged_paged_attention import decode_config, prefill_config

NUM_SMS = 132  # an H200's
ENTRIES = {"ragged": ragged_paged_attention, "decode": functools.partial(ragged_paged_attention_decode, num_sms=NUM_SMS),
           "invariant": functools.partial(ragged_paged_attention, batch_invariant=True)}


@pytest.fixture(autouse=True, scope="module")
def _fast_compiles():
    old = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", old)


@functools.cache
def _kernel_fn(entry: str, **static):
    return jax.jit(functools.partial(ENTRIES[entry], interpret=True, **static))


@functools.cache
def _reference_fn(**static):
    return functools.partial(reference_ragged_paged_attention, **static)


def _check(batch, out, want, dtype):
    out = np.asarray(out.astype(jnp.float32))
    total = batch.total
    assert not np.isnan(out[:total]).any(), "unwritten or poisoned output"
    np.testing.assert_array_equal(out[total:], 0.0)  # padding tokens come out as zeros
    tol = 1e-4 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(out[:total], np.asarray(want, np.float32)[:total], atol=tol, rtol=tol)


def _run_and_check(batch, dtype, entries=("ragged", "decode"), queries_per_seq=None, config=None,
                   **static):
    want = _reference_fn(**static)(*batch.args)
    if queries_per_seq is not None:
        static["queries_per_seq"] = queries_per_seq
    if config is not None:
        static["config"] = config
    for entry in entries:
        _check(batch, _kernel_fn(entry, **static)(*batch.args), want, dtype)


# (dtype, head_dim, page size, kv heads, GQA group, sliding window, soft cap): every head dim and
# page size in both dtypes; groups 1 (MHA), 2, 4, 8, and 3 and 7 (padded to a power of two);
# windows narrower than a page and wider than several; soft-caps alone and with a window.
CASES = [
    (jnp.float32, 64, 16, 2, 4, None, None),
    (jnp.bfloat16, 128, 32, 1, 8, 5, None),
    (jnp.float32, 256, 64, 2, 1, None, 5.0),
    (jnp.bfloat16, 64, 64, 2, 7, 40, 5.0),
    (jnp.bfloat16, 256, 16, 1, 2, None, None),
    (jnp.float32, 128, 32, 2, 3, 24, None),
]
DECODE_CASES = (0, 3, 4)


def _case_id(case):
    dtype, head_dim, block_size, _, group, window, cap = case
    return f"{jnp.dtype(dtype).name}-d{head_dim}-p{block_size}-g{group}-win{window}-cap{cap}"


def _shape_kwargs(dtype, head_dim, block_size, num_kv_heads, group):
    return dict(dtype=dtype, head_dim=head_dim, block_size=block_size, num_kv_heads=num_kv_heads,
                group=group, max_blocks=max(2, 256 // block_size))


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_random_ragged_batches(case):
    """Mixed batches (decodes, prefill chunks, whole and one-token prompts, drafts), fresh lengths
    per batch; the second batch fills T exactly (no padding tail)."""
    dtype, head_dim, block_size, num_kv_heads, group, window, cap = case
    kw = _shape_kwargs(dtype, head_dim, block_size, num_kv_heads, group)
    index = CASES.index(case)
    # The decode and batch-invariant entries run the same kernel with other tilings: half the cases
    # each are enough for them.
    entries = ("ragged", "decode") if index in DECODE_CASES else ("ragged", "invariant")
    for i in range(2):
        batch = make_batch(100 * index + i, fill=i == 1,
                           q_scale=1.0 if cap is None else 4.0, **kw)  # large logits: the cap bites
        _run_and_check(batch, dtype, entries=entries, sm_scale=1 / math.sqrt(head_dim),
                       sliding_window=window, soft_cap=cap)


def test_uniform_speculative_decode():
    """Every sequence verifies 1 + 2 drafts: the decode entry's own case."""
    rng = np.random.default_rng(31)
    num_live = 5
    kw = _shape_kwargs(jnp.bfloat16, 128, 16, 2, 4)
    for _ in range(2):
        ctx = [int(c) for c in rng.integers(3, 250, num_live)]
        batch = make_batch(int(rng.integers(1 << 30)), q_lens=[3] * num_live, ctx_lens=ctx,
                           num_tokens=32, **kw)
        _run_and_check(batch, jnp.bfloat16, entries=("decode",), sm_scale=0.1, queries_per_seq=3)


def test_split_kv():
    """Flash-decoding splits (forced small, so short contexts split too) and their combine."""
    kw = _shape_kwargs(jnp.float32, 64, 16, 2, 4)
    config = KernelConfig(block_q=4, block_k=16, num_splits=4, min_split_blocks=1)
    for seed in (41, 42):
        batch = make_batch(seed, **kw)
        _run_and_check(batch, jnp.float32, entries=("decode",), sm_scale=0.125, config=config)


def test_prefill_rows_split_over_the_context():
    """The mixed kernel's rows (chunks and prompts of many tokens, whose causal edge a split may
    cut) with the context split, forced small so that these contexts split; the tiling splits on
    its own only a short step over a long context."""
    kw = _shape_kwargs(jnp.bfloat16, 128, 16, 2, 4)
    config = KernelConfig(block_q=8, block_k=16, num_splits=4, min_split_blocks=1)
    for seed in (43, 44):
        batch = make_batch(seed, **kw)
        _run_and_check(batch, jnp.bfloat16, entries=("ragged",), sm_scale=0.1, config=config)
    tiling = functools.partial(prefill_config, jnp.bfloat16, 128, 4)
    assert tiling().num_splits == tiling(num_tokens=2048, max_context=16384).num_splits == 1
    assert tiling(num_tokens=128, max_context=2048).num_splits == 1
    short_step = tiling(num_tokens=128, max_context=16384)
    assert short_step.num_splits == 16 and short_step.min_split_blocks * short_step.block_k == 1024


def test_batch_invariant_tiling_is_the_decode_kernels_rows_in_one_loop_without_splits():
    """Batch-invariant steps run every batch with one tiling: 16 rows a tile (a decode's rows are
    one per query head, as in the decode kernel), no KV split, whatever the batch's size, and every
    key block through one loop."""
    kw = _shape_kwargs(jnp.bfloat16, 128, 16, 2, 2)
    batch = make_batch(7, **kw)
    entry = functools.partial(ragged_paged_attention, sm_scale=0.1, interpret=True, batch_invariant=True)
    assert "ragged_paged_attention_q8_k64_s1_one_loop" in str(jax.make_jaxpr(entry)(*batch.args))


def test_decode_tiling_splits_small_batches():
    """A batch too small to give every SM a program splits a few hundred keys 2-4 ways (it is
    latency-bound); a large batch keeps splits of >= 512 keys. The small batch's default tiling
    (splits of >= 2 key blocks, the last one short) matches the reference."""
    tiling = functools.partial(decode_config, jnp.bfloat16, 128, 4, queries_per_seq=1, num_kv_heads=8)
    small, large = tiling(num_tokens=16, max_context=384, num_sms=NUM_SMS), tiling(num_tokens=64, max_context=4096, num_sms=NUM_SMS)
    assert (small.num_splits, small.min_split_blocks * small.block_k) == (3, 128)
    assert (large.num_splits, large.min_split_blocks * large.block_k) == (8, 512)
    few_sms = tiling(num_tokens=16, max_context=384, num_sms=64)  # the same batch fills a smaller GPU
    assert few_sms.min_split_blocks * few_sms.block_k == 512
    kw = _shape_kwargs(jnp.bfloat16, 128, 16, 2, 4)  # 256 keys at most: 2 splits of >= 128
    for seed, ctx in ((71, 129), (72, 250)):
        batch = make_batch(seed, q_lens=[1], ctx_lens=[ctx], num_tokens=16, **kw)
        _run_and_check(batch, jnp.bfloat16, entries=("decode",), sm_scale=0.1)


def test_edge_batches():
    """No live sequence at all; a lone one-token prompt; a batch with no padding tail."""
    kw = _shape_kwargs(jnp.float32, 64, 16, 2, 4)
    batches = [
        make_batch(51, q_lens=[], ctx_lens=[], **kw),
        make_batch(52, q_lens=[1], ctx_lens=[1], **kw),
        make_batch(53, q_lens=[40, 24], ctx_lens=[40, 200], **kw),
    ]
    for batch in batches:
        _run_and_check(batch, jnp.float32, sm_scale=0.125, sliding_window=None, soft_cap=None)


@pytest.mark.parametrize("window,cap", [(None, None), (7, 3.0)])
def test_reference_matches_naive_loop(window, cap):
    batch = make_batch(61, **_shape_kwargs(jnp.float32, 64, 16, 2, 3))
    static = dict(sm_scale=0.2, sliding_window=window, soft_cap=cap)
    got = np.asarray(_reference_fn(**static)(*batch.args))
    want = naive_attention(batch, **static)
    np.testing.assert_allclose(got[: batch.total], want[: batch.total], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [5, 40])
def test_keys_before_the_window_are_never_read(window):
    """A sliding group gives its pages before the window back to the pool, where another request's
    keys (here NaN) replace them: the reference and the kernels skip them."""
    batch = make_batch(81, **_shape_kwargs(jnp.float32, 64, 16, 2, 2), max_chunk=60)
    k_cache, v_cache = np.array(batch.k_cache), np.array(batch.v_cache)
    qsl, lens, tables = (np.asarray(a) for a in (batch.query_start_loc, batch.seq_lens, batch.block_tables))
    poisoned = 0
    for s in range(int(batch.num_seqs)):
        first_seen = lens[s] - (qsl[s + 1] - qsl[s]) - window + 1  # the lowest key its first query sees
        keys = np.arange(max(first_seen, 0))
        k_cache[tables[s, keys // 16], keys % 16] = v_cache[tables[s, keys // 16], keys % 16] = np.nan
        poisoned += len(keys)
    assert poisoned > 100
    batch = dataclasses.replace(batch, k_cache=jnp.asarray(k_cache), v_cache=jnp.asarray(v_cache))
    static = dict(sm_scale=0.2, sliding_window=window, soft_cap=None)
    want = naive_attention(batch, **static)
    for fn in (_reference_fn(**static), _kernel_fn("ragged", **static), _kernel_fn("decode", **static)):
        got = np.asarray(fn(*batch.args))
        np.testing.assert_allclose(got[: batch.total], want[: batch.total], atol=1e-4, rtol=1e-4)


def test_interpret_mode_poisons_outputs():
    """The premise of the unwritten-output checks: interpret mode starts outputs as NaN."""
    def kernel(x_ref, o_ref):
        del x_ref, o_ref
    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 16), jnp.float32),
                         interpret=True)(jnp.ones((8, 16)))
    assert np.isnan(np.asarray(out)).all()


# ---------------------------------------------------------------------------------- KV write

def _kv_write_case(seed, num_blocks=12, block_size=16, num_kv_heads=3, head_dim=64, num_tokens=16):
    rng = np.random.default_rng(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [np.full(shape, np.nan, np.float32) for _ in range(2)]  # poisoned, aliased outputs
    new = [rng.standard_normal((num_tokens, num_kv_heads, head_dim)).astype(np.float32) for _ in range(2)]
    slots = rng.choice(num_blocks * block_size, num_tokens, replace=False).astype(np.int32)
    slots[rng.random(num_tokens) < 0.3] = -1
    return caches, new, slots


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_write_kv_writes_exactly_the_slots(impl):
    fn = jax.jit(functools.partial(write_kv, interpret=True, impl=impl), donate_argnums=(0, 1))
    for seed in (71, 72):
        (k_cache, v_cache), (k, v), slots = _kv_write_case(seed)
        got = fn(jnp.asarray(k_cache), jnp.asarray(v_cache), jnp.asarray(k), jnp.asarray(v),
                 jnp.asarray(slots))
        for cache, rows, out in zip((k_cache, v_cache), (k, v), got):
            want = cache.reshape(-1, *cache.shape[2:]).copy()
            want[slots[slots >= 0]] = rows[slots >= 0]
            np.testing.assert_array_equal(np.asarray(out).reshape(want.shape), want)


def _memory(fn, *args, donate):
    compiled = jax.jit(fn, donate_argnums=(0, 1) if donate else ()).lower(*args).compile()
    return compiled.memory_analysis()


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_write_kv_in_place(impl):
    """Donated caches are aliased to the outputs with no cache-sized temporary; without donation
    the same measurement sees two fresh caches (so it would catch a copy)."""
    cache = jnp.zeros((1024, 16, 2, 64), jnp.float32)
    new_kv = jnp.ones((64, 2, 64), jnp.float32)
    slots = jnp.arange(64, dtype=jnp.int32)
    fn = functools.partial(write_kv, interpret=True, impl=impl)
    donated = _memory(fn, cache, cache + 1, new_kv, new_kv, slots, donate=True)
    assert donated.alias_size_in_bytes >= 2 * cache.nbytes
    assert donated.temp_size_in_bytes < cache.nbytes // 8
    kept = _memory(fn, cache, cache + 1, new_kv, new_kv, slots, donate=False)
    assert kept.alias_size_in_bytes == 0 and kept.output_size_in_bytes >= 2 * cache.nbytes


def test_step_updates_cache_in_place():
    """write_kv then attention with the caches donated, as in the runner's step: no cache copy."""
    batch = make_batch(81, **_shape_kwargs(jnp.float32, 64, 16, 2, 4))
    cache = jnp.zeros((1024, 16, 2, 64), jnp.float32)
    new_kv = jnp.ones((batch.q.shape[0], 2, 64), jnp.float32)
    slots = jnp.arange(batch.q.shape[0], dtype=jnp.int32)

    def step(k_cache, v_cache, q, *rest):
        k_cache, v_cache = write_kv(k_cache, v_cache, new_kv, new_kv, slots, interpret=True)
        out = ragged_paged_attention_decode(q, k_cache, v_cache, *rest, sm_scale=0.125, num_sms=NUM_SMS,
                                            interpret=True)
        return k_cache, v_cache, out

    donated = _memory(step, cache, cache + 1, batch.q, *batch.args[3:], donate=True)
    assert donated.alias_size_in_bytes >= 2 * cache.nbytes
    assert donated.temp_size_in_bytes < cache.nbytes // 8


# ------------------------------------------------------------------- GPU lowering, checked on CPU



@pytest.mark.parametrize("dtype,head_dim,block_size,group", [
    (jnp.bfloat16, 128, 16, 4), (jnp.float32, 256, 64, 7)])
def test_lowers_to_triton_for_h200(dtype, head_dim, block_size, group):
    """The Pallas -> Triton lowering of both entries and the KV write (the part jax runs; XLA
    compiles the Triton IR later, on the GPU)."""
    num_tokens, num_slots, num_kv_heads = 256, 64, 2
    sds = jax.ShapeDtypeStruct
    cache = sds((999, block_size, num_kv_heads, head_dim), dtype)
    args = (sds((num_tokens, num_kv_heads * group, head_dim), dtype), cache, cache,
            sds((num_slots + 1,), jnp.int32), sds((num_slots,), jnp.int32),
            sds((num_slots, 64), jnp.int32), sds((), jnp.int32))
    kv = sds((num_tokens, num_kv_heads, head_dim), dtype)
    fns = [(functools.partial(entry, sm_scale=0.1, sliding_window=100, soft_cap=30.0), args)
           for entry in ENTRIES.values()]
    fns.append((write_kv, (cache, cache, kv, kv, sds((num_tokens,), jnp.int32))))
    for fn, fn_args in fns:
        with jax.sharding.use_abstract_mesh(H200):
            text = jax.jit(fn).trace(*fn_args).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text
