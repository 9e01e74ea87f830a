"""Ragged paged prefill attention as a Mosaic GPU (Hopper) kernel: the runner's attention contract
(`ragged_paged_attention.py`) on the tensor cores' wgmma, its pages fed by TMA.

The Triton kernel falls well short of cuDNN's prefill speed (docs/benchmarks.md), and Pallas's
Triton backend is deprecated. This kernel takes FlashAttention-3's shape: a work item is
`TILE_ROWS` query tokens of one sequence for one query head (two consumer warpgroups of 64 rows
each) and one producer warpgroup streams that head's keys and values through shared memory,
`stages` key blocks in flight. The kernel is persistent: one CTA per SM walks its share of the
(work item, head) pairs, and its producer runs on into the next pair's blocks while the consumers
finish the last, so a short sequence's few blocks do not each pay a CTA's start and its pipeline's
fill. The pairs are dealt by their key blocks, most first and in snake order (`deal`), so every CTA
streams about as many blocks as the others, and the work list's unused rows are dealt to none.
A key block is `block_k` keys: one TMA copy per page of the block table, all arriving on the
block's barrier, so any page size that divides the block works. Each
consumer multiplies its queries by the block's keys, runs the online softmax in registers (base 2,
the scale folded in), and multiplies the probabilities by the values through shared memory; it
then frees the slot for the producer. On a window's diagonal block the first consumer's rows see
only the block's first half (when a window starts at a block's start, as a prompt's do): it
multiplies by that half alone, a saving short prompts feel most, as their diagonal blocks are
a large share of their blocks. The queries come straight from the token-major `q` and the
output goes straight to its rows, so XLA moves no tile-major copies around the kernel. A TMA copy
into swizzled shared memory must start at a multiple of its 8-row tiling, and a sequence's tokens
start anywhere, so the work items are a sequence's share of windows of 128 tokens aligned to 8 in
the batch (`work_list(align=8)`: a sequence's first item is short by its start's remainder, and the
window's first rows are another sequence's): a consumer copies its 64 rows of the next pair's
window into the other of two query buffers as it starts a pair, and stores its output rows through
the bytes of the pair's queries: a window it owns whole in one copy from the swizzled buffer, part
of one unswizzled in TMA copies of 32, 16, ... 1 rows, as many as it owns (stores into unswizzled
rows conflict in the banks). Read from global memory through registers instead, the queries
stalled every pair's start (docs/benchmarks.md). The producer reads a block's page numbers before
it waits for the block's slot, so their reads' latency is not on the copies' path, and it gives up
registers to the consumers, which hold a block's scores, probabilities and accumulator at once.

Sequences with fewer than `DECODE_QUERIES` query tokens (decodes in a mixed batch) go to the Triton
kernel instead, in the same call, which writes their rows into this kernel's output: a tile here
would hold one row per query head for them, where the Triton kernel packs a GQA group's heads into
one program's rows.

Causal (a sequence's queries are its last tokens, as the runner lays them out), with a sliding
window (from the block of the tile's first key on, every block masked) and a soft-cap where the
model has them, over bf16 pages: `supported` says which calls it takes; the Triton kernel keeps the
rest. Interpret mode (`plgpu.InterpretGPUParams`) runs it on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import cdiv
from pallas_kernels.ragged_paged_attention import ALL_QUERIES, ragged_paged_attention, work_list

WG_ROWS = 64  # query rows per consumer warpgroup: a wgmma's M
CONSUMERS = 2
TILE_ROWS = CONSUMERS * WG_ROWS  # query tokens per work item
LOG2E = math.log2(math.e)
DECODE_QUERIES = 16  # sequences with fewer query tokens run the Triton kernel
ALIGN = 8  # rows of a tile of the swizzled shared memory: where a TMA copy into it may start
SHARED_BYTES = 227 * 1024  # a Hopper CTA's shared memory
NUM_CTAS = 132  # CTAs that walk the work, one per SM of an H100 or H200
# a CTA's 64k registers shared as FlashAttention-3 shares them: the consumers hold a block's scores,
# probabilities and accumulator at once, the producer only addresses (evenly, each thread has 168)
CONSUMER_REGISTERS, PRODUCER_REGISTERS = 232, 40
PROFILE_RANGES = 320  # a warpgroup's named ranges that `profile_dir` records: 16 pairs of 4 blocks
PROFILE_BYTES = (CONSUMERS + 1) * (4 * PROFILE_RANGES + 3) * 4  # the profiler's shared memory, every warpgroup's


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Keys per block (a multiple of 64 and of the page size) and key blocks in flight.
    `registers`: the probabilities stay in registers as P @ V's operand and the accumulator
    carries over from block to block (FlashAttention-3's form; Mosaic GPU's interpreter cannot run
    either, so only the GPU tests check it), where by default P goes through shared memory and each
    block's product lands in a fresh accumulator that registers add up. `pingpong`: the two
    consumers take turns at the tensor cores (FlashAttention-3's schedule: one's matmuls run while
    the other's softmax does)."""

    block_k: int = 64
    stages: int = 2
    registers: bool = False
    pingpong: bool = False


