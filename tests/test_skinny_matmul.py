"""The decode-step matmul kernel against float64 numpy on random inputs (interpret mode on CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.skinny_matmul import MatmulConfig, default_config, skinny_matmul


def check(m: int, k: int, n: int, dtype, config: MatmulConfig | None, seed: int, rtol: float) -> None:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(m, k)).astype(np.float32)
    w = rng.normal(size=(k, n)).astype(np.float32)
    got = skinny_matmul(jnp.asarray(x, dtype), jnp.asarray(w, dtype), config=config)
    assert got.shape == (m, n) and got.dtype == dtype
    xq, wq = (np.asarray(jnp.asarray(a, dtype), np.float64) for a in (x, w))
    want = xq @ wq
    err = np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()
    assert err < rtol, err


@pytest.mark.parametrize(
    "m,k,n,config",
    [
        (1, 512, 256, MatmulConfig(block_n=64, block_k=64, splits=2)),
        (5, 1024, 384, MatmulConfig(block_n=128, block_k=128, splits=4)),
        (16, 256, 128, MatmulConfig(block_n=128, block_k=64, splits=1)),
        (33, 2048, 64, None),
    ],
)
def test_matches_float64_reference(m, k, n, config):
    check(m, k, n, jnp.float32, config, seed=m, rtol=1e-5)


def test_bfloat16():
    check(3, 4096, 128, jnp.bfloat16, MatmulConfig(block_n=128, block_k=256, splits=2), seed=7, rtol=1e-2)


def test_rejects_shapes_it_cannot_tile():
    x = jnp.ones((2, 96), jnp.float32)
    assert default_config(96, 100) is None
    with pytest.raises(ValueError, match="no tiling"):
        skinny_matmul(x, jnp.ones((96, 100), jnp.float32))
    with pytest.raises(ValueError, match="do not contract"):
        skinny_matmul(x, jnp.ones((64, 128), jnp.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (4096, 128256)])
def test_llama3_8b_projections_on_gpu(k, n):
    check(16, k, n, jnp.bfloat16, None, seed=k + n, rtol=1e-2)
