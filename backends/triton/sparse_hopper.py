"""Sparse MQA on Hopper (sm_90a): warp-specialized Gluon kernels (SPEC §7), FlashMLA's division of work.

The same function as ``sparse_attention._sparse_attention_kernel`` with bf16 probabilities (``deepseek``
and ``vllm``, SPEC §6.6) for two page formats: fp8_ds_mla records (SPEC §9.1, the decode path) and bf16
rows of 512 (SPEC §9.2, the prefill path). SWA list + extra list, -1 entries skipped, the sink in the
denominator only, lse without it, split partials merged by the Triton ``_combine_kernel``.
``sparse_attention.sparse_attention`` dispatches here when ``hopper_dispatch.hopper_unsupported`` finds
nothing against it, else it runs the Triton kernel. Gluon kernels do not run under the interpreter: the
H200 checks are in tools/gpu_check.py; CI checks the dispatch.

One program per (token, 64-head block, key split), three roles sharing 201 KB of shared memory
(q ``[64, 512]`` bf16, a 2-deep ring of ``[64, 512]`` bf16 K tiles, P ``[64, 64]`` bf16):
- the producer (4 warps) fills the ring one 64-key tile at a time as slots free up (``k_free``):
  bf16 rows by cp.async straight into the wgmma operand layout, each thread's copies arriving on
  ``k_ready`` themselves when they land (cp.async.mbarrier.arrive.noinc; invalid rows zero-fill);
  fp8 records through registers (``sparse_fp8_producer``: gathers, exact bit-level dequantization,
  one arrival a tile);
- warpgroup 0 (the default partition): S = q K^T for all 64 keys (computed once), the online softmax
  (fp32 statistics in the log2 domain), bf16 P, O[:, 0:128] += P V; the next tile's key validity is
  loaded a tile ahead; P and the row rescale go to warpgroup 1 through shared memory;
- warpgroup 1 (232 registers): O[:, 128:512] += P V (an N=128 and an N=256 wgmma).
H200 numbers against FlashMLA and the portable Triton kernel: docs/triton.md, "Current H200 numbers" (kept
there only, so that each run updates one place; raw output in docs/h200/gpu_check.json).
"""
from __future__ import annotations

import torch
from dsv4.backends.triton.hopper_dispatch import BLOCK_HEADS, BLOCK_KEYS
from dsv4.backends.triton.sparse_fp8_producer import _fp8_producer, _list_position, cta_barrier
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma

# cp.async global -> shared: ``async_copy_global_to_shared`` up to Triton 3.8, renamed ``async_load`` in 3.9
async_load = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared

__all__ = ["sparse_hopper"]

_BH, _BN = BLOCK_HEADS, BLOCK_KEYS  # heads a program (the wgmma M), keys a tile (host side: hopper_dispatch)
_STAGES = 2  # K ring depth
_WG0_COLS = 128  # output columns of warpgroup 0 (it also computes S and the softmax)
_PRODUCER_WARPS, _WG1_REGS = 4, 232
_PRODUCER_REGS = {False: 56, True: 112}  # bf16 rows (cp.async) / fp8 records (register gathers, dequant)
_FP8_UNITS = 4  # the fp8 producer's register units a tile (16 rows each)


@gluon.jit
def _tile_slots(tile, n_swa, swa_row, ext_row, swa_len, ext_len, BN: gl.constexpr, LAYOUT: gl.constexpr,
                HAS_EXTRA: gl.constexpr):
    """[BN] int32 slots of virtual tile ``tile`` (SWA tiles, then extra tiles) in ``LAYOUT`` and [BN]
    validity (in the list and not -1, SPEC §10): entries past the list load as -1, so ``slots >= 0`` alone
    is the validity (an extra ``in_list &`` cost ~300 SASS instructions a kernel on sm_90a)."""
    idx_row, local, length = _list_position(tile, n_swa, swa_row, ext_row, swa_len, ext_len, HAS_EXTRA)
    j = local * BN + gl.arange(0, BN, layout=LAYOUT)
    in_list = j < length
    slots = gl.load(idx_row + j, mask=in_list, other=-1)
    return slots, slots >= 0


