"""INT4 (group 32) x bf16 block matmul in Pallas Mosaic GPU for Hopper: the routed experts' GEMMs at large M, in
the warp-specialised structure (kernels.md, "Fourteenth session": the Triton int4_moe at M=4096 is issue-bound, each
warp dequantizing, then waiting on its own wgmma).

One kernel computes, for every routed block b of T tokens (MgpuMatmulConfig.block_tokens, default 128) with expert
e = block_expert[b] (in [0, E); other values mark empty blocks, skipped):

    out[:, b's T columns] = dequant(w[e]) [N, K] @ acts[b's T rows, :]^T       (f32 accumulation)

with dequant(w)[n, p] = w[n, p] * scales[8 (p // 256) + p % 8, n]: w int4 [E, N, K] holds the K inputs in int4_moe's
kernel layout read as positions (`int4_moe.int4_positions`, a bitcast of the Triton kernels' words: position p of a
256-input block holds input 32 (p % 8) + p // 8, of the block's group p % 8), and acts come in the same order
(`int4_moe.inputs_to_positions`). So 32 adjacent positions span the block's 8 groups, 4 inputs each; in wgmma's
register layout a thread's weights of one row meet only two of them (columns 2c, 2c + 1 mod 8), and the [64, 32]
scale tile is the block's [64, 8] one repeated (registers reused, no data movement). The output is
transposed ([N, R], R = T x blocks) so that it feeds the next GEMM as wgmma's B operand without a transpose
(`acts_k_major`): gate_up writes h^T [I, R], down reads it. `tokens_major_out` stores each tile transposed instead
([R, N]: down's y, whose rows the combine gathers). Columns (rows) of empty blocks are not written.

Structure: a persistent grid of one CTA per SM walking (block, row tile) pairs, the row tiles of one block next to
each other (their activation tile then comes from L2; with `cluster` = 2, two CTAs take adjacent row tiles together
and the activation tile is multicast to both); per pair a pipeline (`emit_pipeline_warp_specialized`) with one TMA
producer warpgroup and two consumer warpgroups, each dequantizing its 64 or 128 rows (`rows_per_wg`: one
accumulator per 64) of the weight tile 32 positions at a time (int4 loaded 8 nibbles per 32-bit load, relaid out while
4-bit, converted, scaled by the block's [64, 8] scales, loaded once per step) and issuing one wgmma of K = 32 per 32
positions and accumulator. `a_in_shared`: stage each dequantized 32-position chunk in shared memory and take wgmma's
A from there (Mosaic GPU's interpret mode takes no register A; the GPU path is the register one).

Off the GPU it runs only in Mosaic GPU's interpret mode, which the caller sets (`plgpu.force_gpu_interpret_mode`)
and which needs `a_in_shared=True`. Measured on the H200: kernels.md, "Fifteenth session" and "Sixteenth session"
(`cluster` = 2: 1-3% slower; the gated product at 128 rows per warpgroup has not run on a GPU).
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

from pallas_kernels import SHARED_BYTES
from pallas_kernels import int4_moe as ref

GROUP = ref.GROUP      # inputs per scale (32)
BLOCK_IN = ref.BLOCK_IN  # positions per block of 8 groups (256)
GROUPS = BLOCK_IN // GROUP
TOKENS = 128           # default columns of out per routed block (wgmma's N; MgpuMatmulConfig.block_tokens)
ROWS_PER_WG = 64       # rows of out per consumer warpgroup (wgmma's M)
CONSUMERS = 2
ROWS = CONSUMERS * ROWS_PER_WG
EPILOGUE_COLS = 64     # most out columns per TMA store (feature-major out)
START_MULTIPLE = 8     # block_start's rows: a multiple of the activation tile's (8, 32) tiling rows
H200_SMS = 132


@dataclasses.dataclass(frozen=True)
class MgpuMatmulConfig:
    """tile_k inputs per pipeline step (32, 64, 128 or 256: a step reads the scales of one block's 8 groups), stages
    in flight (None: the most, up to MAX_STAGES, that fit the shared memory, `stages_that_fit`), the grid's CTAs (one
    per SM), block_tokens the tokens per routed block (wgmma's N: a multiple of 32 up to 256; fewer pad less when
    experts see few tokens each), rows_per_wg the output rows per consumer warpgroup and (block, row tile) pair, 64
    per accumulator (128: each activation tile read from L2 serves twice the weight rows, with twice the
    accumulators), cluster the CTAs (1 or 2) that take adjacent row tiles of one block together, its activation tile
    loaded once for both (a TMA multicast: half the L2 reads of activations)."""
    tile_k: int = 128
    stages: int | None = None
    ctas: int = H200_SMS
    block_tokens: int = TOKENS
    rows_per_wg: int = ROWS_PER_WG
    cluster: int = 1

    def __post_init__(self):
        if self.tile_k not in (32, 64, 128, 256):
            raise ValueError(f"MgpuMatmulConfig.tile_k={self.tile_k} must be 32, 64, 128 or 256 (a step reads the "
                             f"scales of one {BLOCK_IN}-input block)")
        if self.block_tokens % 32 or not 0 < self.block_tokens <= 256:
            raise ValueError(f"MgpuMatmulConfig.block_tokens={self.block_tokens} must be a multiple of 32 in "
                             "[32, 256]")
        if self.cluster not in (1, 2) or self.ctas % self.cluster:
            raise ValueError(f"MgpuMatmulConfig.cluster={self.cluster} must be 1 or 2 and divide ctas={self.ctas}")
        if self.rows_per_wg not in (ROWS_PER_WG, 2 * ROWS_PER_WG):
            raise ValueError(f"MgpuMatmulConfig.rows_per_wg={self.rows_per_wg} must be {ROWS_PER_WG} or "
                             f"{2 * ROWS_PER_WG}")
        if (self.stages is not None and not 1 <= self.stages <= 8) or self.ctas < 1:
            raise ValueError(f"MgpuMatmulConfig: stages={self.stages} must be in [1, 8] (or None), ctas={self.ctas} "
                             ">= 1")


MAX_STAGES = 4


def stages_that_fit(tile_k: int, products: int, out_dtype, a_in_shared: bool, block_tokens: int = TOKENS,
                    rows_per_wg: int = ROWS_PER_WG) -> int:
    """The most pipeline stages (<= MAX_STAGES) whose tiles fit SHARED_BYTES beside the epilogue's buffer: a stage
    holds per product 2 rows_per_wg x tile_k int4 weights and 8 x 2 rows_per_wg bf16 scales (its block's groups), and
    block_tokens x tile_k bf16 activations (tile_k 128, 128 tokens, 64 rows per warpgroup: 42 KB with one product,
    52 KB with two). At least 2 (the lowering refuses what does not fit)."""
    cta_rows = CONSUMERS * rows_per_wg
    stage = products * (cta_rows * tile_k // 2 + GROUPS * cta_rows * 2) + block_tokens * tile_k * 2
    fixed = CONSUMERS * block_tokens * rows_per_wg * jnp.dtype(out_dtype).itemsize + 4096     # epilogue, barriers
    if a_in_shared:
        fixed += CONSUMERS * products * tile_k * rows_per_wg * 2
    return max(2, min(MAX_STAGES, (SHARED_BYTES - fixed) // stage))


def check_operands(acts, block_expert, w, scales, acts_k_major: bool, block_tokens: int, block_start=None):
    """Shapes and dtypes of `int4_block_matmul`'s operands; a ValueError naming the mismatch."""
    if w.ndim != 3 or w.dtype != jnp.int4:
        raise ValueError(f"w must be int4 [E, N, K], got {w.dtype} {w.shape}: convert with int4_moe.int4_positions")
    e, n, k = w.shape
    if scales.shape != (e, k // GROUP, n) or scales.dtype != jnp.bfloat16:
        raise ValueError(f"scales must be bfloat16 [E, K/32, N] = {(e, k // GROUP, n)}, got {scales.dtype} "
                         f"{scales.shape}")
    if n % ROWS or k % BLOCK_IN:
        raise ValueError(f"N={n} must be a multiple of {ROWS} and K={k} of {BLOCK_IN} (int4_moe's padded inputs)")
    rows = block_expert.shape[0] * block_tokens
    if block_start is not None:
        if acts_k_major or block_start.shape != block_expert.shape or acts.ndim != 2 or acts.shape[0] < block_tokens:
            raise ValueError(f"block_start {block_start.shape} must match block_expert {block_expert.shape}, with "
                             f"acts [P >= {block_tokens}, K] (not acts_k_major), got acts {acts.shape}")
        rows = acts.shape[0]
    want = (k, rows) if acts_k_major else (rows, k)
    if acts.shape != want or acts.dtype != jnp.bfloat16 or block_expert.ndim != 1:
        raise ValueError(f"acts must be bfloat16 {want} ({'[K, R]' if acts_k_major else '[R, K]'}, R = "
                         f"{block_tokens} x {block_expert.shape[0]} blocks) and block_expert 1-D, got {acts.dtype} "
                         f"{acts.shape} and {block_expert.shape}")


@functools.partial(jax.jit, static_argnames=("acts_k_major", "tokens_major_out", "config", "a_in_shared",
                                             "out_dtype"))
def int4_block_matmul(acts, block_expert, w, scales, up=None, block_start=None, *, acts_k_major: bool = False,
                      tokens_major_out: bool = False, config: MgpuMatmulConfig = MgpuMatmulConfig(),
                      a_in_shared: bool = False, out_dtype=jnp.bfloat16):
    """out [N, R] (module doc), or [R, N] with tokens_major_out (each tile stored transposed: the rows a combine
    gathers per pair). acts bf16 [R, K] (or [K, R] with acts_k_major), R = block_tokens x blocks, block_expert int32
    [blocks], w int4 [E, N, K], scales bf16 [E, K/32, N]. up: None, or (w_up, scales_up) of w's shapes, for the
    gated product out = silu(w . acts^T) * (w_up . acts^T) in f32 before the one rounding (gate_up's h^T in one
    kernel).
    block_start: None (block b's tokens are acts rows b x block_tokens onward), or int32 [blocks], the acts row where
    each block's block_tokens rows begin (acts [P, K], e.g. the tokens of the pairs sorted by expert: no gather into
    block order), each a multiple of START_MULTIPLE, block_start + block_tokens <= P for every non-empty block. The
    output keeps its block layout."""
    tokens = config.block_tokens
    check_operands(acts, block_expert, w, scales, acts_k_major, tokens, block_start)
    products = [(w, scales)]
    if up is not None:
        if up[0].shape != w.shape or up[1].shape != scales.shape:
            raise ValueError(f"up {up[0].shape} / {up[1].shape} must match w {w.shape} / scales {scales.shape}")
        check_operands(acts, block_expert, *up, acts_k_major, tokens, block_start)
        products.append(tuple(up))
    start_multiple = START_MULTIPLE if block_start is not None else tokens      # what the TMA's tiling can prove
    if block_start is None:
        block_start = jnp.arange(block_expert.shape[0], dtype=jnp.int32) * tokens
    num_experts, n, k = w.shape
    num_blocks = block_expert.shape[0]
    tile_k = config.tile_k
    if k % tile_k:
        raise ValueError(f"K={k} is not a multiple of tile_k={tile_k}: choose MgpuMatmulConfig.tile_k dividing K")
    subs = config.rows_per_wg // ROWS_PER_WG                        # accumulators per product and warpgroup
    cta_rows = CONSUMERS * config.rows_per_wg
    if n % cta_rows:
        raise ValueError(f"N={n} is not a multiple of the {cta_rows} rows per tile of rows_per_wg="
                         f"{config.rows_per_wg}: use MgpuMatmulConfig.rows_per_wg={ROWS_PER_WG}")
    stages = config.stages or stages_that_fit(tile_k, len(products), out_dtype, a_in_shared, tokens,
                                              config.rows_per_wg)
    epilogue_cols = math.gcd(EPILOGUE_COLS, tokens)
    chunks = tile_k // GROUP                                        # wgmma steps of K = 32 per pipeline step
    row_tiles = n // cta_rows
    cluster = config.cluster
    if row_tiles % cluster:
        raise ValueError(f"the {row_tiles} row tiles of N={n} do not split over a cluster of {cluster} CTAs: use "
                         "MgpuMatmulConfig.cluster=1")
    w_transforms = (plgpu.TilingTransform((8, GROUP)),)             # a 16-byte row of int4: no swizzle
    act_transforms = (plgpu.TilingTransform((8, GROUP)), plgpu.SwizzleTransform(64))
    out_bits = jnp.dtype(out_dtype).itemsize * 8
    out_swizzle = plgpu.find_swizzle((ROWS_PER_WG if tokens_major_out else epilogue_cols) * out_bits)
    out_transforms = (plgpu.TilingTransform((8, out_swizzle * 8 // out_bits)), plgpu.SwizzleTransform(out_swizzle))
    act_block = (tile_k, tokens) if acts_k_major else (tokens, tile_k)
    weight_specs = [plgpu.BlockSpec((cta_rows, tile_k), lambda s: (0, s), transforms=w_transforms),
                    plgpu.BlockSpec((GROUPS, cta_rows), lambda s: (s * tile_k // BLOCK_IN, 0))] * len(products)
    act_spec = plgpu.BlockSpec(act_block, (lambda s: (s, 0)) if acts_k_major else (lambda s: (0, s)),
                               transforms=act_transforms, collective_axes=("cluster",) if cluster > 1 else None)

    def int4_block_matmul_kernel(acts_gmem, expert_gmem, start_gmem, *refs, out_smem, a_smem):   # names the cubin
        *weights_gmem, out_gmem = refs                              # (w, scales) per product, then the output

        def pipeline(body, compute_context):
            return plgpu.emit_pipeline_warp_specialized(
                body, grid=(k // tile_k,), memory_registers=40, wg_axis="wg", num_compute_wgs=CONSUMERS,
                max_concurrent_steps=stages, compute_context=compute_context, in_specs=[*weight_specs, act_spec])

        def nothing(*_, **__):
            return None

        @functools.partial(pl.run_scoped, allocations=pipeline(nothing, nothing).get_allocations(
            *(ref_.at[0] for ref_ in weights_gmem), acts_gmem), collective_axes="wg")
        def _scope(allocations):
            wg = lax.axis_index("wg")
            sub_rows = [pl.ds(wg * config.rows_per_wg + sub * ROWS_PER_WG, ROWS_PER_WG) for sub in range(subs)]

            @plgpu.nd_loop((num_blocks * row_tiles // cluster,), collective_axes="sm")
            def _pairs(info: plgpu.NDLoopInfo):
                (pair,) = info.index            # (block, cluster's row tiles); a block's row tiles next to each other
                block = pair // (row_tiles // cluster)
                tile = pair % (row_tiles // cluster) * cluster + (lax.axis_index("cluster") if cluster > 1 else 0)
                expert = expert_gmem[block]
                rows = pl.ds(tile * cta_rows, cta_rows)
                cols = pl.ds(block * tokens, tokens)

                def epilogue(run_pipeline):
                    @functools.partial(pl.run_scoped, accs=[plgpu.ACC((ROWS_PER_WG, tokens), jnp.float32)
                                                            for _ in range(len(products) * subs)])
                    def _accs(accs):                    # product p's sub-tile `sub`: accs[p * subs + sub]
                        run_pipeline(accs)
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        for sub, wg_rows in enumerate(sub_rows):
                            result = accs[sub][...]
                            if len(products) == 2:
                                result = result * lax.logistic(result) * accs[subs + sub][...]   # silu(gate) * up
                            result = result.astype(out_dtype)
                            if tokens_major_out:                # the tile stored transposed: [tokens, 64 rows]
                                out_smem.at[wg, sub].transpose((1, 0))[...] = result
                                plgpu.commit_smem()
                                plgpu.copy_smem_to_gmem(out_smem.at[wg, sub], out_gmem.at[cols, rows].at[:, wg_rows])
                                continue
                            for part in range(tokens // epilogue_cols):
                                part_cols = slice(part * epilogue_cols, (part + 1) * epilogue_cols)
                                out_smem[wg, sub, part] = result[:, part_cols]
                                plgpu.commit_smem()
                                plgpu.copy_smem_to_gmem(out_smem.at[wg, sub, part],
                                                        out_gmem.at[rows, cols].at[wg_rows, part_cols])

                def step(_, *refs_and_accs):
                    *weights_smem, acts_smem, accs = refs_and_accs
                    tile_scales = []                    # per accumulator: [64, 32], column c holds group c % 8's
                    for i in range(len(accs)):
                        scales_smem = weights_smem[2 * (i // subs) + 1]
                        block = scales_smem.at[:, sub_rows[i % subs]].transpose((1, 0))[...]     # [64, 8]
                        block = plgpu.layout_cast(block, plgpu.Layout.WGMMA)
                        tile_scales.append(jnp.concatenate([block] * (GROUP // GROUPS), axis=1))
                    for g in range(chunks):
                        b = (acts_smem.at[pl.ds(g * GROUP, GROUP), :] if acts_k_major
                             else acts_smem.at[:, pl.ds(g * GROUP, GROUP)].transpose((1, 0)))  # [32, tokens]
                        for i, acc in enumerate(accs):
                            w_smem = weights_smem[2 * (i // subs)]
                            q = w_smem[sub_rows[i % subs], pl.ds(g * GROUP, GROUP)]           # int4 [64, 32]
                            q = plgpu.layout_cast(plgpu.layout_cast(q, plgpu.Layout.WGMMA_UPCAST_4X),
                                                  plgpu.Layout.WGMMA)
                            a = q.astype(jnp.bfloat16) * tile_scales[i]
                            if a_in_shared:
                                a_smem[wg, i, g] = a
                                plgpu.commit_smem()
                                plgpu.wgmma(acc, a_smem.at[wg, i, g], b)
                            else:
                                plgpu.wgmma(acc, a, b)
                    plgpu.wgmma_wait(0)
                    return accs

                @pl.when((expert >= 0) & (expert < num_experts))
                def _run():
                    acts_rows = pl.ds(pl.multiple_of(start_gmem[block], start_multiple), tokens)
                    acts_of_block = acts_gmem.at[:, acts_rows] if acts_k_major else acts_gmem.at[acts_rows, :]
                    operands = []
                    for w_gmem, scales_gmem in zip(weights_gmem[::2], weights_gmem[1::2]):
                        operands += [w_gmem.at[expert, rows, :], scales_gmem.at[expert, :, rows]]
                    pipeline(step, epilogue)(*operands, acts_of_block, allocations=allocations)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    a_scratch = (plgpu.SMEM((CONSUMERS, len(products) * subs, chunks, ROWS_PER_WG, GROUP), jnp.bfloat16,
                            transforms=(plgpu.TilingTransform((8, GROUP)), plgpu.SwizzleTransform(64)))
                 if a_in_shared else plgpu.SMEM((1,), jnp.float32))
    out_shape = (num_blocks * tokens, n) if tokens_major_out else (n, num_blocks * tokens)
    out_tile = ((CONSUMERS, subs, tokens, ROWS_PER_WG) if tokens_major_out
                else (CONSUMERS, subs, tokens // epilogue_cols, ROWS_PER_WG, epilogue_cols))
    call = plgpu.kernel(
        int4_block_matmul_kernel, out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
        grid=(min(config.ctas // cluster, num_blocks * row_tiles // cluster),), grid_names=("sm",),
        **(dict(cluster=(cluster,), cluster_names=("cluster",)) if cluster > 1 else {}), num_threads=CONSUMERS + 1,
        thread_name="wg", compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        scratch_types=dict(out_smem=plgpu.SMEM(out_tile, out_dtype, transforms=out_transforms),
                           a_smem=a_scratch))
    return call(acts, block_expert.astype(jnp.int32), block_start.astype(jnp.int32),
                *(x for pair in products for x in pair))


def int4_block_matmul_reference(acts, block_expert, w, scales, up=None, block_start=None, *,
                                acts_k_major: bool = False, tokens_major_out: bool = False,
                                block_tokens: int = TOKENS):
    """`int4_block_matmul` in f32 XLA (the weights dequantized exactly, each position with its group's scale, then
    rounded to bf16 as the kernel feeds them to wgmma; with `up`, silu(gate) * up in f32); columns (rows with
    tokens_major_out) of empty blocks are 0."""
    check_operands(acts, block_expert, w, scales, acts_k_major, block_tokens, block_start)
    ok = (block_expert >= 0) & (block_expert < w.shape[0])
    e = jnp.where(ok, block_expert, 0)
    a = (acts.T if acts_k_major else acts).astype(jnp.float32)
    if block_start is None:
        a = a.reshape(block_expert.shape[0], block_tokens, -1)
    else:
        a = a[jnp.minimum(block_start[:, None] + jnp.arange(block_tokens)[None, :], a.shape[0] - 1)]

    def product(w, scales):
        dequant = w.astype(jnp.float32) * ref.position_scales(scales)
        dequant = dequant.astype(jnp.bfloat16).astype(jnp.float32)                 # [E, N, K]
        return jnp.einsum("bnk,btk->bnt", dequant[e], a, precision=lax.Precision.HIGHEST)

    out = product(w, scales)
    if up is not None:
        out = jax.nn.silu(out) * product(*up)
    out = jnp.where(ok[:, None, None], out, 0.0)
    out = jnp.transpose(out, (1, 0, 2)).reshape(out.shape[1], -1)                 # [N, R]
    return out.T if tokens_major_out else out
