"""The Mosaic GPU prefill attention (`pallas_kernels/mosaic_attention.py`) against the jnp reference
on fresh random ragged batches: simulated on the CPU (Mosaic GPU's interpret mode), lowered for
Hopper at Llama-3-8B's heads, and compiled on the H200 (`-m gpu`)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrunner import Runner, RunnerConfig
from jaxrunner.checkpoints.dummy import random_params, shape
from jaxrunner.models import attention
from jaxrunner.platform import H200
from pallas_kernels import MosaicConfig, mosaic_prefill_attention, reference_ragged_paged_attention
from pallas_kernels.mosaic_attention import ALIGN, by_key_blocks, consumer_blocks, deal, key_blocks, supported
from pallas_kernels.ragged_paged_attention import work_list
from tests.driver import drive


def ragged_batch(rng, q_lens, contexts, *, heads=(4, 2), head_dim=64, block_size=16):
    """A packed batch: sequence s's last q_lens[s] of contexts[s] tokens, pages shuffled over the pool;
    padding tokens up to a multiple of 8, as the runner's token buckets are."""
    num_q_heads, num_kv_heads = heads
    pages = [-(-c // block_size) for c in contexts]
    num_blocks = sum(pages) + 3
    order = rng.permutation(num_blocks)
    tables = np.zeros((len(contexts), max(pages) + 2), np.int32)  # unused entries: page 0
    used = 0
    for s, n in enumerate(pages):
        tables[s, :n] = order[used : used + n]
        used += n
    tokens = -(-(sum(q_lens) + 1) // 8) * 8
    q = jnp.asarray(rng.standard_normal((tokens, num_q_heads, head_dim)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((num_blocks, block_size, num_kv_heads, head_dim)), jnp.bfloat16)
            for _ in range(2))
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    return q, k, v, qsl, jnp.asarray(contexts, jnp.int32), jnp.asarray(tables), jnp.int32(len(contexts))


@pytest.mark.parametrize("block_k, head_dim, block_size, heads, decode_queries, pingpong, window, cap, ctas, seed", [
    (64, 64, 16, (4, 2), 16, False, None, None, 3, 0),
    (128, 64, 32, (4, 1), 0, False, None, None, 132, 1),
    (64, 128, 64, (2, 2), 16, False, None, None, 5, 2),
    # the consumers taking turns; not beside the decodes' Triton kernel: interpreted together they can
    # starve each other of the interpreter's threads
    (64, 64, 16, (4, 2), 0, True, None, None, 2, 3),
    (64, 64, 16, (4, 2), 16, False, 40, 20.0, 7, 4),  # Gemma 2's sliding window and soft-cap
])
def test_matches_the_reference_interpreted(block_k, head_dim, block_size, heads, decode_queries, pingpong, window, cap,
                                           ctas, seed):
    """A prefill chunk behind a cached prefix, a decode (the Triton kernel's with `decode_queries`,
    else a tile here), a whole prompt over two tiles, and padding tokens (zeros), at page sizes
    below, at and inside a key block; a few persistent CTAs walking many pairs each (and one per
    pair)."""
    rng = np.random.default_rng(seed)
    args = ragged_batch(rng, [70, 1, 150], [90, 37, 150], heads=heads, head_dim=head_dim, block_size=block_size)
    options = dict(sm_scale=1 / np.sqrt(head_dim), sliding_window=window, soft_cap=cap)
    config = MosaicConfig(block_k=block_k, pingpong=pingpong)
    got = jax.jit(functools.partial(mosaic_prefill_attention, **options, interpret=True, config=config,
                                    decode_queries=decode_queries, num_ctas=ctas))(*args)
    want = reference_ragged_paged_attention(*args, **options)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2)
    assert not np.asarray(got, np.float32)[221:].any()  # the padding tokens


def test_work_items_fit_windows_aligned_to_8():
    """Each item's tokens lie in one window of 128 starting at a multiple of 8, the items cover every
    token once (the padding's too), and each starts at its token's position."""
    rng = np.random.default_rng(7)
    q_lens = rng.integers(1, 300, 9)
    contexts = q_lens + rng.integers(0, 500, 9)
    tokens = -(-(q_lens.sum() + 1) // 8) * 8
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    work = np.asarray(work_list(jnp.asarray(qsl, jnp.int32), jnp.asarray(contexts, jnp.int32), jnp.int32(9),
                                num_tokens=int(tokens), block_q=128, align=ALIGN))
    seq, first, end, pos0 = work[work[:, 2] > work[:, 1]].T
    assert np.all(end <= first - first % ALIGN + 128)
    assert sorted(t for a, b in zip(first, end) for t in range(a, b)) == list(range(tokens))
    real = first < qsl[-1]
    np.testing.assert_array_equal(pos0[real], (contexts - q_lens)[seq[real]] + first[real] - qsl[seq[real]])


@pytest.mark.parametrize("num_pairs, num_ctas", [(2048, 132), (131, 132), (133, 132), (7, 3), (0, 5)])
def test_every_pair_is_dealt_once(num_pairs, num_ctas):
    dealt = [int(deal(cta, n, num_pairs, num_ctas)[0]) for cta in range(num_ctas)
             for n in range(int(deal(cta, 0, num_pairs, num_ctas)[1]))]
    assert sorted(dealt) == list(range(num_pairs))


@pytest.mark.parametrize("prefix", [0, 64])
def test_a_prompts_first_consumer_takes_its_diagonal_block_at_half_width(prefix):
    """A 512-token prompt's four windows at 128-key blocks. Alone, each window starts at a block's
    start: the first consumer's 64 rows end in the diagonal block's first half, which it takes at
    half width, and the second consumer's rows reach into its second half. Behind a cached prefix
    of 64 tokens both consumers' rows end in the first half of their last block (the first
    consumer's see none of it). With 64-key blocks nothing is narrowed."""
    tiles = 128
    qsl, lens = jnp.asarray([0, 512], jnp.int32), jnp.asarray([prefix + 512], jnp.int32)
    work = work_list(qsl, lens, jnp.int32(1), num_tokens=520, block_q=tiles, align=ALIGN)[:4]
    for block_k, halves in [(128, [1, 0] if prefix == 0 else [1, 1]), (64, [0, 0])]:
        for seq, first, end, pos0 in np.asarray(work):
            first_step, count = key_blocks(first, end, pos0, block_k, None)
            for consumer in range(2):
                start = first + consumer * 64
                whole, narrow = consumer_blocks(pos0, first, start, 64, first_step, count, block_k, None)
                assert int(narrow) == halves[consumer]
                # unmasked: the blocks that end at or before its first row
                assert int(whole) * block_k - 1 <= pos0 + start - first < (int(whole) + 1) * block_k - 1


@pytest.mark.parametrize("num_seqs, seq_len", [(1, 8192), (16, 512), (5, 1000)])
def test_each_cta_gets_about_as_many_key_blocks(num_seqs, seq_len):
    """The benchmark's cases at 32 heads, 128-row tiles and 128-key blocks over an H100's 132 SMs: the
    busiest CTA streams within 5% of the mean (dealt in the work list's order, round-robin, the
    busiest of 16 x 512 streamed 1.4x the mean), and the unused rows of the list are dealt to none."""
    heads, tiles, ctas = 32, 128, 132
    qsl = jnp.arange(num_seqs + 1, dtype=jnp.int32) * seq_len
    lens = jnp.full((num_seqs,), seq_len, jnp.int32)
    work, num_items = by_key_blocks(work_list(qsl, lens, jnp.int32(num_seqs), num_tokens=num_seqs * seq_len + 8,
                                              block_q=tiles, align=ALIGN), 128, None)
    assert int(num_items) == num_seqs * -(-seq_len // tiles) + 1  # and the padding tokens' row
    _, blocks = key_blocks(work[:, 1], work[:, 2], work[:, 3], 128, None)
    per_pair = np.repeat(np.asarray(blocks), heads)
    streamed = [sum(per_pair[int(deal(cta, n, int(num_items) * heads, ctas)[0])]
                    for n in range(int(deal(cta, 0, int(num_items) * heads, ctas)[1]))) for cta in range(ctas)]
    assert max(streamed) <= 1.05 * per_pair.sum() / ctas


def test_takes_only_what_it_supports():
    q = jnp.zeros((64, 4, 128), jnp.bfloat16)
    pages = jnp.zeros((4, 16, 2, 128), jnp.bfloat16)
    assert supported(q, pages)
    assert not supported(q[:63], pages)  # fewer tokens than a warpgroup reads
    assert not supported(jnp.zeros((68, 4, 128), jnp.bfloat16), pages)  # a last window would not start at a multiple of 8
    assert not supported(q, pages.astype(jnp.float8_e4m3fn))  # fp8 pages: the Triton kernel's
    assert not supported(q, pages, MosaicConfig(block_k=48))
    # two blocks of 128 keys in flight fit, three do not
    assert supported(q, pages, MosaicConfig(block_k=128, stages=2, registers=True))
    assert not supported(q, pages, MosaicConfig(block_k=128, stages=3, registers=True))
    assert not supported(q, pages, MosaicConfig(block_k=128, stages=3))
    # D = 256: the Triton kernel's (the queries' two buffers and two blocks of 64 keys would overflow shared memory)
    wide = jnp.zeros((64, 4, 256), jnp.bfloat16), jnp.zeros((4, 16, 2, 256), jnp.bfloat16)
    assert not supported(*wide) and not supported(*wide, MosaicConfig(registers=True))
    with pytest.raises(ValueError, match=r"registers=True\) cannot run in interpret mode"):
        mosaic_prefill_attention(q, pages, pages, jnp.zeros(2, jnp.int32), jnp.zeros(1, jnp.int32),
                                 jnp.zeros((1, 2), jnp.int32), jnp.int32(1), sm_scale=1.0, interpret=True,
                                 config=MosaicConfig(registers=True))
    with pytest.raises(ValueError, match="profiler needs .* bytes of shared memory"):  # 224 KiB in flight already
        mosaic_prefill_attention(q, pages, pages, jnp.zeros(2, jnp.int32), jnp.zeros(1, jnp.int32),
                                 jnp.zeros((1, 2), jnp.int32), jnp.int32(1), sm_scale=1.0,
                                 config=MosaicConfig(block_k=128), profile_dir="/tmp/unused")
    with pytest.raises(ValueError, match="mosaic_prefill_attention cannot run q bfloat16"):
        mosaic_prefill_attention(q, pages, pages, jnp.zeros(2, jnp.int32), jnp.zeros(1, jnp.int32),
                                 jnp.zeros((1, 2), jnp.int32), jnp.int32(1), sm_scale=1.0,
                                 config=MosaicConfig(block_k=32))


def test_the_runner_attends_through_it_with_kernels_mosaic(monkeypatch):
    """kernels="mosaic": chunked prefills beside decodes run the Mosaic kernel (the decode form keeps
    the Triton decode kernel) and give the tokens the Triton kernel gives, in bf16 on random weights
    with 64-wide heads."""
    traced = []

    def counted(*args, **kwargs):
        traced.append(args[0].shape)
        return mosaic_prefill_attention(*args, **kwargs)

    monkeypatch.setattr(attention, "mosaic_prefill_attention", counted)
    model = dataclasses.replace(shape("tiny"), head_dim=64)
    params = random_params(model, "bfloat16", 3)
    config = RunnerConfig(max_num_seqs=4, max_num_batched_tokens=128, max_model_len=192, num_blocks=64,
                          dtype="bfloat16", token_buckets=(128,), request_buckets=(4,))
    rng = np.random.default_rng(4)
    prompts = [rng.integers(1, 500, n).tolist() for n in (90, 30, 61)]
    tokens = {kernels: drive(Runner(model, params, dataclasses.replace(config, kernels=kernels)), prompts, 5,
                             chunk=40, stagger=1)
              for kernels in ("mosaic", "pallas")}
    assert traced and all(shape == (128, 4, 64) for shape in traced)  # the general forward's one bucket
    assert tokens["mosaic"] == tokens["pallas"]


@pytest.mark.parametrize("num_seqs, seq_len, block_k, stages, registers, window, cap", [
    (1, 8192, 64, 2, False, None, None), (16, 512, 128, 2, False, None, None), (1, 8192, 64, 2, True, None, None),
    (16, 512, 128, 2, True, None, None),  # the runner's form, its first consumers' diagonal blocks at half width
    (16, 512, 64, 3, True, None, None), (1, 8192, 64, 2, True, 4096, 30.0)])
@pytest.mark.parametrize("pingpong", [False, True])
def test_lowers_for_hopper_at_llama3_8b_heads(num_seqs, seq_len, block_k, stages, registers, window, cap, pingpong):
    """The benchmark's cases (`benchmarks/attention.py`): 32 query heads, 8 KV heads, D = 128, page 16;
    FlashAttention-3's register form too, which only lowering checks off a GPU; a window and a soft-cap."""
    tokens, pages = num_seqs * seq_len, num_seqs * seq_len // 16
    args = (jax.ShapeDtypeStruct((tokens, 32, 128), jnp.bfloat16),
            *[jax.ShapeDtypeStruct((pages, 16, 8, 128), jnp.bfloat16)] * 2,
            jax.ShapeDtypeStruct((num_seqs + 1,), jnp.int32), jax.ShapeDtypeStruct((num_seqs,), jnp.int32),
            jax.ShapeDtypeStruct((num_seqs, seq_len // 16), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))
    f = functools.partial(mosaic_prefill_attention, sm_scale=0.088, sliding_window=window, soft_cap=cap,
                          config=MosaicConfig(block_k=block_k, stages=stages, registers=registers, pingpong=pingpong))
    with jax.sharding.use_abstract_mesh(H200):  # the decodes' Triton kernel lowers for a GPU it is told of
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "__gpu$xla.gpu.triton" in text


@pytest.mark.gpu
@pytest.mark.parametrize("block_k, stages, registers, pingpong, window, cap", [
    (64, 2, False, False, None, None), (128, 2, False, False, None, None), (64, 3, False, False, None, None),
    (64, 2, True, False, None, None), (128, 2, True, False, None, None), (64, 3, True, False, None, None),
    (64, 2, False, True, None, None),
    (64, 2, True, True, None, None), (64, 2, True, True, 512, 30.0),
])
def test_compiled_on_the_gpu_matches_the_reference(block_k, stages, registers, pingpong, window, cap):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    rng = np.random.default_rng(block_k + stages)
    args = ragged_batch(rng, [700, 1, 1000, 37], [1200, 300, 1000, 37], heads=(32, 8), head_dim=128)
    options = dict(sm_scale=0.088, sliding_window=window, soft_cap=cap)
    got = jax.jit(functools.partial(mosaic_prefill_attention, **options,
                                    config=MosaicConfig(block_k, stages, registers, pingpong)))(*args)
    want = reference_ragged_paged_attention(*args, **options)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2)


def test_the_runner_takes_the_sweeps_fastest_form_on_a_gpu():
    """Blocks of 128 keys with P in registers on a GPU (docs/benchmarks.md's sweep); interpreted, the
    form the interpreter runs."""
    q, pages = jax.ShapeDtypeStruct((256, 32, 128), jnp.bfloat16), jax.ShapeDtypeStruct((64, 16, 8, 128), jnp.bfloat16)
    assert attention.mosaic_config(q, pages, interpret=False) == MosaicConfig(block_k=128, registers=True)
    assert attention.mosaic_config(q, pages, interpret=True) == MosaicConfig()