@gluon.jit
def _rows_producer(lo, hi, n_swa, swa_row, ext_row, swa_len, ext_len, swa_rows, ext_rows, k_ring, k_ready, k_free,
                   SWA_LOG2B: gl.constexpr, SWA_PAGE: gl.constexpr, EXT_LOG2B: gl.constexpr,
                   EXT_PAGE: gl.constexpr, TOKEN_STRIDE: gl.constexpr, ROW_OFF: gl.constexpr,
                   HAS_EXTRA: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr):
    """bf16 rows: cp.async tile after tile into the ring as slots free up; the copies arrive on k_ready
    themselves (count: the producer threads). Page strides, token stride and row offset in BYTES; a row
    is 512 contiguous bf16 (16-byte copies); ``*_rows`` are bf16 views."""
    nw: gl.constexpr = gl.num_warps()
    CP: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [nw, 1], [1, 0])
    cols = gl.arange(0, 512, layout=gl.SliceLayout(0, CP))
    for tile in range(lo, hi):
        r = tile - lo
        s = r % STAGES
        mbarrier.wait(k_free.index(s), ((r // STAGES) - 1) & 1, pred=r >= STAGES)  # tile r - STAGES released
        in_swa = tile < n_swa
        if HAS_EXTRA:
            base = gl.where(in_swa, swa_rows, ext_rows)
            log2b = gl.where(in_swa, SWA_LOG2B, EXT_LOG2B)
            page_stride = gl.where(in_swa, SWA_PAGE, EXT_PAGE)
        else:
            base = swa_rows
            log2b = SWA_LOG2B
            page_stride = SWA_PAGE
        slots, valid = _tile_slots(tile, n_swa, swa_row, ext_row, swa_len, ext_len, BN, gl.SliceLayout(1, CP),
                                   HAS_EXTRA)
        safe = gl.where(valid, slots, 0)
        page = (safe >> log2b).to(gl.int64)
        in_page = (safe & ((1 << log2b) - 1)).to(gl.int64)
        row = page * (page_stride // 2) + in_page * (TOKEN_STRIDE // 2) + ROW_OFF // 2
        async_load(k_ring.index(s), base + gl.expand_dims(row, 1) + gl.expand_dims(cols, 0),
                   mask=gl.expand_dims(valid, 1))
        cp.mbarrier_arrive(k_ready.index(s), increment_count=False)
    cp.wait_group(0)


@gluon.jit
def _store_cols(acc, factor, t64, head_block, split, out_ptr, stride_ot, stride_oh, part_acc, num_heads,
                COL0: gl.constexpr, N: gl.constexpr, BH: gl.constexpr, NUM_SPLITS: gl.constexpr,
                MMA: gl.constexpr):
    """Columns [COL0, COL0 + N) of a head block: out = acc * factor (bf16), or the raw split partial."""
    heads = head_block * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, MMA))
    head_ok = gl.expand_dims(heads < num_heads, 1)
    cols = COL0 + gl.arange(0, N, layout=gl.SliceLayout(0, MMA))
    if NUM_SPLITS == 1:
        optr = out_ptr + t64 * stride_ot + gl.expand_dims(heads, 1) * stride_oh + gl.expand_dims(cols, 0)
        gl.store(optr, (acc * gl.expand_dims(factor, 1)).to(gl.bfloat16), mask=head_ok)
    else:
        row = (t64 * num_heads + heads) * NUM_SPLITS + split
        gl.store(part_acc + gl.expand_dims(row, 1) * 512 + gl.expand_dims(cols, 0), acc, mask=head_ok)


@gluon.jit
def _warpgroup1(lo, hi, t64, head_block, split, out_ptr, stride_ot, stride_oh, part_acc, num_heads, k_ring,
                p_smem, row_smem, k_free, p_ready, p_free, fin_ready, BH: gl.constexpr, STAGES: gl.constexpr,
                NUM_SPLITS: gl.constexpr, C0: gl.constexpr, ASYNC_ROWS: gl.constexpr):
    """O[:, C0:256] and O[:, 256:512] += P V with P and the row rescale handed over by warpgroup 0.
    ASYNC_ROWS: the ring's rows came from cp.async (see ``_warpgroup0``)."""
    NA: gl.constexpr = 256 - C0
    MMA_A: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NA, 16])
    MMA_B: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    acc_a = gl.zeros([BH, NA], gl.float32, MMA_A)
    acc_b = gl.zeros([BH, 256], gl.float32, MMA_B)
    for tile in range(lo, hi):
        r = tile - lo
        s = r % STAGES
        mbarrier.wait(p_ready, r & 1)
        if ASYNC_ROWS:
            fence_async_shared()  # the ring's rows came from cp.async (generic proxy); wgmma reads them
        acc_a = acc_a * gl.expand_dims(row_smem.index(0).load(gl.SliceLayout(1, MMA_A)), 1)
        acc_a = warpgroup_mma(p_smem, k_ring.index(s).slice(C0, NA, dim=1), acc_a)
        acc_b = acc_b * gl.expand_dims(row_smem.index(0).load(gl.SliceLayout(1, MMA_B)), 1)
        acc_b = warpgroup_mma(p_smem, k_ring.index(s).slice(256, 256, dim=1), acc_b)
        cta_barrier()
        mbarrier.arrive(p_free, count=1)
        mbarrier.arrive(k_free.index(s), count=1)
    mbarrier.wait(fin_ready, 0)
    _store_cols(acc_a, row_smem.index(1).load(gl.SliceLayout(1, MMA_A)), t64, head_block, split, out_ptr,
                stride_ot, stride_oh, part_acc, num_heads, C0, NA, BH, NUM_SPLITS, MMA_A)
    _store_cols(acc_b, row_smem.index(1).load(gl.SliceLayout(1, MMA_B)), t64, head_block, split, out_ptr,
                stride_ot, stride_oh, part_acc, num_heads, 256, 256, BH, NUM_SPLITS, MMA_B)