def supported(q: jax.Array, k_cache: jax.Array, config: MosaicConfig = MosaicConfig()) -> bool:
    """Whether `mosaic_prefill_attention` takes this call."""
    head_dim, block_size = q.shape[2], k_cache.shape[1]
    return (q.dtype == k_cache.dtype == jnp.bfloat16 and head_dim in (64, 128) and q.shape[0] >= WG_ROWS
            and q.shape[0] % ALIGN == 0
            and config.block_k % 64 == 0 and config.block_k % block_size == 0
            and q.shape[1] % k_cache.shape[2] == 0 and shared_bytes(head_dim, config) <= SHARED_BYTES)


def shared_bytes(head_dim: int, config: MosaicConfig) -> int:
    """A CTA's shared memory: two pairs' queries (this pair's, whose bytes then hold its output, and
    the next's as they arrive), the key and value blocks in flight, and the probabilities unless
    they stay in registers."""
    rows = CONSUMERS * WG_ROWS
    probabilities = 0 if config.registers else rows * config.block_k
    return 2 * (2 * rows * head_dim + 2 * config.stages * config.block_k * head_dim + probabilities)


def mosaic_prefill_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    query_start_loc: jax.Array,
    seq_lens: jax.Array,
    block_tables: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    interpret: bool = False,
    config: MosaicConfig = MosaicConfig(),
    decode_queries: int = DECODE_QUERIES,
    num_ctas: int = NUM_CTAS,
    profile_dir: str = "",
) -> jax.Array:
    """Causal attention for a packed ragged batch; [T, Hq, D] as `ragged_paged_attention` gives it
    (`interpret`: simulated on the CPU). Sequences with fewer than `decode_queries` query tokens
    (decodes, with or without drafts) go to the Triton kernel, which packs a GQA group's heads into
    one program's rows, where a tile here would hold one row per query head. `q` needs a
    warpgroup's rows at least (`supported`). `num_ctas`: the persistent CTAs (one per SM) that
    share the (work item, head) pairs (`deal`). `profile_dir`: Mosaic GPU's profiler writes there
    each warpgroup's timeline of the kernel's named phases (`benchmarks/attention.py --profile`),
    as many ranges as a CTA of 16 pairs of 4 key blocks has."""
    if not supported(q, k_cache, config):
        raise ValueError(f"mosaic_prefill_attention cannot run q {q.dtype}{q.shape} over pages "
                         f"{k_cache.dtype}{k_cache.shape} with {config}: see `supported`")
    if profile_dir and shared_bytes(q.shape[2], config) + PROFILE_BYTES > SHARED_BYTES:
        raise ValueError(f"Mosaic GPU's profiler needs {PROFILE_BYTES} bytes of shared memory beside {config}'s; "
                         "profile a form with fewer bytes in flight (registers=True, or fewer stages)")
    if interpret and config.registers:
        raise ValueError("MosaicConfig(registers=True) cannot run in interpret mode (Mosaic GPU's interpreter "
                         "has no register operands for wgmma); use registers=False off a GPU")
    args = (q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, num_seqs)
    options = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, interpret=interpret)
    # the rows of sequences with fewer queries are left unwritten here, and the Triton kernel's then
    work = work_list(query_start_loc, seq_lens, num_seqs, num_tokens=q.shape[0], block_q=TILE_ROWS,
                     queries=(decode_queries, ALL_QUERIES[1]), align=ALIGN)
    out = _kernel_call(work, q, k_cache, v_cache, block_tables.astype(jnp.int32), sm_scale, sliding_window, soft_cap,
                       config, interpret, num_ctas, profile_dir)
    if not decode_queries:
        return out
    return ragged_paged_attention(*args, **options, queries=(0, decode_queries), into=out)


