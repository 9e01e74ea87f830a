"""The fp8 KV cache (`kv_cache_dtype="fp8"`): e4m3 pages written through the scales, read back by the
kernels; the model's logits within fp8's error of Hugging Face's."""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from driver import prompt_logits
from kernel_batches import make_batch

from jaxrunner import LLM, Runner, RunnerConfig, SamplingParams
from jaxrunner.checkpoints.loader import load_model
from jaxrunner.platform import H200
from jaxrunner.runner.memory import kv_cache_bytes
from pallas_kernels import (
    FP8,
    ragged_paged_attention,
    ragged_paged_attention_decode,
    reference_ragged_paged_attention,
    write_kv,
)

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize("entry", ["ragged", "decode"])
def test_kernels_read_fp8_pages(entry):
    """The Pallas kernels (interpreted) on fp8 caches equal the reference on the same pages widened
    to float32: the kernel widens each page as it reads it."""
    kernel = {"ragged": ragged_paged_attention, "decode": functools.partial(ragged_paged_attention_decode, num_sms=132)}[entry]
    static = dict(sm_scale=1 / math.sqrt(64), sliding_window=30, soft_cap=None)
    for seed in range(2):
        batch = make_batch(seed, dtype=jnp.bfloat16, head_dim=64, block_size=16, num_kv_heads=2, group=4, max_blocks=8)
        k8, v8 = batch.k_cache.astype(FP8), batch.v_cache.astype(FP8)
        args = (batch.q, k8, v8, *batch.args[3:])
        out = jax.jit(functools.partial(kernel, interpret=True, **static))(*args)
        want = reference_ragged_paged_attention(batch.q, k8.astype(jnp.float32), v8.astype(jnp.float32), *batch.args[3:], **static)
        total = batch.total
        assert out.dtype == jnp.bfloat16 and not np.isnan(np.asarray(out[:total], np.float32)).any()
        np.testing.assert_allclose(np.asarray(out[:total], np.float32), np.asarray(want[:total], np.float32), atol=3e-2, rtol=3e-2)


def test_fp8_kernels_lower_to_triton_for_h200():
    """Attention and the KV write on fp8 pages (Triton's lowering cannot cast an int fill value to fp8)."""
    sds = jax.ShapeDtypeStruct
    cache = sds((99, 16, 2, 128), FP8)
    args = (sds((64, 8, 128), jnp.bfloat16), cache, cache, sds((9,), jnp.int32), sds((8,), jnp.int32),
            sds((8, 16), jnp.int32), sds((), jnp.int32))
    kv = sds((64, 2, 128), jnp.bfloat16)
    fns = [(functools.partial(fn, sm_scale=0.1), args)
           for fn in (ragged_paged_attention, functools.partial(ragged_paged_attention_decode, num_sms=132))]
    fns.append((write_kv, (cache, cache, kv, kv, sds((64,), jnp.int32))))
    for fn, fn_args in fns:
        with jax.sharding.use_abstract_mesh(H200):
            text = jax.jit(fn).trace(*fn_args).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma2"])
def test_logits_within_fp8_error_of_hf(name):
    """Chunked prefill over fp8 pages: the logits stay within fp8's error (e4m3 keeps 3 mantissa
    bits) of HF's fp32 ones, and differ from the exact cache's, so the fp8 path ran."""
    cfg, params = load_model(DATA / "models" / name, "float32")
    golden = np.load(DATA / "goldens" / f"{name}.npz")
    prompt, ref = golden["prompt_3"].tolist(), golden["logits_3"]
    exact = prompt_logits(cfg, params, prompt, 7)
    fp8 = prompt_logits(cfg, params, prompt, 7, kv_cache_dtype="fp8")
    rel = np.linalg.norm(fp8 - ref) / np.linalg.norm(ref)
    assert 1e-3 < rel < 0.1, rel
    assert np.linalg.norm(exact - ref) / np.linalg.norm(ref) < 1e-4


def test_scales_divide_on_write_and_multiply_on_read():
    """Scales 16 and 1/4 leave the logits within fp8's error; a K scale far too small saturates the
    pages at fp8's +-448, and the logits fall apart: the scales are applied, not ignored."""
    cfg, params = load_model(DATA / "models" / "tiny-qwen3", "float32")
    golden = np.load(DATA / "goldens" / "tiny-qwen3.npz")
    prompt, ref = golden["prompt_3"].tolist(), golden["logits_3"]

    def rel(scales):
        ours = prompt_logits(cfg, params, prompt, 16, kv_cache_dtype="fp8", kv_scales=scales)
        return np.linalg.norm(ours - ref) / np.linalg.norm(ref)

    unit, scaled = rel((1.0, 1.0)), rel((16.0, 0.25))
    assert unit < 0.1 and scaled < 0.1 and unit != scaled
    assert rel((1e-3, 1.0)) > 0.3


CONFIG = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=128, max_model_len=128, block_size=8, num_blocks=96)


def test_fp8_cache_holds_twice_the_blocks_and_generates():
    cfg, params = load_model(DATA / "models" / "tiny-llama", "float32")
    bf16 = dataclasses.replace(CONFIG, dtype="bfloat16")
    assert kv_cache_bytes(cfg, dataclasses.replace(bf16, kv_cache_dtype="fp8")) * 2 == kv_cache_bytes(cfg, bf16)
    runner = Runner(cfg, params, dataclasses.replace(CONFIG, kv_cache_dtype="fp8"))
    assert all(k.dtype == FP8 and v.dtype == FP8 for k, v in runner.init_state().kv)
    with LLM(str(DATA / "models" / "tiny-llama"), skip_tokenizer_init=True, dtype="float32", max_model_len=128,
             kv_cache_dtype="fp8") as llm:
        out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, temperature=0.0))[0]
        assert len(out.outputs[0].token_ids) == 8


def test_bad_kv_cache_settings_are_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8"):
        RunnerConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_scales must be two positive finite numbers"):
        RunnerConfig(kv_cache_dtype="fp8", kv_scales=(1.0, 0.0))