@gluon.jit
def _warpgroup0(lo, hi, n_swa, swa_row, ext_row, swa_len, ext_len, t64, head_block, split, sink_ptr, out_ptr,
                stride_ot, stride_oh, lse_ptr, part_acc, part_ml, num_heads, scale_log2, q_smem, k_ring, p_smem,
                row_smem, k_ready, k_free, p_ready, p_free, fin_ready, BH: gl.constexpr, BN: gl.constexpr,
                STAGES: gl.constexpr, HAS_EXTRA: gl.constexpr, NUM_SPLITS: gl.constexpr, C0: gl.constexpr,
                ASYNC_ROWS: gl.constexpr):
    """S = q K^T, softmax, O[:, 0:C0] += P V; P and the rescale to warpgroup 1; the epilogue (SPEC §7).

    ASYNC_ROWS: the ring's rows came from cp.async, whose writes no producer-side fence can order, so each
    consumer fences (generic -> async proxy) after its wait; the fp8 producer stores with st.shared and
    fences before it arrives, so its consumers do not."""
    MMA_S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    MMA_O: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, C0, 16])
    P_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA_O, k_width=2)
    ROW: gl.constexpr = gl.SliceLayout(1, MMA_O)
    KEYS: gl.constexpr = gl.SliceLayout(0, MMA_S)
    m_i = gl.full([BH], float("-inf"), gl.float32, gl.SliceLayout(1, MMA_S))
    l_i = gl.zeros([BH], gl.float32, gl.SliceLayout(1, MMA_S))
    acc = gl.zeros([BH, C0], gl.float32, MMA_O)
    s_zero = gl.zeros([BH, BN], gl.float32, MMA_S)
    _, valid_next = _tile_slots(lo, n_swa, swa_row, ext_row, swa_len, ext_len, BN, KEYS, HAS_EXTRA)
    for tile in range(lo, hi):
        r = tile - lo
        s = r % STAGES
        k_cur = k_ring.index(s)
        valid = valid_next
        _, valid_next = _tile_slots(tile + 1, n_swa, swa_row, ext_row, swa_len, ext_len, BN, KEYS, HAS_EXTRA)
        mbarrier.wait(k_ready.index(s), (r // STAGES) & 1)
        if ASYNC_ROWS:
            fence_async_shared()  # the ring's rows came from cp.async (generic proxy); wgmma reads them
        sc = warpgroup_mma(q_smem, k_cur.permute((1, 0)), s_zero, use_acc=False)
        sc = gl.where(gl.expand_dims(valid, 0), sc, float("-inf"))
        # log2 domain: max(s) * c = max(s * c) (c > 0), and s * c - m is one FMA a score.
        m_new = gl.maximum(m_i, gl.max(sc, axis=1) * scale_log2)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(sc * scale_log2 - gl.expand_dims(m_safe, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)  # the denominator sums fp32 probabilities (SPEC §6.6)
        pb = p.to(gl.bfloat16)  # deepseek: bf16 probabilities, RNE
        alpha_o = gl.convert_layout(alpha, ROW)
        mbarrier.wait(p_free, (r - 1) & 1, pred=r >= 1)  # warpgroup 1 is done with the previous P
        p_smem.store(pb)
        row_smem.index(0).store(alpha_o)
        fence_async_shared()
        cta_barrier()
        mbarrier.arrive(p_ready, count=1)
        acc = acc * gl.expand_dims(alpha_o, 1)
        acc = warpgroup_mma(gl.convert_layout(pb, P_OP), k_cur.slice(0, C0, dim=1), acc)
        m_i = m_new
        cta_barrier()
        mbarrier.arrive(k_free.index(s), count=1)
    l_i = gl.convert_layout(l_i, ROW)
    m_o = gl.convert_layout(m_i, ROW)
    heads = head_block * BH + gl.arange(0, BH, layout=ROW)
    head_ok = heads < num_heads
    empty = l_i == 0.0
    m_safe = gl.where(empty, 0.0, m_o)
    if NUM_SPLITS == 1:
        # SPEC §7: the sink joins the denominator, lse excludes it; empty set -> out 0, lse +inf.
        sink = gl.load(sink_ptr + heads, mask=head_ok, other=float("-inf")) * 1.4426950408889634
        top = gl.maximum(m_safe, sink)
        denominator = l_i * gl.exp2(m_safe - top) + gl.exp2(sink - top)
        factor = gl.where(empty, 0.0, gl.exp2(m_safe - top) / denominator)
        lse = gl.where(empty, float("inf"), (m_safe + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453)
        gl.store(lse_ptr + t64 * num_heads + heads, lse, mask=head_ok)
    else:
        factor = gl.full([BH], 1.0, gl.float32, ROW)
        row = (t64 * num_heads + heads) * NUM_SPLITS + split
        gl.store(part_ml + row * 2, m_o, mask=head_ok)
        gl.store(part_ml + row * 2 + 1, l_i, mask=head_ok)
    mbarrier.wait(p_free, (hi - lo - 1) & 1, pred=hi > lo)  # warpgroup 1 no longer reads row_smem[0] / P
    row_smem.index(1).store(factor)
    cta_barrier()
    mbarrier.arrive(fin_ready, count=1)
    _store_cols(acc, factor, t64, head_block, split, out_ptr, stride_ot, stride_oh, part_acc, num_heads, 0, C0, BH,
                NUM_SPLITS, MMA_O)


@gluon.jit
def _sparse_hopper_kernel(
        q_ptr, stride_qt, stride_qh,
        swa_pages, swa_words, swa_idx, swa_idx_stride, swa_lens,
        ext_pages, ext_words, ext_idx, ext_idx_stride, ext_lens,
        sink_ptr, out_ptr, stride_ot, stride_oh, lse_ptr, part_acc, part_ml,
        num_heads, swa_width, ext_width, scale_log2,
        SWA_LOG2B: gl.constexpr, SWA_PAGE: gl.constexpr, SWA_SCALE_OFF: gl.constexpr,
        EXT_LOG2B: gl.constexpr, EXT_PAGE: gl.constexpr, EXT_SCALE_OFF: gl.constexpr,
        TOKEN_STRIDE: gl.constexpr, NOPE_OFF: gl.constexpr, ROPE_OFF: gl.constexpr, SCALE_STRIDE: gl.constexpr,
        NOPE_CHUNKS: gl.constexpr, FP8: gl.constexpr, HAS_EXTRA: gl.constexpr, BH: gl.constexpr, BN: gl.constexpr,
        NUM_SPLITS: gl.constexpr,
        STAGES: gl.constexpr, C0: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
        WG1_REGS: gl.constexpr, FP8_UNITS: gl.constexpr):
    """Grid (T, cdiv(H, 64), NUM_SPLITS), 4 warps + warpgroup 1 + producer warps.

    q [T,H,512] bf16 at any token and head strides (unit last stride; offsets int64); pages: fp8 records
    as int32 (``*_pages``) and int64 (``*_words``) views of the uint8 pages, bf16 rows as bf16 views
    (both arguments); geometry and record offsets in bytes;
    indices [T,W] int32 global slots; lens [T] int32; sink [H] fp32; out [T,H,512] bf16; lse [T,H]
    fp32; with splits, part_acc [T*H*NUM_SPLITS, 512] fp32 and part_ml [T*H*NUM_SPLITS, 2] fp32.
    """
    D: gl.constexpr = 512
    Q_BL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
    OPERAND: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, D], gl.bfloat16)
    P_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, BN], gl.bfloat16)
    ROW_SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

    t = gl.program_id(0)
    head_block = gl.program_id(1)
    split = gl.program_id(2)
    t64 = t.to(gl.int64)
    swa_len = gl.minimum(gl.load(swa_lens + t), swa_width)
    n_swa = gl.cdiv(swa_len, BN)
    if HAS_EXTRA:
        ext_len = gl.minimum(gl.load(ext_lens + t), ext_width)
    else:
        ext_len = 0
    total = n_swa + gl.cdiv(ext_len, BN)
    per_split = gl.cdiv(total, NUM_SPLITS)
    lo = split * per_split
    hi = gl.minimum(lo + per_split, total)
    swa_row = swa_idx + t64 * swa_idx_stride
    ext_row = ext_idx + t64 * ext_idx_stride

    qh = head_block * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, Q_BL))
    qc = gl.arange(0, D, layout=gl.SliceLayout(0, Q_BL))
    qh64 = qh.to(gl.int64)  # a head-major q (stride_qh = T * 512): head offsets pass 2**31 at long T
    q = gl.load(q_ptr + t64 * stride_qt + gl.expand_dims(qh64, 1) * stride_qh + gl.expand_dims(qc, 0),
                mask=gl.expand_dims(qh < num_heads, 1), other=0.0)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, D], OPERAND, q)
    k_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, D], OPERAND)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, BN], P_SL)
    row_smem = gl.allocate_shared_memory(gl.float32, [2, BH], ROW_SL)  # [0] row rescale, [1] final factor
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    p_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    fin_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        # fp8: one arrival a tile after the producer's barrier; rows: one a producer thread (its copies)
        mbarrier.init(k_ready.index(i), count=1 if FP8 else PRODUCER_WARPS * 32)
        mbarrier.init(k_free.index(i), count=2)  # both warpgroups
    mbarrier.init(p_ready, count=1)
    mbarrier.init(p_free, count=1)
    mbarrier.init(fin_ready, count=1)
    fence_async_shared()
    cta_barrier()

    # (Gluon takes the partitions as literal (function, args) pairs: one call per producer kind.)
    if FP8:
        gl.warp_specialize([
            (_warpgroup0, (lo, hi, n_swa, swa_row, ext_row, swa_len, ext_len, t64, head_block, split, sink_ptr,
                           out_ptr, stride_ot, stride_oh, lse_ptr, part_acc, part_ml, num_heads, scale_log2,
                           q_smem, k_ring, p_smem, row_smem, k_ready, k_free, p_ready, p_free, fin_ready, BH, BN,
                           STAGES, HAS_EXTRA, NUM_SPLITS, C0, False)),
            (_warpgroup1, (lo, hi, t64, head_block, split, out_ptr, stride_ot, stride_oh, part_acc, num_heads,
                           k_ring, p_smem, row_smem, k_free, p_ready, p_free, fin_ready, BH, STAGES, NUM_SPLITS, C0,
                           False)),
            (_fp8_producer, (lo, hi, n_swa, swa_row, ext_row, swa_len, ext_len, swa_pages, ext_pages, swa_words,
                             ext_words, k_ring, k_ready, k_free, SWA_LOG2B, SWA_PAGE, SWA_SCALE_OFF, EXT_LOG2B,
                             EXT_PAGE, EXT_SCALE_OFF, TOKEN_STRIDE, NOPE_OFF, ROPE_OFF, SCALE_STRIDE, NOPE_CHUNKS,
                             HAS_EXTRA, BN, STAGES, FP8_UNITS)),
        ], [4, PRODUCER_WARPS], [WG1_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_warpgroup0, (lo, hi, n_swa, swa_row, ext_row, swa_len, ext_len, t64, head_block, split, sink_ptr,
                           out_ptr, stride_ot, stride_oh, lse_ptr, part_acc, part_ml, num_heads, scale_log2,
                           q_smem, k_ring, p_smem, row_smem, k_ready, k_free, p_ready, p_free, fin_ready, BH, BN,
                           STAGES, HAS_EXTRA, NUM_SPLITS, C0, True)),
            (_warpgroup1, (lo, hi, t64, head_block, split, out_ptr, stride_ot, stride_oh, part_acc, num_heads,
                           k_ring, p_smem, row_smem, k_free, p_ready, p_free, fin_ready, BH, STAGES, NUM_SPLITS, C0,
                           True)),
            (_rows_producer, (lo, hi, n_swa, swa_row, ext_row, swa_len, ext_len, swa_pages, ext_pages, k_ring,
                              k_ready, k_free, SWA_LOG2B, SWA_PAGE, EXT_LOG2B, EXT_PAGE, TOKEN_STRIDE, NOPE_OFF,
                              HAS_EXTRA, BN, STAGES)),
        ], [4, PRODUCER_WARPS], [WG1_REGS, PRODUCER_REGS])