def key_blocks(first, end, pos0, block_k: int, sliding_window: int | None) -> tuple:
    """A work item's key blocks [first_step, first_step + count): keys 0 .. its last query's position
    (none for an unused or padding row), from the block of its first query's first key under a
    window. On the work list's columns in XLA, on one row's scalars in the kernel."""
    steps = jnp.maximum(cdiv(pos0 + end - first, block_k), 0)
    if sliding_window is None:
        return 0, steps
    first_step = jnp.minimum(lax.div(jnp.maximum(pos0 - sliding_window + 1, 0), block_k), steps)
    return first_step, steps - first_step


def half_width(block_k: int) -> int:
    """The keys a diagonal block is narrowed to (`consumer_blocks`), 0 where blocks stay whole: half of
    a 64-key block would split the probabilities' 64-column tiles."""
    return block_k // 2 if block_k // 2 >= WG_ROWS else 0


def consumer_blocks(pos0, first, start, owned, first_step, count, block_k: int, sliding_window: int | None) -> tuple:
    """How a consumer walks its share of a work item's `count` key blocks: the first `whole` unmasked
    (every row it owns sees them whole), the rest masked, and of those the last `narrow` (0 or 1) at
    half width, its second half past every row the consumer owns (the first consumer's on a window's
    diagonal). `start`, `owned`: the rows it owns, [start, start + owned) of the item's tokens from
    `first` (at position `pos0`)."""
    whole = 0 if sliding_window is not None else jnp.clip(lax.div(pos0 + start - first + 1, block_k), 0, count)
    if not half_width(block_k):
        return whole, 0
    last_key = pos0 + start + owned - 1 - first
    return whole, jnp.where((count > whole) & (last_key < (first_step + count - 1) * block_k + half_width(block_k)), 1, 0)


def by_key_blocks(work: jax.Array, block_k: int, sliding_window: int | None) -> tuple[jax.Array, jax.Array]:
    """The work list with its items in order of key blocks, most first, then the padding row, then
    the unused rows; and the number of items before those (the used ones)."""
    _, count = key_blocks(work[:, 1], work[:, 2], work[:, 3], block_k, sliding_window)
    used = work[:, 2] > work[:, 1]  # the padding row has tokens (it writes their zeros) and no keys
    order = jnp.argsort(jnp.where(used, -count, 1), stable=True)
    return work[order], used.sum(dtype=jnp.int32)


def deal(cta, n, num_pairs, num_ctas: int):
    """The CTA's n-th pair (an index into the sorted pairs), and how many pairs it gets. Round n
    deals pairs [n * num_ctas, (n + 1) * num_ctas), to the CTAs in order in even rounds and in reverse
    in odd ones: as the pairs come with ever fewer key blocks, a CTA dealt a round's heaviest pair
    gets the next round's lightest."""
    def seat(round_):
        return jnp.where(round_ % 2 == 0, cta, num_ctas - 1 - cta)

    last = cdiv(num_pairs, num_ctas) - 1
    mine = last + jnp.where(seat(last) < num_pairs - last * num_ctas, 1, 0)
    return n * num_ctas + seat(n), mine


def _transforms(cols: int) -> tuple:
    """Shared-memory tiling and swizzle for bf16 rows of `cols` elements, as TMA writes and wgmma reads them."""
    swizzle = plgpu.find_swizzle(cols * 16, "mosaic_attention")
    return plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle)


