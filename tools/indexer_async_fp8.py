r"""The mxfp4 indexer logits as asynchronous fp8 wgmma on sm_90a (issue 4, twelfth round): a measured
alternative to the installed kernel (``backends/triton/indexer_mx.py``), not used by the package.

    python tools/indexer_async_fp8.py            # checks against the installed kernel, then a timing table
    python tools/indexer_async_fp8.py --once     # two calls at the bench shape, for a profiler:
    ncu -k regex:_mx_async --launch-skip 1 --launch-count 1 --metrics \
      smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active \
      python3 tools/indexer_async_fp8.py --once

Same contract as ``indexer.indexer_logits`` for mxfp4 keys (SPEC §9.3) and an exact-e4m3 q
(``indexer.q_codes``): one Gluon program per (token, range of entries), one warpgroup, 64-key tiles:
- a cp.async ring (``stages`` deep) of the raw words [64, 16] int32 and each key's scale word; an invalid
  entry's scale word is copied from a -1 sentinel (UE8M0 255 is NaN, never a real scale), so the decode
  knows it without a block-table load; the refill's page number is loaded one iteration ahead;
- decode by table lookup: key j's block b (d = s_jb - max_b s_jb <= 0) gets an 8-entry table of the e4m3
  bytes of {0, .5, 1, 1.5, 2, 3, 4, 6} x 2**(d + 6). ``fast`` (default) builds it with two integer
  multiply-adds: exact for d >= -11, zero below. Otherwise ``cvt.rn.satfinite`` builds it: exact for
  d >= -14, rounded below. A nibble's magnitude is one PRMT lookup; its sign is a second PRMT in
  sign-replicate mode over {w << 4, w}: 10 instructions a word of 8 nibbles. Both PTX blocks run on CPU
  through ``indexer_mx_gluon.ptx_eval`` in tests/tools. The bytes go to a 2-deep fp8 [64, 128] NVMMA ring;
- one K=128 chain of four K=32 fp8 MMAs per tile (keys = A, q^T = B), issued asynchronously: tile i+1 is
  decoded while tile i's MMA runs, and tile i's epilogue (relu, weighted head sum, the key's 2**(m - 139),
  -inf for invalid entries) runs while tile i+1's MMA runs.

Numerics differ from the installed kernel. The K=128 fp8 chain accumulates at the tensor core's reduced
precision: the H200 measured 2-3e-4 of the row maximum against the installed kernel's exact fp32 sums,
inside SPEC §13's 1e-3 top-k slack. Blocks far below their key's largest are flushed (``fast``) or
rounded. The H200 result and what bounds it are in docs/triton.md ("Twelfth round").
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from indexer_mx_gluon import (  # the pieces shared with indexer_reg_fp8.py
    _TABLE_HI,
    _TABLE_LO,
    BLOCK_KEYS,
    GLUON_ERROR,
    _geometry,
    _max_scale,
    _page,
    _program,
    _q_operand,
    _store_shortcut,
    _store_tail,
    _tile_pointers,
    gl,
    gluon,
    key_args,
    prepare,
    run_tool,
)

if GLUON_ERROR is None:
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )


_CVT4 = gl.constexpr(
    "{ .reg .b16 l, h; cvt.rn.satfinite.e4m3x2.f32 l, $2, $1; cvt.rn.satfinite.e4m3x2.f32 h, $4, $3;"
    " mov.b32 $0, {l, h}; }")


@gluon.jit
def _cvt4(a, b, c, d):
    """four fp32 -> int32 of e4m3 bytes [a, b, c, d] (byte 0 = a), RN, saturating."""
    return gl.inline_asm_elementwise(_CVT4, "=r,f,f,f,f", [a, b, c, d], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _tables(sword, blk):
    """sword int32 (4 UE8M0 bytes), blk int32 -> (T_lo, T_hi, m): e4m3 bytes of {0, .5, 1, 1.5} and
    {2, 3, 4, 6} times 2**(s_blk - m + 6), m = the largest of the four."""
    m = _max_scale(sword)
    d = ((sword >> (8 * blk)) & 255) - m  # <= 0
    f = (gl.maximum(d + 133, 0) << 23).to(gl.float32, bitcast=True)  # 2**(d + 6); 0 below 2**-126
    lo = _cvt4(f * 0.0, f * 0.5, f, f * 1.5)
    hi = _cvt4(f * 2.0, f * 3.0, f * 4.0, f * 6.0)
    return lo, hi, m


_DECODE = gl.constexpr(
    "{ .reg .b32 s, m, g, h, w4; shl.b32 w4, $2, 4;"
    " and.b32 s, $2, 0x7777; prmt.b32 m, $3, $4, s; prmt.b32 g, w4, $2, 0xD9C8;"
    " lop3.b32 $0, m, g, 0x80808080, 0xF8;"
    " shr.u32 h, $2, 16; and.b32 s, h, 0x7777; prmt.b32 m, $3, $4, s; prmt.b32 g, w4, $2, 0xFBEA;"
    " lop3.b32 $1, m, g, 0x80808080, 0xF8; }")


@gluon.jit
def _decode(w, tlo, thi):
    """int32 word of 8 nibbles (element e at bits 4e..4e+3: sign, e1, e0, m) -> two int32 of e4m3 bytes
    (elements 0..3, 4..7), 10 instructions: magnitude = byte (nibble & 7) of the table (tlo, thi), one
    PRMT a half; sign = a second PRMT in sign-replicate mode over {w << 4, w}, whose byte msbs are the
    even and odd elements' sign bits (0x00 / 0xFF a byte), masked into bit 7.
    """
    return gl.inline_asm_elementwise(_DECODE, "=r,=r,r,r,r", [w, tlo, thi], dtype=(gl.int32, gl.int32),
                                     is_pure=True, pack=1)


@gluon.jit
def _issue(i32_ptr, sentinel, raw_ring, sc_ring, stage, page, in_page, nvalid, page_stride_w, scale_off_w,
           L3: gl.constexpr, BN: gl.constexpr, FAST: gl.constexpr):
    """cp.async the raw words and scale words of one tile (page ``page`` from ``in_page``, first nvalid rows
    valid; nvalid <= 0: nothing valid) into ring stage ``stage``; commits one group. An invalid row's words
    are zero-filled and its scale word is copied from ``sentinel`` (-1: UE8M0 255 is NaN, never a real
    scale), which marks it invalid for the decode."""
    ptr, ok, sptr, row_ok = _tile_pointers(i32_ptr, page, in_page, nvalid, page_stride_w, scale_off_w, L3, BN)
    cp.async_copy_global_to_shared(raw_ring.index(stage), ptr, mask=ok)
    LS: gl.constexpr = gl.SliceLayout(2, L3)
    sptr = gl.where(row_ok, sptr, sentinel)
    if FAST:  # one scale word a key ([BN], the two threads of a row share it after the ring's barrier)
        cp.async_copy_global_to_shared(sc_ring.index(stage), sptr)
    else:  # the key's scale word once for each of the thread's two blocks ([BN, 4])
        bs = gl.arange(0, 4, layout=gl.SliceLayout(0, LS))
        sptr2 = gl.expand_dims(sptr, 1) + gl.expand_dims(bs * 0, 0)
        cp.async_copy_global_to_shared(sc_ring.index(stage), sptr2)
    cp.commit_group()


@gluon.jit
def _epilogue(acc, w2, fac, out_row, start, hi, MMA: gl.constexpr, BN: gl.constexpr):
    """acc [BN, HP] fp32 -> scores relu-weighted-summed over heads, times the key's factor (NaN: invalid
    key -> -inf), stored for entries < hi. fac: shared fp32 [BN]."""
    ROW: gl.constexpr = gl.SliceLayout(1, MMA)
    f = fac.load(ROW)
    r = gl.arange(0, BN, layout=ROW)
    score = gl.sum(gl.maximum(acc, 0.0) * gl.expand_dims(w2, 0), axis=1) * f
    j = start + r
    valid = f.to(gl.int32, bitcast=True) != 0x7FC00000
    gl.store(out_row + j, gl.where(valid, score, float("-inf")), mask=j < hi)


@gluon.jit
def _stage(i, lo, refill_page, scored_end, log2b, i32_ptr, sentinel, raw_ring, sc_ring, key_ring, fac_ring,
           q_smem, acc, blk, page_stride_w, scale_off_w, L3: gl.constexpr, LS: gl.constexpr,
           LOUT: gl.constexpr,
           KEY_F8: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, S: gl.constexpr, FAST: gl.constexpr):
    """Refill the ring with tile i + S - 1, decode tile i into key slot i % 2 (its per-key factors into
    fac slot i % 4), issue its wgmma (async)."""
    ip, nv = _geometry(refill_page, lo + (i + S - 1) * BN, scored_end, log2b)
    _issue(i32_ptr, sentinel, raw_ring, sc_ring, (i + S - 1) % S, refill_page, ip, nv, page_stride_w,
           scale_off_w, L3, BN, FAST)
    cp.wait_group(S - 1)
    stage = i % S
    words = raw_ring.index(stage).load(L3)
    if FAST:
        sw = sc_ring.index(stage).load(gl.SliceLayout(1, LS))  # [BN], one word a key
        m = _max_scale(sw)
        d = ((gl.expand_dims(sw, 1) >> (8 * blk)) & 255) - gl.expand_dims(m, 1)
        d8 = d << 3  # the tables by integer arithmetic: exact for d >= -11, flushed to zero below
        tlo = gl.where(d >= -11, _TABLE_LO + d8 * 0x01010100, 0)
        thi = gl.where(d >= -11, _TABLE_HI + d8 * 0x01010101, 0)
        valid = sw != -1
    else:
        sword = sc_ring.index(stage).load(LS)
        tlo, thi, m = _tables(sword, blk)
        valid = sword != -1
    o0, o1 = _decode(words, gl.expand_dims(tlo, 2), gl.expand_dims(thi, 2))
    dec = gl.reshape(gl.join(o0, o1), [BN, 32])
    slot = key_ring.index(i % 2)
    slot.store(gl.convert_layout(dec, LOUT))
    # the key's factor 2**(m - 139) (subnormal below m = 13, exact), NaN for an invalid key
    fbits = gl.where(m >= 13, (m - 12) << 23, 1 << gl.maximum(m + 10, 0))
    fbits = gl.where(valid, fbits, 0x7FC00000)
    if FAST:
        fac_ring.index(i % 4).store(fbits.to(gl.float32, bitcast=True))  # [BN]
    else:
        fac_ring.index(i % 4).store(gl.max(fbits, axis=1).to(gl.float32, bitcast=True))  # [BN]
    fence_async_shared()
    gl.thread_barrier()
    a = slot._reinterpret(gl.float8e4nv, [BN, D], KEY_F8)
    # one K=128 chain of four K=32 fp8 MMAs (no fp32 promotion between them: with max_num_imprecise_acc the
    # partial sums are added by ALU instructions that read the in-flight accumulator, and ptxas serializes)
    return warpgroup_mma(a, q_smem.permute((1, 0)), acc, use_acc=False, is_async=True)


@gluon.jit
def _mx_async_kernel(codes_ptr, w2_ptr, positions, token_request, block_table, stride_bt, i32_ptr, sentinel,
                     log2b, page_stride_w, scale_off_w, logits, max_entries, chunk, ratio, topk, num_heads,
                     D: gl.constexpr, HP: gl.constexpr, BN: gl.constexpr, S: gl.constexpr,
                     FAST: gl.constexpr):
    """One program per (token, range of ``chunk`` entries): the contract of
    ``indexer._indexer_logits_kernel`` for mxfp4 keys and an exact-e4m3 q (``indexer.q_codes``)."""
    gl.static_assert(D == 128)
    gl.static_assert(BN == 64)
    L3: gl.constexpr = gl.BlockedLayout([1, 2, 4], [16, 2, 1], [4, 1, 1], [2, 1, 0])
    LS: gl.constexpr = gl.SliceLayout(2, L3)
    LOUT: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [4, 1], [1, 0])
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, HP, 32])
    KEY_I32: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    KEY_F8: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    FLAT3: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0])
    FLAT2: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    FLAT1: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    QL: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    t, lo, hi, visible, scored_end, out_row, bt_row = _program(
        positions, token_request, block_table, stride_bt, logits, max_entries, chunk, ratio)
    offs = gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
    if visible <= topk:
        _store_shortcut(out_row, lo, hi, visible, offs, BN)
    else:
        q_smem = _q_operand(codes_ptr, t, num_heads, HP, D, QL, KEY_F8, False)  # B operand, K-major
        wh = gl.arange(0, HP, layout=gl.SliceLayout(0, MMA))
        w2 = gl.load(w2_ptr + t * num_heads + wh, mask=wh < num_heads, other=0.0)
        raw_ring = gl.allocate_shared_memory(gl.int32, [S, BN, 4, 4], FLAT3)
        if FAST:
            sc_ring = gl.allocate_shared_memory(gl.int32, [S, BN], FLAT1)
        else:
            sc_ring = gl.allocate_shared_memory(gl.int32, [S, BN, 4], FLAT2)
        key_ring = gl.allocate_shared_memory(gl.int32, [2, BN, 32], KEY_I32)
        fac_ring = gl.allocate_shared_memory(gl.float32, [4, BN], FLAT1)
        n = gl.cdiv(scored_end - lo, BN)
        n = gl.maximum(n, 0)
        # prologue: S - 1 tiles in flight
        for k in gl.static_range(S - 1):
            st = lo + k * BN
            pg = _page(bt_row, st, scored_end, log2b)
            ip, nv = _geometry(pg, st, scored_end, log2b)
            _issue(i32_ptr, sentinel, raw_ring, sc_ring, k, pg, ip, nv, page_stride_w, scale_off_w, L3, BN,
                   FAST)
        gl.thread_barrier()  # q_smem visible to the warpgroup
        blk = gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, LS)), 0)
        acc_a = gl.zeros([BN, HP], gl.float32, MMA)
        acc_b = gl.zeros([BN, HP], gl.float32, MMA)
        # the refill pages, loaded one iteration ahead of their cp.async (a block-table load on the issue's
        # critical path stalls the warp for a global-memory round trip every tile)
        pf_a = _page(bt_row, lo + (S - 1) * BN, scored_end, log2b)
        pf_b = _page(bt_row, lo + S * BN, scored_end, log2b)
        for i in range(0, n, 2):
            nf_a = _page(bt_row, lo + (i + S + 1) * BN, scored_end, log2b)
            nf_b = _page(bt_row, lo + (i + S + 2) * BN, scored_end, log2b)
            # tile i -> acc A; tile i + 1 (past the range: an empty tile, its stores masked) decoded while
            # A's MMA runs -> acc B; A's epilogue while B's MMA runs. Nothing is in flight across the back
            # edge (a loop-carried in-flight accumulator makes ptxas serialize every wgmma).
            tok_a = _stage(i, lo, pf_a, scored_end, log2b, i32_ptr, sentinel, raw_ring, sc_ring, key_ring,
                           fac_ring, q_smem, acc_a, blk, page_stride_w, scale_off_w, L3, LS, LOUT, KEY_F8,
                           BN, D, S, FAST)
            tok_b = _stage(i + 1, lo, pf_b, scored_end, log2b, i32_ptr, sentinel, raw_ring, sc_ring, key_ring,
                           fac_ring, q_smem, acc_b, blk, page_stride_w, scale_off_w, L3, LS, LOUT, KEY_F8,
                           BN, D, S, FAST)
            acc_a = warpgroup_mma_wait(1, deps=[tok_a])
            _epilogue(acc_a, w2, fac_ring.index(i % 4), out_row, lo + i * BN, hi, MMA, BN)
            acc_b = warpgroup_mma_wait(0, deps=[tok_b])
            _epilogue(acc_b, w2, fac_ring.index((i + 1) % 4), out_row, lo + (i + 1) * BN, hi, MMA, BN)
            pf_a = nf_a
            pf_b = nf_b
        cp.wait_group(0)
        _store_tail(out_row, lo, hi, scored_end, offs, BN)


def async_fp8_logits(q, w, positions, token_request, key_cache, layout, key_block_table, *, topk: int,
                     ratio: int, num_splits: int | None = None, stages: int = 4, fast: bool = True,
                     check_exact: bool = True) -> torch.Tensor:
    """``indexer.indexer_logits`` for mxfp4 keys through ``_mx_async_kernel``: logits [T, mb*B] fp32.

    q [T, heads <= 64, 128] bf16 (exact e4m3 after ``q_codes``'s shift, else ValueError: the bf16 path is not
    here; ``check_exact=False`` skips that device sync, e.g. under CUDA-graph capture), w [T, heads] fp32;
    keys read in place from ``key_cache`` (uint8 pages, SPEC §9.3)."""
    codes, w2, logits, splits, chunk = prepare(q, w, layout, key_block_table, num_splits, check_exact)
    i32, log2b, page_stride_w, scale_off_w = key_args(key_cache, layout)
    _mx_async_kernel[(q.shape[0], splits)](
        codes, w2, positions, token_request, key_block_table, key_block_table.stride(0),
        i32, torch.full((4,), -1, dtype=torch.int32, device=q.device), log2b, page_stride_w, scale_off_w,
        logits, logits.shape[1], chunk, ratio, topk, q.shape[1],
        D=q.shape[2], HP=64, BN=BLOCK_KEYS, S=stages, FAST=fast, num_warps=4)
    return logits


def main(argv: list[str] | None = None) -> int:
    variants = [(f"{'integer' if fast else 'cvt'} tables, stages {stages}", {"fast": fast, "stages": stages})
                for fast, stages in ((False, 2), (False, 4), (True, 2), (True, 4))]

    def rows(inputs):
        configs = ((False, 4, 8), (True, 4, None), (True, 4, 16), (True, 6, 16), (True, 8, 16), (True, 2, 12))
        return [((f"async fp8 logits, {'integer' if fast else 'cvt'} tables, stages {st}, "
                  f"splits {sp or 'auto'}"),
                 lambda i, st=st, sp=sp, fast=fast: async_fp8_logits(
                     *inputs, topk=512, ratio=4, stages=st, num_splits=sp, fast=fast, check_exact=False))
                for fast, st, sp in configs]
    return run_tool(argv, __doc__, "indexer_async_fp8", async_fp8_logits, variants, rows, "async")


if __name__ == "__main__":
    sys.exit(main())
