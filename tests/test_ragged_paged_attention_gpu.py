"""Ragged paged attention and the KV write compiled for the GPU (no interpret mode).

Run on the H200: `PYTHONPATH=$PWD python -m pytest -m gpu tests/test_ragged_paged_attention_gpu.py`.
The batches come from `tests/kernel_batches.py.make_batch` (NaN-poisoned cache and padding queries,
garbage block-table entries past each context, which point outside the cache: a masked load that
is not masked would fault or bring NaN in).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrunner import platform
from pallas_kernels import (
    ragged_paged_attention,
    ragged_paged_attention_decode,
    reference_ragged_paged_attention,
    write_kv,
)
from kernel_batches import make_batch
from pallas_kernels.ragged_paged_attention import prefill_config

pytestmark = pytest.mark.gpu


def decode(*args, **kwargs):
    return ragged_paged_attention_decode(*args, num_sms=platform.num_sms(), **kwargs)


ENTRIES = {"ragged": ragged_paged_attention, "decode": decode}


@pytest.fixture(autouse=True, scope="module")
def _needs_gpu():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")


def _check(batch, out, want, dtype):
    out = np.asarray(out.astype(jnp.float32))
    total = batch.total
    assert not np.isnan(out).any()
    np.testing.assert_array_equal(out[total:], 0.0)
    # fp32: IEEE fp32 products in the kernel; bf16: P is rounded to bf16 before P @ V.
    tol = 2e-4 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(out[:total], np.asarray(want, np.float32)[:total], atol=tol, rtol=tol)


def _compare(batch, dtype, entries=tuple(ENTRIES), **static):
    want = reference_ragged_paged_attention(*batch.args, **static)
    for entry in entries:
        out = jax.jit(functools.partial(ENTRIES[entry], **static))(*batch.args)
        _check(batch, out, want, dtype)


CASES = [  # (dtype, head_dim, page size, kv heads, group, window, soft cap)
    (jnp.bfloat16, 128, 16, 8, 4, None, None),  # Llama-3-8B heads
    (jnp.float32, 128, 16, 8, 4, None, None),
    (jnp.bfloat16, 64, 32, 2, 7, None, None),
    (jnp.float32, 64, 64, 4, 1, 37, None),
    (jnp.bfloat16, 256, 64, 2, 2, None, 30.0),
    (jnp.float32, 256, 16, 1, 8, 100, 20.0),
    (jnp.bfloat16, 128, 32, 4, 3, 300, None),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_reference(case):
    dtype, head_dim, block_size, num_kv_heads, group, window, cap = case
    for i in range(3):
        batch = make_batch(1000 + 10 * CASES.index(case) + i, dtype=dtype, head_dim=head_dim,
                           block_size=block_size, num_kv_heads=num_kv_heads, group=group,
                           num_slots=12, num_tokens=256, max_blocks=1024 // block_size,
                           max_chunk=200, fill=i == 2, q_scale=1.0 if cap is None else 8.0)
        _compare(batch, dtype, sm_scale=1 / math.sqrt(head_dim), sliding_window=window, soft_cap=cap)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("queries_per_seq", [1, 4])
def test_uniform_decode_long_context(dtype, queries_per_seq):
    """Decode batches with contexts up to 8k keys: the default decode tiling splits the KV."""
    rng = np.random.default_rng(7 + queries_per_seq)
    num_live = 10
    ctx = [int(c) for c in rng.integers(queries_per_seq, 8192, num_live)]
    batch = make_batch(int(rng.integers(1 << 30)), dtype=dtype, head_dim=128, block_size=16,
                       num_kv_heads=8, group=4, num_slots=16, num_tokens=16 * queries_per_seq,
                       max_blocks=512, q_lens=[queries_per_seq] * num_live, ctx_lens=ctx)
    static = dict(sm_scale=1 / math.sqrt(128))
    want = reference_ragged_paged_attention(*batch.args, **static)
    out = jax.jit(functools.partial(decode, queries_per_seq=queries_per_seq, **static))(*batch.args)
    _check(batch, out, want, dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_a_short_step_over_a_long_context(dtype):
    """A chunk of 65 tokens behind an 8k-token context beside decodes, as a revisited prefix's
    message is: the mixed kernel's default tiling splits the context (`prefill_config`)."""
    rng = np.random.default_rng(11)
    q_lens = [65] + [1] * 15
    ctx = [8192] + [int(c) for c in rng.integers(1, 8192, 15)]
    batch = make_batch(int(rng.integers(1 << 30)), dtype=dtype, head_dim=128, block_size=16, num_kv_heads=8,
                       group=4, num_slots=16, num_tokens=128, max_blocks=520, q_lens=q_lens, ctx_lens=ctx)
    assert prefill_config(dtype, 128, 4, num_tokens=128, max_context=520 * 16).num_splits > 1  # the form compared
    _compare(batch, dtype, entries=("ragged",), sm_scale=1 / math.sqrt(128))


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_write_kv(impl):
    rng = np.random.default_rng(3)
    shape = (300, 16, 8, 128)
    k_cache = np.full(shape, np.nan, np.float32)
    v_cache = np.full(shape, np.nan, np.float32)
    k = rng.standard_normal((256, 8, 128)).astype(np.float32)
    v = rng.standard_normal((256, 8, 128)).astype(np.float32)
    slots = rng.choice(300 * 16, 256, replace=False).astype(np.int32)
    slots[rng.random(256) < 0.2] = -1
    fn = jax.jit(functools.partial(write_kv, impl=impl), donate_argnums=(0, 1))
    got = fn(jnp.asarray(k_cache, jnp.bfloat16), jnp.asarray(v_cache, jnp.bfloat16),
             jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots))
    for cache, rows, out in zip((k_cache, v_cache), (k, v), got):
        want = cache.reshape(-1, 8, 128).copy()
        want[slots[slots >= 0]] = rows[slots >= 0]
        want = np.asarray(jnp.asarray(want, jnp.bfloat16).astype(jnp.float32))
        np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)).reshape(want.shape), want)


@pytest.mark.parametrize("impl", ["pallas", "xla"])
@pytest.mark.parametrize("entry", ["ragged", "decode"])
def test_step_never_copies_the_cache(impl, entry):
    """write_kv + attention with donated caches, compiled for the GPU: both caches are aliased and
    the temporaries stay far below one cache."""
    cache = jnp.zeros((4096, 16, 8, 128), jnp.bfloat16)  # 128 MiB per cache
    batch = make_batch(5, dtype=jnp.bfloat16, head_dim=128, block_size=16, num_kv_heads=8, group=4,
                       num_slots=16, num_tokens=256, max_blocks=64)
    new_kv = jnp.ones((256, 8, 128), jnp.bfloat16)
    slots = jnp.arange(256, dtype=jnp.int32)

    def step(k_cache, v_cache, q, *rest):
        k_cache, v_cache = write_kv(k_cache, v_cache, new_kv, new_kv, slots, impl=impl)
        return k_cache, v_cache, ENTRIES[entry](q, k_cache, v_cache, *rest, sm_scale=0.1)

    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
        cache, cache + 1, batch.q, *batch.args[3:]).compile()
    mem = compiled.memory_analysis()
    assert mem.alias_size_in_bytes >= 2 * cache.nbytes
    assert mem.temp_size_in_bytes < cache.nbytes // 8