def sparse_hopper(q: torch.Tensor, swa_cache: torch.Tensor, swa_layout, swa_indices: torch.Tensor,
                  swa_lens: torch.Tensor, ext_cache: torch.Tensor, ext_layout, ext_indices: torch.Tensor,
                  ext_lens: torch.Tensor, has_extra: bool, sink: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  part_acc: torch.Tensor, part_ml: torch.Tensor, *, scale_log2: float, num_splits: int) -> None:
    """Launch into ``out`` / ``lse`` (or the split partials). Inputs validated by the caller
    (``hopper_dispatch.hopper_unsupported`` is None for these layouts); caches are the uint8/bf16 page
    tensors with their ``LatentLayout``; scale_log2 = softmax_scale * log2(e)."""
    num_tokens, num_heads, _ = q.shape
    fp8 = swa_layout.fp8_nope
    views = []
    for cache, lay in ((swa_cache, swa_layout), (ext_cache, ext_layout)):
        u8, bf16 = lay.byte_views(cache)
        views.append((u8.view(torch.int32), u8.view(torch.int64)) if fp8 else (bf16, bf16))
    _sparse_hopper_kernel[(num_tokens, -(-num_heads // _BH), num_splits)](
        q, q.stride(0), q.stride(1),
        *views[0], swa_indices, swa_indices.stride(0), swa_lens,
        *views[1], ext_indices, ext_indices.stride(0), ext_lens,
        sink, out, out.stride(0), out.stride(1), lse, part_acc, part_ml,
        num_heads, swa_indices.shape[1], ext_indices.shape[1] if has_extra else 0, scale_log2,
        SWA_LOG2B=swa_layout.block_size.bit_length() - 1, SWA_PAGE=swa_layout.page_stride,
        SWA_SCALE_OFF=swa_layout.scale_offset, EXT_LOG2B=ext_layout.block_size.bit_length() - 1,
        EXT_PAGE=ext_layout.page_stride, EXT_SCALE_OFF=ext_layout.scale_offset,
        TOKEN_STRIDE=swa_layout.token_stride, NOPE_OFF=swa_layout.nope_offset, ROPE_OFF=swa_layout.rope_offset,
        SCALE_STRIDE=swa_layout.scale_stride, NOPE_CHUNKS=swa_layout.nope_dim // swa_layout.quant_block, FP8=fp8,
        HAS_EXTRA=has_extra, BH=_BH, BN=_BN,
        NUM_SPLITS=num_splits, STAGES=_STAGES, C0=_WG0_COLS, PRODUCER_WARPS=_PRODUCER_WARPS,
        PRODUCER_REGS=_PRODUCER_REGS[fp8], WG1_REGS=_WG1_REGS, FP8_UNITS=_FP8_UNITS, num_warps=4)
