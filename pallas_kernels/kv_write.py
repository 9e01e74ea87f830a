"""Write the current step's K and V into one layer's paged cache, in place.

The cache is the largest thing on the device, so this write must never copy it. Two ways are
offered, both in place when the caller donates the cache (checked by
tests/test_ragged_paged_attention.py through the compiled `memory_analysis()`):

- `impl="pallas"` (default): a Pallas kernel, one program per token, whose outputs alias the cache
  inputs (`input_output_aliases`). XLA hands the kernel the cache buffer itself.
- `impl="xla"`: a scatter of token rows into the cache seen as `[num_blocks * block_size, Hkv*D]`
  rows; XLA performs a scatter into a donated operand in place.

Slots follow vLLM: `slot = block_id * block_size + offset`, and -1 marks a padding token whose
write is skipped.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.common import next_pow2


def write_kv(
    k_cache: jax.Array,
    v_cache: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    *,
    interpret: bool = False,
    impl: Literal["pallas", "xla"] = "pallas",
) -> tuple[jax.Array, jax.Array]:
    """Store `k[t]`, `v[t]` ([T, Hkv, D]) at cache slot `slot_mapping[t]`; returns the caches.

    The caches are `[num_blocks, block_size, Hkv, D]`. Donate them in the enclosing jit so the
    update happens in place.
    """
    if k_cache.shape != v_cache.shape or k.shape != v.shape:
        raise ValueError(f"shape mismatch: caches {k_cache.shape}/{v_cache.shape}, kv {k.shape}/{v.shape}")
    if k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"k {k.shape} does not match cache rows {k_cache.shape[2:]}")
    k = k.astype(k_cache.dtype)
    v = v.astype(v_cache.dtype)
    slot_mapping = slot_mapping.astype(jnp.int32)
    if impl == "xla":
        return _write_kv_xla(k_cache, v_cache, k, v, slot_mapping)
    if impl == "pallas":
        return _write_kv_pallas(k_cache, v_cache, k, v, slot_mapping, interpret=interpret)
    raise ValueError(f"unknown impl {impl!r}")


def _write_kv_xla(k_cache, v_cache, k, v, slot_mapping):
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    num_slots = num_blocks * block_size
    # A negative slot would wrap around; send it past the end, where mode="drop" discards it.
    rows = jnp.where(slot_mapping < 0, num_slots, slot_mapping)

    def scatter(cache, new):
        flat = cache.reshape(num_slots, num_kv_heads * head_dim)
        flat = flat.at[rows].set(new.reshape(new.shape[0], -1), mode="drop")
        return flat.reshape(cache.shape)

    return scatter(k_cache, k), scatter(v_cache, v)


def _write_kv_kernel(slot_ref, kv_ref, k_cache_in, v_cache_in, k_cache_ref, v_cache_ref, *,
                     num_kv_heads: int, padded_heads: int):
    del k_cache_in, v_cache_in  # The same buffers as the outputs (aliased); only written.
    t = pl.program_id(0)
    slot = slot_ref[t]
    block_size = k_cache_ref.shape[1]
    head_dim = k_cache_ref.shape[3]

    @pl.when(slot >= 0)
    def _():
        heads = jnp.arange(padded_heads, dtype=jnp.int32)[:, None]
        dims = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
        mask = heads < num_kv_heads
        block = slot // block_size
        offset = slot % block_size
        for i, dst in enumerate((k_cache_ref, v_cache_ref)):
            row = plt.load(kv_ref.at[t, i, heads, dims], mask=mask, other=0.0)
            plt.store(dst.at[block, offset, heads, dims], row, mask=mask)


def _write_kv_pallas(k_cache, v_cache, k, v, slot_mapping, *, interpret):
    num_tokens, num_kv_heads, _ = k.shape
    kernel = functools.partial(
        _write_kv_kernel, num_kv_heads=num_kv_heads, padded_heads=next_pow2(num_kv_heads))
    # K and V as one [T, 2, Hkv, D] operand: XLA computes it in one fusion with their producers
    # (the split of the q|k|v projection, RoPE on K) instead of one kernel for each.
    return pl.pallas_call(
        kernel,
        grid=(num_tokens,),
        out_shape=(jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                   jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)),
        input_output_aliases={2: 0, 3: 1},
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        name="write_kv",
    )(slot_mapping, jnp.stack([k, v], axis=1), k_cache, v_cache)
