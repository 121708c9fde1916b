"""Tree-verify attention on Hopper in Mosaic GPU (wgmma, TMA, warp specialisation): `ops.tree_verify_attention`'s
kernel where its 64-row tile fits the call (`fits`: K2.x latent widths, bf16, at least 64 query rows per stream,
whole 64-row cache blocks); the Triton kernel (`tree_verify_attention_triton`) takes the other calls. Measured on the
H200: experiments/notes/kernels.md, "The Mosaic GPU whole op on the H200" and "Eighth session".

For stream s and query row r = (node t, head h), over the cache rows j < prefix_len[s] + T (the committed prefix,
then the tree block's own rows):

  logits[j] = scale * (q_lat[r] . c_kv[j] + q_rope[r] . k_rope[j]) + bias[r, j];  out[r] = softmax(logits) @ c_kv

where bias is 0 for the prefix and for the tree rows node t sees (`visible`), -inf elsewhere. Blocks of cache rows
wholly inside the prefix take no bias; the few blocks from the one holding the prefix's end to the tree's last row
(the "frame", `frame_width` columns) take theirs from `frame_bias` (one f32 tile per block, loaded from global
memory in the wgmma layout), so the tree block is attended in the same kernel as the prefix. With num_splits > 1
each split writes a partial (out normalised within the split in bf16, the running max and sum in f32, by TMA) that
`tree_verify_attention_combine.merge` joins (one Triton kernel; in interpret mode XLA's `combine_partials`); with one
split the kernel's output is the op's. Opt-in (`combine_in_kernel`, GPU only) the programs join their tile's partials
themselves: each signals a semaphore of the tile, waits for all the tile's splits, and takes its share of the tile in
units of R rows x 128 columns (`_combine_units`), staged by TMA in the shared memory the main loop no longer uses. On
the H200 that is level with the separate combine kernel or slower (kernels.md, "Twenty-fifth session").

With `multicast_tiles` = C (GPU only; `default_multicast_tiles` takes 2 for streams of two query tiles over long
splits) the programs of C adjacent query tiles of a split run as one cluster that loads each cache block once for all
by TMA multicast (1-4% faster there on the H200, slower elsewhere: kernels.md, "Thirtieth session").

One program = one 64-row query tile of one stream and one split of its cache rows, three warpgroups. Warpgroup 2
streams c_kv (as two 256-column halves) and k_rope blocks through two shared-memory slots with TMA. Warpgroups 0 and
1 each own 256 of the 512 output columns (a [64, 256] f32 accumulator in registers) and take the blocks in pairs, as
FlashMLA does: blocks 2j and 2j + 1 (slots 0 and 1) are scored at once, warpgroup w scoring the block in slot w
([64, 64] scores by wgmma over 256 + 256 + 64 columns). Warpgroup 0 publishes its block's row max; warpgroup 1 takes
it into its own, so its p is final, and publishes p (bf16, over its slot's rope rows, which only the scores read)
with the pair's max; each multiplies its own p by its half of its own block's values from registers while the other
is busy, then warpgroup 0 publishes its p rescaled to the pair's max, and each adds the other's block from shared
memory. A slot is refilled in two parts, each as soon as its last reader is done. Against the earlier schedule (the
blocks scored in turn while the other warpgroup waited for p) this is 11-24% faster where the tensor cores bound the
call and level at decode (kernels.md, "Twenty-second session"). The online softmax runs in base 2 with approximate math
(p = exp2(qk * scale * log2(e) - max): one fused multiply-add and one ex2 per score); the partials' max is written in
base e.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import inverse_or_zero
from pallas_kernels import tree_verify_attention as op
from pallas_kernels import tree_verify_attention_combine as combine
from pallas_kernels.triton_call import bound_to

BLOCK_Q = 64     # query rows per program: one wgmma M tile
BLOCK_KV = 64    # cache rows per slot (= ROPE: p [BLOCK_Q, BLOCK_KV] takes the place of the slot's rope rows)
HALF = 256       # output (latent) columns per consumer warpgroup
ROPE = 64        # rope width of a K2.x latent row
COMPUTE_WGS = 2
SLOTS = COMPUTE_WGS   # shared-memory slots: the pair of blocks in flight, one per consumer (the schedule needs 2)
# Registers per thread of a consumer / the producer warpgroup (65536 per SM over 3 x 128 threads; JAX's attention_mgpu
# example's split). FlashAttention-3 uses 240 / 24: kernels.md, "Ninth session".
REGISTERS = (232, 40)
COMBINE_UNROLL = 8   # splits per loop step of `_combine_units`' sums over shared memory
QUARTER = 128        # columns of a unit of the in-kernel combine (a quarter of a row)
QUARTERS = 2 * HALF // QUARTER
STAT_ROWS = 8        # rows of the statistics a unit of the in-kernel combine loads, at least
MAX_UNIT_ROWS = 16   # rows of a unit of the in-kernel combine, at most
MAX_STAGED_ROWS = 160   # quarter rows of partials a unit of the in-kernel combine stages (40 KB), at most
# Split-K limits of `default_num_splits` (the Triton kernel's: 2 blocks a split, partials within the call's floor
# bytes): one block a split and partials up to twice the floor, so that a single query tile over a short prefix spreads
# over more multiprocessors (H=64 N=4096 T=1 on the H200: 65 splits against 32, kernel 10.8 -> 7.5 us, combine 2.9 ->
# 3.9; kernels.md, "Twenty-sixth session").
MIN_BLOCKS_PER_SPLIT = 1
PARTIAL_BUDGET = 2.0
REFILL_ORDER = ((0, 0), (1, 0), (0, 1), (1, 1))   # (slot, part) in the order the producer refills them
ROW_LAYOUT = plgpu.Layout.WGMMA.reduce(1)   # a [BLOCK_Q] row statistic as the wgmma accumulator holds it
LOG2E, LN2 = math.log2(math.e), math.log(2.0)   # the consumers' running max is in base 2; the partials' max in base e
# Query tiles of one split whose programs form a cluster that loads each cache block once, by TMA multicast
# (`multicast_tiles`); TILE_AXIS is a program's place in its cluster.
MULTICAST_SIZES = (1, 2, 4)
TILE_AXIS = "tile"
# `default_multicast_tiles`: clusters of 2 where a stream has exactly 2 query tiles and its splits at least this many
# cache blocks each (H200, back to back: 1-4% faster from 4 blocks a split, 5% slower at 1-2; kernels.md,
# "Thirtieth session").
MULTICAST_MIN_BLOCKS = 4


def _smem_transforms():
    return plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)


def _scratch(combine_splits: int = 0, multicast_tiles: int = 1) -> tuple:
    """The kernel's scratch: first the main loop's operands (the q tile's two latent halves and its rope, the two
    slots' c_kv halves and k_rope blocks), then the row statistics, the consumers' exchanged statistics (warpgroup
    w's max at [w, 0], its final row sum at [w, 1]), the barriers (q, c_kv halves, k_rope, free per part of a slot,
    sync, and the pair's three hand-overs), then each consumer's slot index. With combine_splits = P > 0 (the
    in-kernel combine) the main loop's operands share their memory with `_combine_stage`'s buffers, used after it,
    and a barrier per consumer for the combine's loads comes last. With multicast_tiles = C > 1 the slots' free
    barriers are the cluster's: a part of a slot is refilled (in all C programs at once) when every program's
    consumer has released it."""
    transforms = _smem_transforms()
    operands = (plgpu.SMEM((2, BLOCK_Q, HALF), jnp.bfloat16, transforms=transforms),
                plgpu.SMEM((BLOCK_Q, ROPE), jnp.bfloat16, transforms=transforms),
                plgpu.SMEM((SLOTS, 2, BLOCK_KV, HALF), jnp.bfloat16, transforms=transforms),
                plgpu.SMEM((SLOTS, BLOCK_KV, ROPE), jnp.bfloat16, transforms=transforms))
    return (plgpu.RefUnion(operands, _combine_stage(combine_splits)) if combine_splits else operands,
            plgpu.SMEM((2, BLOCK_Q), jnp.float32),
            plgpu.SMEM((COMPUTE_WGS, 2, BLOCK_Q), jnp.float32),
            plgpu.Barrier(num_barriers=3),
            plgpu.Barrier(num_barriers=2 * SLOTS),
            plgpu.Barrier(num_barriers=SLOTS),
            (plgpu.ClusterBarrier(collective_axes=(TILE_AXIS,), num_barriers=2 * SLOTS) if multicast_tiles > 1
             else plgpu.Barrier(num_barriers=2 * SLOTS)),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS),
            plgpu.Barrier(num_barriers=3),
            # Each consumer's slot, read back every pair: a slot fixed at compile time makes the wgmma descriptors of
            # its blocks (and of the q halves) loop-invariant, which LLVM hoists out of the loop into registers that
            # ptxas then spills (kernels.md, "Twenty-second session").
            plgpu.SMEM((COMPUTE_WGS,), jnp.int32)) + (
        # Under the in-kernel combine each consumer's barrier for its three TMA loads of a unit (`_combine_units`).
        (plgpu.Barrier(num_arrivals=3, num_barriers=COMPUTE_WGS),) if combine_splits else ())


def _combine_stage(num_splits: int) -> tuple:
    """The in-kernel combine's buffers, one per consumer warpgroup (`_combine_units`): a unit's partials
    [staged_splits(P), R, QUARTER] bf16, then its row group's max, sum and its row's weights [stat_splits(P), G] f32
    each (R = unit_rows(P) rows, G = max(STAT_ROWS, R))."""
    rows = unit_rows(num_splits)
    stats = (COMPUTE_WGS, stat_splits(num_splits), max(STAT_ROWS, rows))
    return (plgpu.SMEM((COMPUTE_WGS, staged_splits(num_splits), rows, QUARTER), jnp.bfloat16),
            *(plgpu.SMEM(stats, jnp.float32) for _ in range(3)))


def staged_splits(num_splits: int) -> int:
    """Partial rows a unit's TMA load takes: num_splits rounded up to a multiple of 8 (the splits past num_splits
    are loaded and not used), the count `unit_rows` sizes units by."""
    return 8 * pl.cdiv(num_splits, 8)


def stat_splits(num_splits: int) -> int:
    """Splits of the max and sum buffers under the in-kernel combine: num_splits rounded up to a multiple of 32, so
    that a row group's statistics [P, G] f32 load into registers as 2-element vectors over 128 threads; >=
    `staged_splits` (out's splits). The splits past num_splits are never written and never used."""
    return 32 * pl.cdiv(num_splits, 32)


def unit_rows(num_splits: int) -> int:
    """Rows R of a unit of the in-kernel combine: the most, a power of two up to MAX_UNIT_ROWS, whose partials
    (staged_splits(P) x R quarter rows) stay within MAX_STAGED_ROWS, so that few splits (many query tiles) take
    few units, each one round of loads."""
    rows = MAX_UNIT_ROWS
    while rows > 1 and staged_splits(num_splits) * rows > MAX_STAGED_ROWS:
        rows //= 2
    return rows


def shared_memory_bytes(combine_splits: int = 0) -> int:
    """Shared memory of a program (`_scratch`), by Mosaic GPU's count: every buffer aligned to 1 KB, then 1 KB of
    barriers."""
    buffers = [ref for ref in jax.tree.leaves(_scratch(combine_splits)) if not isinstance(ref, plgpu.Barrier)]
    return sum(-(-math.prod(ref.shape) * jnp.dtype(ref.dtype).itemsize // 1024) * 1024 for ref in buffers) + 1024


def _check(q_lat, q_rope, c_kv, k_rope, prefix_len, bias, num_nodes: int, num_splits: int,
           registers: tuple[int, int], multicast_tiles: int):
    if q_lat.ndim != 3:
        raise ValueError(f"attention_partials: q_lat {q_lat.shape} must be [S, rows, {2 * HALF}]")
    s, rows, c = q_lat.shape
    problems = []
    if num_splits < 1:
        problems.append(f"num_splits={num_splits} must be >= 1")
    consumer, producer = registers
    if any(n % 8 or not 24 <= n <= 256 for n in registers) or 128 * (COMPUTE_WGS * consumer + producer) > 65536:
        problems.append(f"registers={registers} must be multiples of 8 in [24, 256] with 128 x ({COMPUTE_WGS} x "
                        f"consumer + producer) <= 65536 (the register file)")
    if bias.shape != (s, rows, frame_width(num_nodes)) or bias.dtype != jnp.float32:
        problems.append(f"frame_bias {bias.shape} {bias.dtype} must be f32 [S, rows, frame_width(T={num_nodes})] = "
                        f"{(s, rows, frame_width(num_nodes))} (`frame_bias`)")
    if c != 2 * HALF or q_rope.shape != (s, rows, ROPE):
        problems.append(f"q_lat {q_lat.shape} / q_rope {q_rope.shape} must be [S, rows, {2 * HALF}] / "
                        f"[S, rows, {ROPE}]")
    if rows % BLOCK_Q:
        problems.append(f"rows={rows} must be a multiple of {BLOCK_Q} (pad the query rows)")
    elif multicast_tiles not in MULTICAST_SIZES or (rows // BLOCK_Q) % multicast_tiles:
        problems.append(f"multicast_tiles={multicast_tiles} must be one of {MULTICAST_SIZES} and divide the "
                        f"{rows // BLOCK_Q} query tiles of a stream (pass 1)")
    if c_kv.ndim != 3 or c_kv.shape[0] != s or c_kv.shape[2] != c or k_rope.shape != (s, c_kv.shape[1], ROPE):
        problems.append(f"c_kv {c_kv.shape} / k_rope {k_rope.shape} must be [S, N, {c}] / [S, N, {ROPE}]")
    elif c_kv.shape[1] % BLOCK_KV:
        problems.append(f"cache rows N={c_kv.shape[1]} must be a multiple of {BLOCK_KV} (allocate the cache so)")
    if prefix_len.shape != (s,):
        problems.append(f"prefix_len {prefix_len.shape} must be [S={s}]")
    if any(x.dtype != jnp.bfloat16 for x in (q_lat, q_rope, c_kv, k_rope)):
        problems.append("q_lat, q_rope, c_kv and k_rope must be bfloat16")
    if problems:
        raise ValueError("attention_partials: " + "; ".join(problems))


@functools.partial(jax.jit, static_argnames=("scale", "num_nodes", "num_splits", "combine_in_kernel", "multicast_tiles",
                                             "registers", "interpret"))
def attention_partials(q_lat, q_rope, c_kv, k_rope, prefix_len, bias, *, scale: float, num_nodes: int,
                       num_splits: int = 1, combine_in_kernel: bool = False, multicast_tiles: int = 1,
                       registers: tuple[int, int] = REGISTERS, interpret: bool = False):
    """q_lat [S, rows, 512], q_rope [S, rows, 64], c_kv [S, N, 512], k_rope [S, N, 64] (bf16), prefix_len [S] int32,
    bias [S, rows, frame_width(num_nodes)] f32 of 0 or -inf (`frame_bias`: a mask; the kernel adds it before the
    scale) -> (out [P, S, rows, 512] bf16, max [P, S, rows] f32,
    sum [P, S, rows] f32), P = num_splits, over the cache rows j < prefix_len + num_nodes; a split with nothing to
    attend has sum 0 (and max -inf). Needs prefix_len + num_nodes <= N.

    registers: (per consumer thread, per producer thread), `set_max_registers`'s limits.
    combine_in_kernel (GPU only): the programs also join the partials (`_combine_units`) and the result
    [S, rows, 512] bf16 comes first: (result, out, max, sum). Every program of a query tile waits for all its tile's
    splits, so all the programs must be resident at once (`check_resident`).
    multicast_tiles = C > 1 (GPU only): the programs of C adjacent query tiles of a split run as one cluster, each
    block of c_kv and k_rope loaded once for all C by TMA multicast (each program issues 1/C of it), so that the
    cache crosses from the L2 to the multiprocessors once per cluster, not once per tile."""
    _check(q_lat, q_rope, c_kv, k_rope, prefix_len, bias, num_nodes, num_splits, registers, multicast_tiles)
    s, rows, _ = q_lat.shape
    multicast = multicast_tiles > 1
    if multicast and (interpret or combine_in_kernel):
        raise ValueError("attention_partials: multicast_tiles > 1 needs the GPU (Mosaic GPU's interpret mode has no "
                         "clusters) and the separate combine; pass multicast_tiles=1 in interpret mode or with "
                         "combine_in_kernel")
    if combine_in_kernel:
        if interpret:
            raise ValueError("attention_partials: combine_in_kernel needs the GPU (Mosaic GPU's interpret mode has no "
                             "semaphores); pass combine_in_kernel=False in interpret mode")
        check_resident(s * (rows // BLOCK_Q) * num_splits)

    def body(*refs):
        refs = list(refs)
        result_ref = refs.pop(6) if combine_in_kernel else None     # the first output
        combine_bars = refs.pop() if combine_in_kernel else None      # the last scratch
        (q_lat_ref, q_rope_ref, ckv_ref, krope_ref, len_ref, bias_ref, out_ref, max_ref, sum_ref,
         operands, row_smem, stat_smem, q_bar, kv_bars, kr_bars, free_bars, sync_bar, exchange_bars, slot_smem) = refs
        if combine_in_kernel:
            operands, stage = operands      # the union's two groups (`_scratch`)
        q_smem, qr_smem, kv_smem, kr_smem = operands
        qi, split, stream = lax.axis_index("q"), lax.axis_index("split"), lax.axis_index("stream")
        if multicast:        # the grid's q axis counts clusters: tile = cluster * C + place in the cluster
            qi = qi * multicast_tiles + lax.axis_index(TILE_AXIS)
        wg = lax.axis_index("wg")
        q_rows = pl.ds(qi * BLOCK_Q, BLOCK_Q)
        # One semaphore per query tile, zeroed before each call: every consumer warpgroup of the tile's splits adds 1.
        tile_sems = pl.get_global(plgpu.SemaphoreType.REGULAR((s * rows // BLOCK_Q,))) if combine_in_kernel else None

        @pl.when(wg == COMPUTE_WGS)
        def _producer():
            plgpu.set_max_registers(registers[1], action="decrease")
            for h in range(2):
                plgpu.copy_gmem_to_smem(q_lat_ref.at[stream, q_rows, pl.ds(h * HALF, HALF)], q_smem.at[h],
                                        q_bar.at[h])
            plgpu.copy_gmem_to_smem(q_rope_ref.at[stream, q_rows], qr_smem, q_bar.at[2])
            lo, steps = _split_blocks(len_ref[stream] + num_nodes, split, num_splits)

            # Block 2j + slot lives in slot `slot`; part 0 of a slot is the half its own warpgroup (slot) multiplies
            # first, part 1 the other half and the rope rows (over which the slot's warpgroup leaves its p for the
            # other).
            # Under multicast every program of the cluster issues 1/C of each copy for all C.
            cache_copy = functools.partial(plgpu.copy_gmem_to_smem, collective_axes=TILE_AXIS if multicast else None)

            def fetch(step, slot, part):
                kv_rows = pl.ds((lo + step) * BLOCK_KV, BLOCK_KV)
                h = slot if part == 0 else 1 - slot
                cache_copy(ckv_ref.at[stream, kv_rows, pl.ds(h * HALF, HALF)], kv_smem.at[slot, h],
                           kv_bars.at[2 * slot + h])
                if part:
                    cache_copy(krope_ref.at[stream, kv_rows], kr_smem.at[slot], kr_bars.at[slot])

            for slot, part in REFILL_ORDER:
                pl.when(slot < steps)(functools.partial(fetch, slot, slot, part))

            @pl.loop(0, _pairs(steps))
            def _(j):
                for slot, part in REFILL_ORDER:
                    pl.when(2 * j + slot < steps)(functools.partial(plgpu.barrier_wait, free_bars.at[2 * slot + part]))
                    pl.when(2 * j + 2 + slot < steps)(functools.partial(fetch, 2 * j + 2 + slot, slot, part))

            for i in range(3):
                plgpu.barrier_wait(q_bar.at[i])

        def finish(acc, m, total):
            """Write this warpgroup's half of the split's partial (out normalised by `total`, max in base e and sum)
            by TMA; under combine_in_kernel then join the tile's partials once every program has written its own."""
            # Both consumers have read q_smem for the last time: each writes its half of out over its half of q.
            plgpu.barrier_arrive(sync_bar)
            plgpu.barrier_wait(sync_bar)
            q_smem.at[wg][...] = _normalized(acc, total)

            @pl.when(wg == 0)
            def _():
                row_smem.at[0][...] = m * LN2
                row_smem.at[1][...] = total

            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem.at[wg], out_ref.at[split, stream, q_rows, pl.ds(wg * HALF, HALF)])

            @pl.when(wg == 0)
            def _():
                plgpu.copy_smem_to_gmem(row_smem.at[0], max_ref.at[split, stream, q_rows])
                plgpu.copy_smem_to_gmem(row_smem.at[1], sum_ref.at[split, stream, q_rows])

            plgpu.wait_smem_to_gmem(0)
            if not combine_in_kernel:
                return
            tile_sem = tile_sems.at[qi * s + stream]
            # The stores are complete (the wait above); the fence orders them (async proxy) before the release, which
            # the signal's warpgroup barrier (Mosaic GPU's automatic barriers) extends to the thread that signals. The
            # wait ends with an acquire, then a fence for the TMA loads of the other programs' partials after it.
            _fence_async_global()
            plgpu.semaphore_signal(tile_sem, 1, memory_scope="gpu")
            # Past the wait both consumers of this program are done with the main loop's operands, whose memory the
            # combine's buffers reuse.
            plgpu.semaphore_wait(tile_sem, COMPUTE_WGS * num_splits, decrement=False, memory_scope="gpu")
            _fence_async_global()
            _combine_units(result_ref.at[stream, q_rows], out_ref.at[:, stream, q_rows], max_ref.at[:, stream, q_rows],
                           sum_ref.at[:, stream, q_rows], [ref.at[wg] for ref in stage], combine_bars.at[wg],
                           COMPUTE_WGS * split + wg, COMPUTE_WGS * num_splits, num_splits)

        def zero_state():
            """(acc [BLOCK_Q, HALF], running max in base 2, row sums) before any block."""
            m = plgpu.layout_cast(jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32), ROW_LAYOUT)
            total = plgpu.layout_cast(jnp.zeros((BLOCK_Q,), jnp.float32), ROW_LAYOUT)
            return plgpu.layout_cast(jnp.zeros((BLOCK_Q, HALF), jnp.float32), plgpu.Layout.WGMMA), m, total

        def scores_of(slot, halves):
            """q . k of the slot's block [BLOCK_Q, BLOCK_KV] (unscaled), each part's barrier waited just before its
            wgmma: the c_kv halves in the order `halves`, then the rope rows."""
            def scores(acc_ref):
                for h in halves:
                    plgpu.barrier_wait(kv_bars.at[2 * slot + h])
                    plgpu.wgmma(acc_ref, q_smem.at[h], kv_smem.at[slot, h].transpose((1, 0)))
                plgpu.barrier_wait(kr_bars.at[slot])
                plgpu.wgmma(acc_ref, qr_smem, kr_smem.at[slot].transpose((1, 0)))
                return acc_ref[...]

            return pl.run_scoped(scores, plgpu.ACC((BLOCK_Q, BLOCK_KV), jnp.float32))

        def with_bias(qk, lo, step, frame_start):
            """qk plus the frame's bias tile of block `step` (0 or -inf, so adding it before the scale is the same)."""
            cols = pl.ds((lo + step - frame_start) * BLOCK_KV, BLOCK_KV)
            return qk + plgpu.load(bias_ref.at[stream, q_rows, cols], layout=plgpu.Layout.WGMMA, optimized=False)

        def block_max(qk, m):
            """The running max (base 2: logits are qk * scale * log2(e)) after a block's scores qk."""
            return jnp.maximum(m, qk.max(axis=1) * (scale * LOG2E))

        def probabilities(qk, m_safe):
            """p = exp2(qk * scale * log2(e) - m_safe), one fused multiply-add and one ex2 per score, under the
            running max m_safe = `_finite`(max) (0 in a row that has seen nothing, not NaN)."""
            return jnp.exp2(qk * (scale * LOG2E) - lax.broadcast_in_dim(m_safe, qk.shape, [0]))

        def rescale(x, m_old, m_new):
            """x [BLOCK_Q, ...] or [BLOCK_Q] from the running max m_old to m_new (base 2; by `_finite`(m_new), so
            a row that has seen nothing stays 0)."""
            alpha = jnp.exp2(m_old - _finite(m_new))
            return x * (lax.broadcast_in_dim(alpha, x.shape, [0]) if x.ndim > 1 else alpha)

        def _consumer(own: int):
            """Warpgroup `own`: scores the blocks 2j + own (slot own), owns output columns [own * HALF, + HALF).
            The first (0) publishes its block's max (A) and, once the second's max is known (B: with its p in
            shared memory), its p rescaled to it (C)."""
            other = 1 - own
            max_a, max_b, p_a = (exchange_bars.at[i] for i in range(3))
            plgpu.set_max_registers(registers[0], action="increase")
            for i in range(3):
                plgpu.barrier_wait(q_bar.at[i])
            prefix = len_ref[stream]
            lo, steps = _split_blocks(prefix + num_nodes, split, num_splits)
            frame_start = lax.div(prefix, BLOCK_KV)                # the first block not wholly inside the prefix
            plain_steps = jnp.clip(frame_start - lo, 0, steps)     # the blocks before it

            def product(acc, p, slot):
                """acc + p [BLOCK_Q, BLOCK_KV] @ this warpgroup's half of the values in `slot` (traced: Python
                ints as indices inside `_accumulate`'s run_state do not lower) by wgmma."""
                return _accumulate(acc, p, kv_smem.at[slot, wg], in_place=not interpret)

            def publish(ref, value, barrier):
                ref[...] = value
                plgpu.commit_smem()
                plgpu.barrier_arrive(barrier)

            def own_scores(j, mine, framed: bool):
                # The halves in the order own, other: as `mine`, `1 - mine` (read at run time, like the slot, so
                # that the q tile's descriptors are not hoisted either).
                qk = scores_of(mine, halves=(mine, 1 - mine))
                if not framed:
                    return qk
                step = 2 * j + own
                return lax.cond(lo + step >= frame_start, lambda x: with_bias(x, lo, step, frame_start),
                                lambda x: x, qk)

            def pair_fn(j, carry, framed: bool):
                acc, m, total = carry
                second_exists = 2 * j + 1 < steps if framed else True     # the plain pairs are whole
                mine = slot_smem[own]                                   # = own, read at run time (`_scratch`)
                theirs = 1 - mine

                def add_theirs(acc):
                    """acc + the other warpgroup's p @ this warpgroup's half of its block's values."""
                    plgpu.barrier_wait(kv_bars.at[2 * theirs + own])
                    acc = product(acc, kr_smem.at[theirs], theirs)
                    plgpu.barrier_arrive(free_bars.at[2 * theirs + 1])
                    return acc

                if own == 0:
                    qk = own_scores(j, mine, framed)
                    m_a = block_max(qk, m)
                    publish(stat_smem.at[0, 0], m_a, max_a)
                    p = probabilities(qk, _finite(m_a))
                    total = rescale(total, m, m_a) + p.sum(axis=1)
                    acc = product(rescale(acc, m, m_a), p.astype(jnp.bfloat16), mine)
                    plgpu.barrier_arrive(free_bars.at[2 * mine])
                    plgpu.barrier_wait(max_b)
                    m_new = plgpu.load(stat_smem.at[1, 0], layout=ROW_LAYOUT)
                    publish(kr_smem.at[mine], rescale(p, m_a, m_new).astype(jnp.bfloat16), p_a)
                    acc, total = rescale(acc, m_a, m_new), rescale(total, m_a, m_new)
                    acc = add_theirs(acc) if second_exists is True else lax.cond(second_exists, add_theirs,
                                                                                   lambda a: a, acc)
                    return acc, m_new, total

                def with_block(acc, total):
                    qk = own_scores(j, mine, framed)
                    plgpu.barrier_wait(max_a)
                    m_new = block_max(qk, plgpu.load(stat_smem.at[0, 0], layout=ROW_LAYOUT))
                    p = probabilities(qk, _finite(m_new))
                    kr_smem.at[mine][...] = p.astype(jnp.bfloat16)
                    publish(stat_smem.at[1, 0], m_new, max_b)
                    total = rescale(total, m, m_new) + p.sum(axis=1)
                    acc = product(rescale(acc, m, m_new), p.astype(jnp.bfloat16), mine)
                    plgpu.barrier_arrive(free_bars.at[2 * mine])
                    return acc, total, m_new

                def without_block(acc, total):            # an odd last block: pass the first's max on
                    plgpu.barrier_wait(max_a)
                    m_new = plgpu.load(stat_smem.at[0, 0], layout=ROW_LAYOUT)
                    publish(stat_smem.at[1, 0], m_new, max_b)
                    return rescale(acc, m, m_new), rescale(total, m, m_new), m_new

                acc, total, m_new = (with_block(acc, total) if second_exists is True
                                     else lax.cond(second_exists, with_block, without_block, acc, total))
                plgpu.barrier_wait(p_a)
                return add_theirs(acc), m_new, total

            slot_smem[own] = jnp.int32(own)   # each thread stores the same value and reads back its own
            # Pairs wholly before the frame, then the rest (bias where a block is in the frame, maybe one block).
            plain_pairs = lax.div(plain_steps, 2)
            carry = lax.fori_loop(0, plain_pairs, functools.partial(pair_fn, framed=False), zero_state())
            acc, m, total = lax.fori_loop(plain_pairs, _pairs(steps),
                                          functools.partial(pair_fn, framed=True), carry)
            # Each warpgroup summed its own blocks' p: the split's row sums are the two together.
            publish(stat_smem.at[own, 1], total, sync_bar)
            plgpu.barrier_wait(sync_bar)
            total = total + plgpu.load(stat_smem.at[other, 1], layout=ROW_LAYOUT)
            finish(acc, m, total)

        for own in range(COMPUTE_WGS):
            pl.when(wg == own)(functools.partial(_consumer, own))
        if multicast:      # no program leaves while a peer may still arrive on its free barriers
            _cluster_sync()

    # Under the in-kernel combine out has staged_splits(P) splits, max and sum stat_splits(P), the first P written
    # (`_combine_units` loads them whole).
    out_splits, stats_splits = ((staged_splits(num_splits), stat_splits(num_splits)) if combine_in_kernel
                                else (num_splits, num_splits))
    out_types = ((jax.ShapeDtypeStruct((s, rows, 2 * HALF), jnp.bfloat16),) if combine_in_kernel else ()) + (
        jax.ShapeDtypeStruct((out_splits, s, rows, 2 * HALF), jnp.bfloat16),
        jax.ShapeDtypeStruct((stats_splits, s, rows), jnp.float32),
        jax.ShapeDtypeStruct((stats_splits, s, rows), jnp.float32))
    outs = plgpu.kernel(
        body, out_type=out_types, scratch_types=_scratch(num_splits if combine_in_kernel else 0, multicast_tiles),
        grid=(rows // BLOCK_Q // multicast_tiles, num_splits, s), grid_names=("q", "split", "stream"),
        **(dict(cluster=(multicast_tiles, 1, 1), cluster_names=(TILE_AXIS, "cluster_split", "cluster_stream"))
           if multicast else {}),
        num_threads=COMPUTE_WGS + 1, thread_name="wg", kernel_name="tree_verify_attention_mgpu",
        # exp2 as one ex2.approx.ftz.f32 (and `_combine_units`' exp as ex2 of x * log2(e)); interpret mode is exact.
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(q_lat, q_rope, c_kv, k_rope, prefix_len.astype(jnp.int32), bias)
    return outs[:-3] + tuple(x[:num_splits] for x in outs[-3:])


def _finite(m):
    """A running max with -inf (a row that has seen nothing) as 0, so that exp2(x - m) is 0 there, not NaN."""
    return jnp.where(m == -jnp.inf, 0.0, m)


def _normalized(acc, total):
    """A consumer's output [BLOCK_Q, HALF] over its running row sums [BLOCK_Q], in bf16 (0 for a row that saw
    nothing)."""
    return (acc * lax.broadcast_in_dim(inverse_or_zero(total), acc.shape, [0])).astype(jnp.bfloat16)


def _fence_async_global():
    """fence.proxy.async.global: orders this thread's global-memory accesses by TMA (the async proxy) with its plain
    ones, both ways (the in-kernel combine's partials are written and read by TMA around a semaphore)."""
    @plgpu.inline_mgpu()
    def fence(_):
        mgpu_utils.inline_ptx("fence.proxy.async.global;", has_side_effects=True)

    fence()


def _cluster_sync():
    """barrier.cluster (arrive with release, wait with acquire), taken by every thread of every program of the
    cluster."""
    @plgpu.inline_mgpu()
    def sync(_):
        mgpu_utils.inline_ptx("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;",
                              has_side_effects=True)

    sync()


def _combine_units(result_ref, out_ref, max_ref, sum_ref, stage, barrier, first: int, step: int, num_splits: int):
    """A consumer warpgroup's share of joining its query tile's partials (out [P'', BLOCK_Q, 512] normalised bf16,
    max / sum [P', BLOCK_Q] f32, P'' = `staged_splits`(P) and P' = `stat_splits`(P) with the first P = num_splits
    written) into result [BLOCK_Q, 512] bf16: the units first, first + step, ... of the tile's QUARTERS x BLOCK_Q / R,
    unit u being R = unit_rows(P) rows from R * (u // QUARTERS), QUARTER columns from QUARTER * (u % QUARTERS).
    stage: this warpgroup's buffers (`_combine_stage`); barrier: its barrier for three TMA loads. Per unit, one round
    of TMA loads from global memory (the unit's partials of every split into o_stage [P'', R, QUARTER], its group of
    G = max(STAT_ROWS, R) rows' max and sum into [P', G] each); then per row, from shared memory, the row's largest
    max, the splits' weights sum_p * exp(max_p - largest) (element-wise over the group, into w_stage) and the
    weighted sum, each thread one column. Measured level with or slower than the separate combine kernel (kernels.md,
    "Twenty-fifth session", "Twenty-sixth session": the folds in independent lanes changed nothing)."""
    o_stage, m_stage, l_stage, w_stage = stage
    unit_row_count, group_rows = o_stage.shape[1], m_stage.shape[1]
    stats = plgpu.Layout.WG_STRIDED(m_stage.shape, vec_size=2)
    column = plgpu.Layout.WG_STRIDED((QUARTER,), vec_size=1)

    @pl.loop(first, QUARTERS * BLOCK_Q // unit_row_count, step=step)
    def _(unit):
        first_row = lax.div(unit, QUARTERS) * unit_row_count
        cols = pl.ds(lax.rem(unit, QUARTERS) * QUARTER, QUARTER)
        group = lax.div(first_row, group_rows) * group_rows
        splits, group_slice = pl.ds(0, m_stage.shape[0]), pl.ds(group, group_rows)
        plgpu.copy_gmem_to_smem(out_ref.at[pl.ds(0, o_stage.shape[0]), pl.ds(first_row, unit_row_count), cols],
                                o_stage, barrier)
        plgpu.copy_gmem_to_smem(max_ref.at[splits, group_slice], m_stage, barrier)
        plgpu.copy_gmem_to_smem(sum_ref.at[splits, group_slice], l_stage, barrier)
        plgpu.barrier_wait(barrier)
        row_max = plgpu.load(m_stage, layout=stats, optimized=False)
        row_sum = plgpu.load(l_stage, layout=stats, optimized=False)

        @pl.loop(0, unit_row_count)
        def _(r):
            member = first_row - group + r
            top = _fold(lambda p, top: jnp.maximum(top, m_stage[p, member]), num_splits, jnp.float32(-jnp.inf))
            w_stage[...] = row_sum * jnp.exp(row_max - jnp.where(top == -jnp.inf, 0.0, top))   # 0 where sum is 0

            def add(p, carry):
                acc, total = carry
                weight = w_stage[p, member]
                return acc + plgpu.load(o_stage.at[p, r], layout=column).astype(jnp.float32) * weight, total + weight

            acc, total = _fold(add, num_splits, (plgpu.layout_cast(jnp.zeros((QUARTER,), jnp.float32), column),
                                                 jnp.float32(0.0)))
            result_ref.at[first_row + r, cols][...] = (acc * inverse_or_zero(total)).astype(jnp.bfloat16)

        # Every thread's reads of the staged unit are done before the next unit's loads overwrite it.
        plgpu.commit_smem()


def _fold(step, count: int, carry):
    """carry after step(p, carry) for p = 0, ..., count - 1, COMBINE_UNROLL steps per loop iteration."""
    def unrolled(first, n: int, carry):
        for i in range(n):
            carry = step(first + i, carry)
        return carry

    blocks, rest = divmod(count, COMBINE_UNROLL)
    carry = lax.fori_loop(0, blocks, lambda b, c: unrolled(b * COMBINE_UNROLL, COMBINE_UNROLL, c), carry)
    return unrolled(blocks * COMBINE_UNROLL, rest, carry)


def resident_programs() -> int:
    """Programs of this kernel resident at once: one per multiprocessor (~218 KB of shared memory each) of the local
    GPU (an H200's `NUM_SMS` where there is none: lowering on the CPU)."""
    try:
        return jax.local_devices(backend="gpu")[0].core_count
    except RuntimeError:
        return op.NUM_SMS


def check_resident(programs: int) -> None:
    """combine_in_kernel's programs wait for each other: all of them must be resident at once (`resident_programs`)."""
    sms = resident_programs()
    if programs > sms:
        raise ValueError(f"attention_partials: combine_in_kernel with {programs} programs, more than the {sms} "
                         f"multiprocessors that hold one each at once: fewer splits, or combine_in_kernel=False")


def _accumulate(acc, a, b_smem, *, in_place: bool):
    """acc + a @ b_smem with wgmma (a in registers or shared memory): on the GPU accumulating in place (ACC.init);
    Mosaic GPU's interpret mode runs wgmma only into a fresh accumulator, whose product is then added in registers."""
    if in_place:
        return pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, a, b_smem))(plgpu.ACC.init(acc))
    if isinstance(a, jax.Array):       # interpret mode's wgmma takes its A operand from shared memory only
        return acc + jnp.dot(a, b_smem[...], preferred_element_type=jnp.float32)

    def product(acc_ref):
        plgpu.wgmma(acc_ref, a, b_smem)
        return acc_ref[...]

    return acc + pl.run_scoped(product, plgpu.ACC(acc.shape, jnp.float32))


def supports(q_lat, q_rope, c_kv, k_rope) -> bool:
    """Whether this kernel can take a call with these operands (q_lat [S, T, H, C], q_rope [S, T, H, R], c_kv
    [S, N, C], k_rope [S, N, R]): the K2.x widths (C = 512, R = 64), bf16 and whole 64-row cache blocks."""
    return (q_lat.shape[-1] == 2 * HALF and q_rope.shape[-1] == ROPE and c_kv.shape[1] % BLOCK_KV == 0
            and all(x.dtype == jnp.bfloat16 for x in (q_lat, q_rope, c_kv, k_rope)))


def fits(q_lat, q_rope, c_kv, k_rope) -> bool:
    """Whether `ops` gives this kernel the call: `supports` it, with at least one whole 64-row query tile per stream
    (fewer rows would be mostly padding: the Triton kernel's 16-row tiles win there, kernels.md)."""
    _, t, h, _ = q_lat.shape
    return supports(q_lat, q_rope, c_kv, k_rope) and takes_rows(t * h)


def takes_rows(rows: int) -> bool:
    """The query-row part of `fits`: at least one whole 64-row tile per stream."""
    return rows >= BLOCK_Q


def query_tiles(rows: int) -> int:
    """The 64-row query tiles of a stream of `rows` = T x H (node, head) pairs (`padded_rows` / BLOCK_Q)."""
    return pl.cdiv(rows, BLOCK_Q)


def padded_rows(rows: int) -> int:
    """The kernel's query rows for `rows` = T x H (node, head) pairs: rounded up to whole 64-row tiles."""
    return BLOCK_Q * query_tiles(rows)


def default_num_splits(num_streams: int, num_rows: int, capacity: int) -> int:
    """Split-K count for this kernel: the Triton kernel's heuristic (`tree_verify_attention.split_count`) with this
    kernel's programs and limits: 64-row tiles, one resident per multiprocessor (~218 KB of shared memory), bf16
    partials of the padded rows, MIN_BLOCKS_PER_SPLIT and PARTIAL_BUDGET. Few query rows over a long prefix (H=8 T=1
    N=32768, a shape `ops` sends to the Triton kernel, timed here by direct calls) take one wave, 132 splits, as the
    Triton kernel's decode tile does (kernels.md, "The Mosaic GPU whole op on the H200", "Seventeenth session")."""
    tiles = num_streams * query_tiles(num_rows)
    partial_bytes = 2 * tiles * BLOCK_Q * (2 * HALF * 2 + 8)      # bf16 out, f32 max and sum: written, read back
    return op.split_count(tiles, capacity, BLOCK_KV, op.NUM_SMS, partial_bytes,
                          op.call_floor_bytes(num_streams, num_rows, capacity), min_blocks=MIN_BLOCKS_PER_SPLIT,
                          partial_budget=PARTIAL_BUDGET)


def default_multicast_tiles(num_rows: int, capacity: int, num_splits: int) -> int:
    """multicast_tiles for the op's calls: 2 where a stream's num_rows padded to 64-row tiles make exactly 2 tiles and
    each of its num_splits splits of the capacity cache rows holds at least MULTICAST_MIN_BLOCKS blocks (the two
    tiles' stream of the cache then bounds the kernel, and sharing its loads pays); else 1. At 4 or more tiles
    clusters of 2 are level and of 4 slower (kernels.md, "Thirtieth session"). A cluster is of one stream, so the
    stream count does not enter."""
    return 2 if query_tiles(num_rows) == 2 and capacity // BLOCK_KV >= MULTICAST_MIN_BLOCKS * num_splits else 1


def _pairs(steps):
    """The pairs of blocks (one per consumer warpgroup) in a split of `steps` blocks, the last maybe a single one."""
    return lax.div(steps + 1, 2)


def _split_blocks(length, split, num_splits: int):
    """(first block, number of blocks) of `split`'s contiguous piece of the cdiv(length, BLOCK_KV) blocks that hold
    a stream's `length` attended cache rows (its prefix and tree block)."""
    num_blocks = lax.div(length + BLOCK_KV - 1, BLOCK_KV)
    per_split = lax.div(num_blocks + num_splits - 1, num_splits)
    lo = split * per_split
    return lo, jnp.maximum(jnp.minimum(lo + per_split, num_blocks) - lo, 0)


def query_rows(x):
    """x [S, T, H, W] -> [S, T * H rounded up to a multiple of BLOCK_Q, W]: the kernel's query rows, (node, head)
    pairs in order, then zero padding rows."""
    s, t, h, w = x.shape
    return jnp.pad(x.reshape(s, t * h, w), ((0, 0), (0, padded_rows(t * h) - t * h), (0, 0)))


def frame_width(num_nodes: int) -> int:
    """Columns of the frame: the cache blocks from the one holding the prefix's end (prefix_len // BLOCK_KV) to the
    one holding the tree block's last row, whatever the prefix's length."""
    return BLOCK_KV * pl.cdiv(BLOCK_KV - 1 + num_nodes, BLOCK_KV)


def frame_bias(prefix_len, visible, num_heads: int, rows: int):
    """prefix_len [S], visible [S, T, T] -> bias [S, rows, frame_width(T)] f32 of the frame's cache rows
    j = (prefix_len // BLOCK_KV) * BLOCK_KV + column: 0 where query row r = (node r // num_heads, head) may attend
    (j < prefix_len, or j = prefix_len + u with visible[s, node, u]), -inf elsewhere (past the tree block, and on the
    tree rows for the padding rows past T * num_heads, which the op slices off)."""
    s, t, _ = visible.shape
    prefix_len = prefix_len.astype(jnp.int32)
    j = (prefix_len // BLOCK_KV * BLOCK_KV)[:, None] + jnp.arange(frame_width(t))[None, :]    # [S, W]
    allowed = jnp.broadcast_to((j < prefix_len[:, None])[:, None, :], (s, rows, j.shape[1]))
    if t:
        u = j - prefix_len[:, None]                                            # tree node of each column
        node = jnp.arange(rows) // num_heads                                   # [rows]
        sees = jnp.take_along_axis(visible[:, jnp.minimum(node, t - 1), :],
                                   jnp.broadcast_to(jnp.clip(u, 0, t - 1)[:, None, :], allowed.shape), axis=2)
        allowed = allowed | (((u >= 0) & (u < t))[:, None, :] & sees & (node < t)[None, :, None])
    return jnp.where(allowed, 0.0, -jnp.inf).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("scale", "num_splits", "combine_in_kernel", "multicast_tiles", "registers",
                                             "interpret"))
def tree_verify_attention(q_lat, q_rope, c_kv, k_rope, prefix_len, visible, *, scale: float, bias=None,
                          num_splits: int | None = None, combine_in_kernel: bool = False,
                          multicast_tiles: int | None = None,
                          registers: tuple[int, int] = REGISTERS, interpret: bool = False):
    """Tree-verify attention in Mosaic GPU: the semantics and shapes of
    `tree_verify_attention.tree_verify_attention_reference` (q_lat [S, T, H, 512], q_rope [S, T, H, 64], c_kv
    [S, N, 512], k_rope [S, N, 64] bf16, prefix_len [S], visible [S, T, T] -> [S, T, H, 512] bf16). The T x H query
    rows are padded to 64-row tiles; the prefix and the tree block run in one kernel (`attention_partials`, under
    `frame_bias`, or `bias` where the caller made it once for a forward's calls: `ops.tree_verify_plan`). With
    num_splits (default `default_num_splits`) > 1 the partials are joined by `combine.merge` (XLA's
    `combine_partials` in interpret mode), or with combine_in_kernel in the kernel itself (GPU only, one wave of
    programs; on the H200 level with or slower than the separate combine: kernels.md, "Twenty-fifth session").
    multicast_tiles: `attention_partials`' (default on the GPU `default_multicast_tiles`, with the separate combine;
    1 in interpret mode). N must be a multiple of 64."""
    op.check_shapes(q_lat, q_rope, c_kv, k_rope, prefix_len, visible)
    s, t, h, c = q_lat.shape
    if c_kv.shape[1] % BLOCK_KV:
        raise ValueError(f"tree_verify_attention_mgpu.tree_verify_attention: cache rows N={c_kv.shape[1]} must be a "
                         f"multiple of {BLOCK_KV} (allocate the cache so, or use ops.tree_verify_attention)")
    rows = t * h
    q_lat_rows, q_rope_rows = query_rows(q_lat), query_rows(q_rope)
    padded = q_lat_rows.shape[1]
    if num_splits is None:
        num_splits = default_num_splits(s, rows, c_kv.shape[1])
        if combine_in_kernel:                 # its programs must fit on the GPU at once
            num_splits = max(1, min(num_splits, resident_programs() // (s * (padded // BLOCK_Q))))
    combine_in_kernel = combine_in_kernel and num_splits > 1
    if multicast_tiles is None:
        multicast_tiles = (1 if interpret or combine_in_kernel
                           else default_multicast_tiles(rows, c_kv.shape[1], num_splits))
    if bias is None:
        bias = frame_bias(prefix_len, visible, h, padded)
    outs = attention_partials(
        q_lat_rows, q_rope_rows, c_kv, k_rope, prefix_len, bias, scale=scale,
        num_nodes=t, num_splits=num_splits, combine_in_kernel=combine_in_kernel, multicast_tiles=multicast_tiles,
        registers=registers, interpret=interpret)
    if combine_in_kernel:
        merged = outs[0][:, :rows]
    elif num_splits == 1:
        merged = outs[0][0, :, :rows]
    else:
        call = None if interpret else bound_to(combine.LAUNCHER, interpret=False, reference="interpret=True",
                                               op="tree_verify_attention_mgpu.tree_verify_attention")
        merged = combine.merge(call, *outs, rows=rows, cols=c, dtype=q_lat.dtype, normalized=True)
    return merged.reshape(s, t, h, c)