def _kernel_call(work, q, k_cache, v_cache, block_tables, sm_scale: float, sliding_window: int | None,
                 soft_cap: float | None, config: MosaicConfig, interpret: bool, num_ctas: int,
                 profile_dir: str) -> jax.Array:
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    block_k, stages = config.block_k, config.stages
    pages = block_k // block_size
    max_pages = block_tables.shape[1]
    num_ctas = min(num_ctas, work.shape[0] * num_q_heads)
    exponent_scale = 1.0 if soft_cap is not None else sm_scale * LOG2E  # from the scores to base-2 exponents
    work, num_items = by_key_blocks(work, block_k, sliding_window)

    def kernel(work_gmem, items_gmem, q_gmem, k_gmem, v_gmem, table_gmem, out_gmem, scoped):
        ((q_smem, o_smem), k_smem, v_smem, p_smem), (q_bar, k_bar, v_bar), (k_free, v_free), turns = scoped
        cta, wg = lax.axis_index("cta"), lax.axis_index("wg")
        total_pairs = items_gmem[0] * num_q_heads  # the used (work item, head) pairs
        _, num_pairs = deal(cta, 0, total_pairs, num_ctas)  # this CTA's

        def pair(n):
            """This CTA's n-th pair: its head, sequence, tokens [first, end), first position, and its
            key blocks [first_step, first_step + count)."""
            p, _ = deal(cta, n, total_pairs, num_ctas)
            item, head = lax.div(p, num_q_heads), lax.rem(p, num_q_heads)
            seq, first, end, pos0 = (work_gmem[item, i] for i in range(4))
            return head, seq, first, end, pos0, *key_blocks(first, end, pos0, block_k, sliding_window)

        def take_turns():
            plgpu.barrier_arrive(turns)
            plgpu.barrier_wait(turns)

        def owned_rows(first, end):
            """The first token of this consumer's 64 rows of a work item's window (moved back to fit at
            the batch's end), and the tokens [start, start + owned) of the item's [first, end) it owns."""
            window = first - lax.rem(first, ALIGN) + wg * WG_ROWS
            start = jnp.maximum(first, window)
            # a multiple of 8, as the window is and `supported` makes T: a TMA copy into the tiles may start there
            rows = pl.multiple_of(jnp.minimum(window, num_tokens - WG_ROWS), ALIGN)
            return rows, start, jnp.clip(jnp.minimum(end, window + WG_ROWS) - start, 0, WG_ROWS)

        def fetch_queries(n):
            """Pair n's query rows into buffer n % 2."""
            head, _, first, end, *_ = pair(n)
            rows, _, _ = owned_rows(first, end)
            buf = lax.rem(n, 2)
            plgpu.copy_gmem_to_smem(q_gmem.at[pl.ds(rows, WG_ROWS), head], q_smem.at[buf, wg],
                                    q_bar.at[buf * CONSUMERS + wg])

        @pl.when(wg < CONSUMERS)
        def _consumer():
            plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")

            def consume(n, done):
                """Pair n, its blocks the `done + i`-th this CTA streams; the blocks streamed after it."""
                with jax.named_scope("pair"):
                    head, _, first, end, pos0, first_step, count = pair(n)
                    rows, start, owned = owned_rows(first, end)
                    buf = lax.rem(n, 2)
                with jax.named_scope("queries"):
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last pair's output has left the other buffer
                    pl.when(n + 1 < num_pairs)(lambda: fetch_queries(n + 1))
                    plgpu.barrier_wait(q_bar.at[buf * CONSUMERS + wg])

                def step(i, carry, masked: bool, width: int = block_k):
                    """Block i's first `width` keys (all of them but on a diagonal the first consumer's rows
                    stop at its first half)."""
                    acc, m_i, l_i = carry
                    j, slot = first_step + i, lax.rem(done + i, stages)
                    keys, values = k_smem.at[slot, pl.ds(0, width)], v_smem.at[slot, pl.ds(0, width)]

                    def softmax_done():  # then wait for the values, and with pingpong for the tensor cores
                        if config.pingpong:
                            plgpu.barrier_arrive(turns)
                        plgpu.barrier_wait(v_bar.at[slot])
                        if config.pingpong:
                            plgpu.barrier_wait(turns)

                    with jax.named_scope("keys_wait"):
                        plgpu.barrier_wait(k_bar.at[slot])

                    def scores(acc_ref):
                        plgpu.wgmma(acc_ref, q_smem.at[buf, wg], keys.T)
                        if config.pingpong:  # issued: the other consumer's turn
                            take_turns()
                        plgpu.wgmma_wait(0)
                        return acc_ref[...]

                    with jax.named_scope("scores"):
                        s = pl.run_scoped(scores, plgpu.ACC((WG_ROWS, width), jnp.float32))
                    plgpu.barrier_arrive(k_free.at[slot])
                    with jax.named_scope("masked_softmax" if masked else "softmax"):
                        if soft_cap is not None:  # in base-2 units already; else the scale joins the exponent's FMA
                            s = soft_cap * LOG2E * jnp.tanh(s * (sm_scale / soft_cap))
                        if masked:
                            row_pos, key = (plgpu.broadcasted_iota(jnp.int32, s.shape, d, layout=plgpu.Layout.WGMMA)
                                            for d in (0, 1))
                            row_pos, key = row_pos + (pos0 + rows - first), key + j * block_k
                            visible = key <= row_pos
                            if sliding_window is not None:
                                visible &= key > row_pos - sliding_window
                            s = jnp.where(visible, s, -jnp.inf)
                        m_new = jnp.maximum(m_i, s.max(axis=1) * exponent_scale)
                        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row with no key yet keeps zeros
                        p = jnp.exp2(s * exponent_scale - lax.broadcast_in_dim(shift, s.shape, [0]))
                        alpha = jnp.exp2(m_i - shift)
                        l_i = l_i * alpha + p.sum(axis=1)
                        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                    if config.registers:
                        p16 = p.astype(jnp.bfloat16)
                        softmax_done()

                        def carried(acc_ref):
                            plgpu.wgmma(acc_ref, p16, values)
                            plgpu.wgmma_wait(0)

                        with jax.named_scope("values"):
                            acc = pl.run_state(carried)(plgpu.ACC.init(acc))
                    else:
                        probabilities = p_smem.at[wg, :, pl.ds(0, width)]
                        probabilities[...] = p.astype(jnp.bfloat16)
                        plgpu.commit_smem()
                        softmax_done()

                        def product(acc_ref):
                            plgpu.wgmma(acc_ref, probabilities, values)
                            plgpu.wgmma_wait(0)
                            return acc_ref[...]

                        acc = acc + pl.run_scoped(product, plgpu.ACC((WG_ROWS, head_dim), jnp.float32))
                    plgpu.barrier_arrive(v_free.at[slot])
                    return acc, m_new, l_i

                rows_layout = plgpu.Layout.WGMMA.reduce(1)
                init = (plgpu.layout_cast(jnp.zeros((WG_ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA),
                        plgpu.layout_cast(jnp.full((WG_ROWS,), -jnp.inf, jnp.float32), rows_layout),
                        plgpu.layout_cast(jnp.zeros((WG_ROWS,), jnp.float32), rows_layout))
                whole, narrow = consumer_blocks(pos0, first, start, owned, first_step, count, block_k, sliding_window)
                if config.pingpong:
                    pl.when(wg == 1)(take_turns)  # the first consumer goes first
                carry = lax.fori_loop(0, whole, functools.partial(step, masked=False), init)
                carry = lax.fori_loop(whole, count - narrow, functools.partial(step, masked=True), carry)
                if half_width(block_k):
                    half = functools.partial(step, masked=True, width=half_width(block_k))
                    carry = lax.fori_loop(count - narrow, count, half, carry)
                acc, _, l_i = carry
                if config.pingpong:
                    pl.when(wg == 0)(take_turns)  # as many turns taken by each
                with jax.named_scope("output"):
                    l_i = jnp.where(l_i == 0.0, 1.0, l_i)  # padding rows: zeros
                    out = (acc / lax.broadcast_in_dim(l_i, acc.shape, [0])).astype(jnp.bfloat16)

                    @pl.when(owned == WG_ROWS)
                    def _():  # the whole window: through the queries' swizzled bytes, as one copy
                        q_smem[buf, wg] = out
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(q_smem.at[buf, wg], out_gmem.at[pl.ds(rows, WG_ROWS), head])

                    @pl.when(owned != WG_ROWS)
                    def _():  # part of it: unswizzled, in copies of 32, 16, ... 1 rows, which start anywhere
                        o_smem[buf, wg] = out
                        plgpu.commit_smem()
                        for size in (WG_ROWS >> b for b in range(1, WG_ROWS.bit_length())):
                            at = owned & -2 * size  # the rows the larger copies took

                            @pl.when(owned & size != 0)
                            def _():
                                plgpu.copy_smem_to_gmem(o_smem.at[buf, wg, pl.ds(start - rows + at, size)],
                                                        out_gmem.at[pl.ds(start + at, size), head])
                return done + count

            pl.when(num_pairs > 0)(lambda: fetch_queries(0))
            lax.fori_loop(0, num_pairs, consume, jnp.int32(0))
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        @pl.when(wg == CONSUMERS)
        def _producer():
            plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

            def produce(n, done):
                """Pair n's keys and values, block by block, as far ahead of the consumers as the slots allow."""
                head, seq, _, _, _, first_step, count = pair(n)
                kv_head = lax.div(head, group)

                def load(i, carry):
                    j, slot = first_step + i, lax.rem(done + i, stages)
                    pages_of_block = [jnp.clip(table_gmem[seq, jnp.minimum(j * pages + p, max_pages - 1)], 0, num_blocks - 1)
                                      for p in range(pages)]  # read while the slot is still in use

                    @pl.when(done + i >= stages)  # the consumers are done with the block this slot held
                    @jax.named_scope("slot_wait")
                    def _():
                        plgpu.barrier_wait(k_free.at[slot])
                        plgpu.barrier_wait(v_free.at[slot])

                    with jax.named_scope("copies"):
                        for p, page in enumerate(pages_of_block):
                            dst = pl.ds(p * block_size, block_size)
                            plgpu.copy_gmem_to_smem(k_gmem.at[page, :, kv_head], k_smem.at[slot, dst], k_bar.at[slot])
                            plgpu.copy_gmem_to_smem(v_gmem.at[page, :, kv_head], v_smem.at[slot, dst], v_bar.at[slot])
                    return carry

                lax.fori_loop(0, count, load, None)
                return done + count

            streamed = lax.fori_loop(0, num_pairs, produce, jnp.int32(0))

            @pl.loop(jnp.maximum(streamed - stages, 0), streamed)
            def _(i):  # the last blocks' releases: every barrier phase observed before the kernel ends
                plgpu.barrier_wait(k_free.at[lax.rem(i, stages)])
                plgpu.barrier_wait(v_free.at[lax.rem(i, stages)])

    def entry(work_gmem, items_gmem, q_gmem, k_gmem, v_gmem, table_gmem, out_gmem):
        tiled = _transforms(head_dim)
        # a consumer's output rows take its queries' bytes: both members have one shape, consumer first,
        # and a consumer writes its output after its last product read its queries
        queries_then_output = plgpu.RefUnion(plgpu.SMEM((2, CONSUMERS, WG_ROWS, head_dim), jnp.bfloat16, transforms=tiled),
                                             plgpu.SMEM((2, CONSUMERS, WG_ROWS, head_dim), jnp.bfloat16))
        pl.run_scoped(
            lambda *scoped: kernel(work_gmem, items_gmem, q_gmem, k_gmem, v_gmem, table_gmem, out_gmem, scoped),
            (queries_then_output,
             plgpu.SMEM((stages, block_k, head_dim), jnp.bfloat16, transforms=tiled),
             plgpu.SMEM((stages, block_k, head_dim), jnp.bfloat16, transforms=tiled),
             () if config.registers else  # the probabilities' round trip through shared memory
             plgpu.SMEM((CONSUMERS, WG_ROWS, block_k), jnp.bfloat16, transforms=_transforms(block_k))),
            (plgpu.Barrier(num_barriers=2 * CONSUMERS),
             plgpu.Barrier(num_arrivals=pages, num_barriers=stages),
             plgpu.Barrier(num_arrivals=pages, num_barriers=stages)),
            (plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),) * 2,
            plgpu.Barrier(num_arrivals=CONSUMERS),
            collective_axes="wg",
        )

    return plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct(q.shape, jnp.bfloat16),
        grid=(num_ctas,),
        grid_names=("cta",),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, profile_space=PROFILE_RANGES if profile_dir else 0,
                                             profile_dir=profile_dir, profile_bounds_check=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(work, num_items[None], q, k_cache, v_cache, block_tables)
