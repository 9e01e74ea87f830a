"""LoRA adapters in device slots, applied to a batch whose tokens each name their slot.

For every layer and every projection (q|k|v, o, gate|up, down: the model's fused tensors) the
device holds all `max_loras` adapters side by side, each padded to the rank R = `max_lora_rank`:
`a` [in, L * P * R] (slot-major: slot l's parts p = 0..P-1, R columns each) and `b`
[L * P * R, out], block diagonal (part p's R rows feed part p's output columns), with the scaling
folded in. A token's delta is then two dense matmuls over every slot, the first one's columns of
other slots zeroed by the token's one-hot slot mask: no gather of weights per token (XLA's grouped
matmul over tokens sorted by slot and the Pallas shrink/expand kernels of `tests/lora_kernels.py`
measured slower: docs/benchmarks.md), one expand matmul per
projection (as fast as one per part, and simpler; the zero blocks cost memory), and shapes that
depend only on (L, R), so adapters come and go without a recompile. Slot value 0 is the base model (an all-zero mask row); slot value l + 1 is device slot l.
The delta itself is the model's (`llama.lora_delta`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrunner.config import LoraConfig, ModelConfig
from jaxrunner.models.tensors import LORA_TARGETS, layer_tensors

Lora = tuple  # per layer: {projection: {"a": [in, L * P * R], "b": [L * P * R, out]}}; () when off


def projection_parts(cfg: ModelConfig) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Each LoRA-able projection (`tensors.LORA_TARGETS`): (its input width, the output widths of its parts)."""
    return {name: (t.shape[0], t.widths) for name, t in layer_tensors(cfg).items() if t.weight in LORA_TARGETS}


def lora_shapes(cfg: ModelConfig, lora: LoraConfig) -> Lora:
    if not lora.enabled:
        return ()
    n, r = lora.max_loras, lora.max_lora_rank
    layer = {name: {"a": (width, n * len(outs) * r), "b": (n * len(outs) * r, sum(outs))}
             for name, (width, outs) in projection_parts(cfg).items()}
    return tuple(layer for _ in range(cfg.num_layers))


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and bool(x) and all(isinstance(n, int) for n in x)


def lora_structs(cfg: ModelConfig, lora: LoraConfig, dtype: str) -> Lora:
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dtype), lora_shapes(cfg, lora), is_leaf=_is_shape)


def init_lora(cfg: ModelConfig, lora: LoraConfig, dtype: str) -> Lora:
    """Every slot empty (zeros)."""
    return jax.tree.map(lambda s: jnp.zeros(s, dtype), lora_shapes(cfg, lora), is_leaf=_is_shape)


def write_slot(lora: Lora, slot: jax.Array, adapter: Lora) -> Lora:
    """`lora` with device slot `slot` (0-based, traced: one program for every slot) holding `adapter`,
    whose tensors are one slot's: `a` [in, P * R], `b` [P * R, out]."""

    def layer(dst: dict, src: dict) -> dict:
        out = {}
        for name, w in dst.items():
            a, b = src[name]["a"], src[name]["b"]
            out[name] = {
                "a": jax.lax.dynamic_update_slice(w["a"], a.astype(w["a"].dtype), (0, slot * a.shape[1])),
                "b": jax.lax.dynamic_update_slice(w["b"], b.astype(w["b"].dtype), (slot * b.shape[0], 0)),
            }
        return out

    return tuple(layer(dst, src) for dst, src in zip(lora, adapter, strict=True))
