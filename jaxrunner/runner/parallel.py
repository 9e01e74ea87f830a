"""Tensor parallelism: the mesh, and the params laid out for the split.

A runner with `tensor_parallel_size` t > 1 (or a data-parallel replica past the first) runs every
program on a mesh of t devices (axes "data" x `MODEL_AXIS`, 1 x t) under `jax.set_mesh`: the params and the KV cache are placed by the
PartitionSpecs declared beside their shapes (`llama.param_specs`, `state.state_specs`), and XLA's
partitioner inserts the collectives (an all-reduce after o and after down in every layer). The
attention kernels run per device through `shard_map`, each device on its own heads; a
Mixture-of-Experts layer's experts split by expert, each device running its own (`moe.moe_mlp`).

Each shard must hold whole heads (`RunnerConfig.check_model` names the sizes that cannot split):
q|k|v's columns are laid out shard by shard, each shard its q heads then their k and v heads
(`shard_layout`), and gate|up likewise. With fewer KV heads than
shards, each KV head is repeated so every shard holds the one its q heads read (the model then has
t KV heads, t / num_kv_heads copies of each; the cache is that much larger, as in vLLM).

The vocabulary need not divide: as vLLM's vocab-parallel embedding and LM head, the runner pads it
to a multiple of t (`ModelConfig.padded_vocab_size`) with zero rows of the embedding and zero
columns of the head, and the padding's logits are cut off once gathered (`step.full_logits`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxrunner.config import ModelConfig
from jaxrunner.models.llama import MODEL_AXIS, Params
from jaxrunner.models.quantization import map_columns


def make_mesh(tp: int, replica: int = 0) -> Mesh:
    """The mesh of data-parallel replica `replica`: devices [replica * tp, (replica + 1) * tp)."""
    devices = jax.devices()
    if (replica + 1) * tp > len(devices):
        need = f"tensor_parallel_size={tp}" if replica == 0 else f"replica {replica} of tensor_parallel_size={tp}"
        raise ValueError(f"{need} needs {(replica + 1) * tp} devices, but {len(devices)} "
                         f"{devices[0].platform.upper()} device(s) exist; lower tensor_parallel_size or "
                         "data_parallel_size")
    return Mesh(np.array(devices[replica * tp : (replica + 1) * tp]).reshape(1, tp), ("data", MODEL_AXIS))


def sharded_config(model: ModelConfig, tp: int) -> ModelConfig:
    """The model as the shards run it: at least one KV head per shard, the fused tensors shard by shard."""
    return dataclasses.replace(model, num_kv_heads=max(model.num_kv_heads, tp), shards=tp)


def shard_layout(params: Params, model: ModelConfig, tp: int) -> Params:
    """`params` (the checkpoint's layout, `model`'s heads and vocabulary) laid out for `sharded_config(model, tp)`."""
    d, heads, kv = model.head_dim, model.num_heads, model.num_kv_heads
    repeat = max(tp // kv, 1)

    def by_shard(*parts: jax.Array) -> jax.Array:
        """Parts [..., width_i], each split in tp along its last axis, regrouped shard by shard."""
        lead = parts[0].shape[:-1]
        split = [p.reshape(*lead, tp, p.shape[-1] // tp) for p in parts]
        return jnp.concatenate(split, axis=-1).reshape(*lead, -1)

    def qkv(w: jax.Array) -> jax.Array:
        q, k, v = jnp.split(w, [heads * d, (heads + kv) * d], axis=-1)
        if repeat > 1:  # each KV head copied for the shards whose q heads read it
            k, v = (jnp.repeat(x.reshape(*x.shape[:-1], kv, d), repeat, axis=-2).reshape(*x.shape[:-1], -1) for x in (k, v))
        return by_shard(q, k, v)

    def gate_up(w: jax.Array) -> jax.Array:
        return by_shard(*jnp.split(w, 2, axis=-1))

    def layer(p: dict) -> dict:
        out = dict(p, wqkv=map_columns(qkv, p["wqkv"]))
        if "w_gate_up" in p:  # (a Mixture-of-Experts layer splits its experts whole, by expert)
            out["w_gate_up"] = map_columns(gate_up, p["w_gate_up"])
        if "bqkv" in p:
            out["bqkv"] = qkv(p["bqkv"])
        return out

    out = dict(params, layers=tuple(layer(p) for p in params["layers"]))
    pad = sharded_config(model, tp).padded_vocab_size - model.vocab_size
    if pad:  # tokens that never come in, and whose logits are cut off
        out["embed"] = jnp.pad(params["embed"], ((0, pad), (0, 0)))
        if "lm_head" in params:
            out["lm_head"] = jnp.pad(params["lm_head"], ((0, 0), (0, pad)))
    return out


def place(tree, specs, mesh: Mesh):
    """Arrays (or ShapeDtypeStructs) of `tree` on `mesh` by the PartitionSpecs of `specs`."""
    def put(x, spec):
        sharding = NamedSharding(mesh, spec)
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        return jax.device_put(x, sharding)

    return jax.tree.map(put, tree, specs)
