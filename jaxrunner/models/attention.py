"""Paged attention for the model: write this step's K/V into the cache, then attend over it.

The metadata describes one ragged batch: sequence s owns queries
`query_start_loc[s]:query_start_loc[s+1]`, the last tokens of its `seq_lens[s]` tokens, whose keys
live in the pages `block_tables[s]`. Prefill chunks and decodes mix freely in one call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxrunner.config import Kernels, ModelConfig
from jaxrunner.models.llama import MODEL_AXIS
from jaxrunner.pytree import pytree_dataclass, static_field
from pallas_kernels import (
    FP8,
    MosaicConfig,
    mosaic_prefill_attention,
    ragged_paged_attention,
    ragged_paged_attention_decode,
    reference_ragged_paged_attention,
    write_kv,
)
from pallas_kernels.mosaic_attention import supported as mosaic_supported

FP8_MAX = float(jnp.finfo(FP8).max)


@pytree_dataclass
class AttentionMetadata:
    slot_mapping: jax.Array  # i32 [T]: block * block_size + offset of each token's K/V; -1 for padding
    query_start_loc: jax.Array  # i32 [S + 1]
    seq_lens: jax.Array  # i32 [S]
    block_tables: jax.Array  # i32 [S, max_blocks]
    num_seqs: jax.Array  # i32 []


@pytree_dataclass
class PagedAttention:
    """The model's attention for one batch, called by every layer: write the layer's new K/V into its
    pages, then attend over them. A pytree (the batch's metadata are its leaves, the model's options
    and the kernel choice its structure), so the jitted decoder layer takes it as an argument.

    With Pallas kernels both halves are Pallas (the KV write aliased in place; the
    decode-specialised attention when every sequence has one query token; with `kernels.mosaic`
    the other batches through the Mosaic GPU kernel where it takes them). Otherwise they are the
    pure-jnp scatter and reference, which compute the same function.
    """

    md: AttentionMetadata
    sm_scale: float = static_field()
    soft_cap: float | None = static_field()
    kv_scales: tuple[float, float] = static_field()  # an fp8 cache's K and V scales
    kernels: Kernels = static_field()
    uniform_decode: bool = static_field()
    queries_per_seq: int = static_field()  # of the decode form: 1, or 1 + k with speculative decoding

    def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, kv: tuple,
                 window: int | None) -> tuple[jax.Array, tuple]:
        """(out [T, Hq, D], the layer's (k, v) pages) for this step's q, k, v and the layer's pages,
        each query seeing the last `window` keys (None: all). Under tensor parallelism (a mesh with
        MODEL_AXIS set) each device runs it on its own heads."""
        attend = functools.partial(self._attend, window=window)
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or mesh.shape.get(MODEL_AXIS, 1) == 1:
            return attend(q, k, v, kv, self.md)
        heads, pages = P(None, MODEL_AXIS, None), P(None, None, MODEL_AXIS, None)
        return jax.shard_map(attend, in_specs=(heads, heads, heads, (pages, pages), P()),
                             out_specs=(heads, (pages, pages)), check_vma=False)(q, k, v, kv, self.md)

    def _attend(self, q: jax.Array, k: jax.Array, v: jax.Array, kv: tuple, md: AttentionMetadata, *,
                window: int | None) -> tuple[jax.Array, tuple]:
        kernels = self.kernels
        fp8 = kv[0].dtype == FP8
        k_scale, v_scale = self.kv_scales if fp8 else (1.0, 1.0)
        if fp8:  # stored divided by the scales, saturated at fp8's range; read back times them
            k, v = (jnp.clip(x.astype(jnp.float32) / scale, -FP8_MAX, FP8_MAX) for x, scale in ((k, k_scale), (v, v_scale)))
        options = dict(sm_scale=self.sm_scale * k_scale, sliding_window=window, soft_cap=self.soft_cap)
        if not kernels.pallas:
            k_cache, v_cache = write_kv(*kv, k, v, md.slot_mapping, impl="xla")
            attention = functools.partial(reference_ragged_paged_attention, **options,
                                          batch_invariant=kernels.batch_invariant)
        else:
            k_cache, v_cache = write_kv(*kv, k, v, md.slot_mapping, interpret=kernels.interpret)
            if self.uniform_decode:
                attention = functools.partial(ragged_paged_attention_decode, num_sms=kernels.num_sms, **options,
                                              queries_per_seq=self.queries_per_seq, interpret=kernels.interpret)
            elif kernels.mosaic and mosaic_supported(q, k_cache):
                attention = functools.partial(mosaic_prefill_attention, **options, interpret=kernels.interpret,
                                              config=mosaic_config(q, k_cache, kernels.interpret),
                                              num_ctas=kernels.num_sms)
            else:
                attention = functools.partial(ragged_paged_attention, **options, interpret=kernels.interpret,
                                              batch_invariant=kernels.batch_invariant)
        out = attention(q, k_cache, v_cache, md.query_start_loc, md.seq_lens, md.block_tables, md.num_seqs)
        if v_scale != 1.0:
            out = (out * v_scale).astype(q.dtype)
        return out, (k_cache, v_cache)


def mosaic_config(q: jax.Array, k_cache: jax.Array, interpret: bool) -> MosaicConfig:
    """The Mosaic prefill attention's form: on a GPU blocks of 128 keys with P in registers, the
    fastest of `benchmarks/attention.py --prefill`'s sweep (docs/benchmarks.md), where the shared
    memory holds it; interpreted, the form Mosaic GPU's interpreter can run."""
    fastest = MosaicConfig(block_k=128, registers=True)
    return fastest if not interpret and mosaic_supported(q, k_cache, fastest) else MosaicConfig()


def paged_attend(
    model: ModelConfig, md: AttentionMetadata, kernels: Kernels, *, uniform_decode: bool = False, queries_per_seq: int = 1,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> PagedAttention:
    """The model's paged attention over the batch `md` describes (`kv_scales`: an fp8 cache's)."""
    scale = (model.query_pre_attn_scalar or model.head_dim) ** -0.5
    return PagedAttention(md, scale, model.attn_soft_cap, tuple(map(float, kv_scales)), kernels, uniform_decode,
                          queries_per_seq)
