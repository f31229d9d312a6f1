r"""The mxfp4 indexer logits with the fp8 wgmma's key operand decoded straight into registers, on sm_90a
(issue 4, thirteenth round): a measured alternative to the installed kernel
(``backends/triton/indexer_mx.py``) and to the twelfth round's shared-memory design
(``indexer_async_fp8.py``); not used by the package.

    python tools/indexer_reg_fp8.py            # checks against the installed kernel, then a timing table
    python tools/indexer_reg_fp8.py --once     # two calls at the bench shape, for a profiler:
    ncu -k regex:_mx_reg --launch-skip 1 --launch-count 1 --metrics "$M" \
      python3 tools/indexer_reg_fp8.py --once
    # M='regex:sm__inst_executed_pipe_(alu|fma|fmaheavy|fmalite|lsu|uniform|tensor).*\.sum$,
    #    regex:sm__pipe_(alu|fma|fmaheavy|shared|tensor)_cycles_active\.avg\.pct_of_peak_sustained_active$,
    #    smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum,
    #    smsp__warps_active.avg.per_cycle_active,smsp__warps_eligible.avg.per_cycle_active,
    #    regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'   (one line, no spaces)

Same contract as ``indexer.indexer_logits`` for mxfp4 keys (SPEC §9.3) and an exact-e4m3 q
(``indexer.q_codes``). One Gluon program (one warpgroup) per (token, range of entries), one 64-key tile an
iteration, no shared memory for keys and no barrier in the loop:
- each thread loads its own words straight into registers, one tile ahead: keys r and r + 8 of its warp's 16,
  block c = lane % 4 of each (4 words, one 16-byte load), and the two keys' scale words;
- it builds the (key, block c) tables of ``indexer_async_fp8`` (integer build: exact for blocks within 11
  binades of their key's largest, zero below) and decodes with ``_DECODE9`` (9 instructions a word: one mask
  for both halves);
- the decoded bytes are already the wgmma's A fragment. The fragment's k order is not the key's: logical
  k = 16 j + 4 c + e holds nibble ``physical_k(k)`` = 32 c + 4 j + e, and q (the B operand, in shared
  memory) is loaded in that order, so the dot product is unchanged;
- one K=128 chain of four K=32 fp8 wgmmas, then relu, the weighted head sum and the key's 2**(m - 139). The
  relu is (w / 2)(x + |x|): FADDs on the FMA pipe, not FMNMXs on the ALU pipe, which runs at half the issue
  rate and already carries the decode's PRMT / LOP3 (same bits).
- With ``maxnreg=80`` six programs share a SM; the other programs' tiles hide each one's latency.

Numerics are those of ``indexer_async_fp8`` (the fp8 chain's accumulation: ~1.3e-4 of the row maximum on
realistic scales). The H200 result is in docs/triton.md ("Thirteenth round").
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import indexer_mx_gluon as mx

gl = mx.gl
gluon = mx.gluon

if mx.GLUON_ERROR is None:
    from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

# A word of 8 nibbles -> two int32 of e4m3 bytes (elements 0..3, 4..7): _DECODE with one mask for both halves
_DECODE9 = gl.constexpr(
    "{ .reg .b32 s, m, g, h, w4; shl.b32 w4, $2, 4;"
    " and.b32 s, $2, 0x77777777; prmt.b32 m, $3, $4, s; prmt.b32 g, w4, $2, 0xD9C8;"
    " lop3.b32 $0, m, g, 0x80808080, 0xF8;"
    " shr.u32 h, s, 16; prmt.b32 m, $3, $4, h; prmt.b32 g, w4, $2, 0xFBEA;"
    " lop3.b32 $1, m, g, 0x80808080, 0xF8; }")
_AS_BYTES = gl.constexpr("mov.b32 $0, $1;")


def physical_k(k: torch.Tensor) -> torch.Tensor:
    """The key nibble (0..127) that the A fragment's logical k holds: 32 c + 4 j + e for k = 16 j + 4 c + e.
    The kernel loads q in this order."""
    return 32 * ((k >> 2) & 3) + 4 * (k >> 4) + (k & 3)


@gluon.jit
def _decode9(w, tlo, thi):
    return gl.inline_asm_elementwise(_DECODE9, "=r,=r,r,r,r", [w, tlo, thi], dtype=(gl.int32, gl.int32),
                                     is_pure=True, pack=1)


@gluon.jit
def _as_bytes(x):
    """int32 [.., 4] (one word broadcast over the last dim) -> int8 [.., 4]: its bytes, same register."""
    return gl.inline_asm_elementwise(_AS_BYTES, "=r,r,r,r,r", [x], dtype=gl.int8, is_pure=True, pack=4)


@gluon.jit
def _load_tile(i32_ptr, page, start, scored_end, log2b, page_stride_w, scale_off_w, LW: gl.constexpr,
               BN: gl.constexpr):
    """The tile at ``start`` on ``page``: raw words [BN, 4 (block), 4 (word)] int32 in LW, scale words [BN]
    (-1, UE8M0 NaN, for an invalid key)."""
    in_page, nvalid = mx._geometry(page, start, scored_end, log2b)
    ptr, ok, sptr, row_ok = mx._tile_pointers(i32_ptr, page, in_page, nvalid, page_stride_w, scale_off_w, LW,
                                              BN)
    words = gl.load(ptr, mask=ok, other=0)
    sw = gl.load(sptr, mask=row_ok, other=-1)
    return words, sw


@gluon.jit
def _operand(words, sw, LW: gl.constexpr, LP: gl.constexpr, DOT: gl.constexpr):
    """-> (A [BN, 128] fp8 in DOT, logical k order; the key's factor bits [BN]: 2**(m - 139), NaN if invalid).
    The join / permute / reshape chain only renames registers (tests/tools emulate it in torch)."""
    LT: gl.constexpr = gl.SliceLayout(2, LW)
    blk = gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, LT)), 0)
    m = mx._max_scale(sw)
    d = ((gl.expand_dims(sw, 1) >> (8 * blk)) & 255) - gl.expand_dims(m, 1)
    d8 = d << 3
    tlo = gl.where(d >= -11, mx._TABLE_LO + d8 * 0x01010100, 0)
    thi = gl.where(d >= -11, mx._TABLE_HI + d8 * 0x01010101, 0)
    o0, o1 = _decode9(words, gl.expand_dims(tlo, 2), gl.expand_dims(thi, 2))  # [BN, c, jh]
    x = gl.permute(gl.join(o0, o1), (0, 2, 3, 1))  # [BN, jh, jl, c]
    x = gl.convert_layout(gl.reshape(x, [x.shape[0], 32]), gl.SliceLayout(2, LP))  # chunk 4 j + c
    x, _ = gl.broadcast(gl.expand_dims(x, 2), gl.full([x.shape[0], 32, 4], 0, gl.int32, LP))
    a = gl.convert_layout(gl.reshape(_as_bytes(x), [x.shape[0], 128]), DOT)
    fbits = gl.where(m >= 13, (m - 12) << 23, 1 << gl.maximum(m + 10, 0))
    return a.to(gl.float8e4nv, bitcast=True), gl.where(sw != -1, fbits, 0x7FC00000)


@gluon.jit
def _epilogue(acc, w2, fbits, out_row, start, hi, MMA: gl.constexpr, BN: gl.constexpr):
    """acc [BN, HP] fp32 -> relu, weighted head sum (w2: w / 2), times the key's factor (-inf: invalid),
    stored for entries < hi."""
    ROW: gl.constexpr = gl.SliceLayout(1, MMA)
    fb = gl.convert_layout(fbits, ROW)
    # w2 holds w / 2: w relu(x) = (w / 2)(x + |x|) exactly, an FADD with |x| on the FMA pipe instead of
    # an FMNMX on the ALU pipe (which runs at half the issue rate and carries the decode)
    score = gl.sum((acc + gl.abs(acc)) * gl.expand_dims(w2, 0), axis=1) * fb.to(gl.float32, bitcast=True)
    j = start + gl.arange(0, BN, layout=ROW)
    gl.store(out_row + j, gl.where(fb != 0x7FC00000, score, float("-inf")), mask=j < hi)


@gluon.jit
def _mx_reg_kernel(codes_ptr, w2_ptr, positions, token_request, block_table, stride_bt, i32_ptr,
                   log2b, page_stride_w, scale_off_w, logits, max_entries, chunk, ratio, topk, num_heads,
                   D: gl.constexpr, HP: gl.constexpr, BN: gl.constexpr):
    """One program per (token, range of ``chunk`` entries): the contract of
    ``indexer._indexer_logits_kernel`` for mxfp4 keys and an exact-e4m3 q (``indexer.q_codes``)."""
    gl.static_assert(D == 128)
    gl.static_assert(BN == 64)
    # words [64, 4 (block c), 4 (word)]: keys r, r + 8 of the warp's 16, block c = lane % 4 (the A fragment's)
    LW: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [8, 0, 0]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[64, 4, 4])
    # the A fragment [64, 128] fp8 viewed as [64, 32 (chunk 4 j + c), 4 (e)]
    LP: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [8, 0, 0], [0, 4, 0], [0, 8, 0], [0, 16, 0]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[64, 32, 4])
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, HP, 32])
    DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    KEY_F8: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    QL: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
    t, lo, hi, visible, scored_end, out_row, bt_row = mx._program(
        positions, token_request, block_table, stride_bt, logits, max_entries, chunk, ratio)
    offs = gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
    if visible <= topk:
        mx._store_shortcut(out_row, lo, hi, visible, offs, BN)
    else:
        # the B operand (K-major), in the A fragment's logical k order: column k holds q[physical_k(k)]
        q_smem = mx._q_operand(codes_ptr, t, num_heads, HP, D, QL, KEY_F8, True)
        wh = gl.arange(0, HP, layout=gl.SliceLayout(0, MMA))
        w2 = gl.load(w2_ptr + t * num_heads + wh, mask=wh < num_heads, other=0.0) * 0.5  # see _epilogue
        n = gl.maximum(gl.cdiv(scored_end - lo, BN), 0)
        words, sw = _load_tile(i32_ptr, mx._page(bt_row, lo, scored_end, log2b), lo, scored_end, log2b,
                               page_stride_w, scale_off_w, LW, BN)
        pf = mx._page(bt_row, lo + BN, scored_end, log2b)
        gl.thread_barrier()  # q_smem visible to the warpgroup
        acc = gl.zeros([BN, HP], gl.float32, MMA)
        for i in range(n):
            # the next tile's words (its page loaded an iteration earlier) while this one is decoded
            nwords, nsw = _load_tile(i32_ptr, pf, lo + (i + 1) * BN, scored_end, log2b, page_stride_w,
                                     scale_off_w, LW, BN)
            pf = mx._page(bt_row, lo + (i + 2) * BN, scored_end, log2b)
            a, fbits = _operand(words, sw, LW, LP, DOT)
            tok = warpgroup_mma(a, q_smem.permute((1, 0)), acc, use_acc=False, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[tok])
            _epilogue(acc, w2, fbits, out_row, lo + i * BN, hi, MMA, BN)
            words = nwords
            sw = nsw
        mx._store_tail(out_row, lo, hi, scored_end, offs, BN)


def reg_fp8_logits(q, w, positions, token_request, key_cache, layout, key_block_table, *, topk: int,
                   ratio: int, num_splits: int | None = None, maxnreg: int | None = 80,
                   check_exact: bool = True) -> torch.Tensor:
    """``indexer.indexer_logits`` for mxfp4 keys through ``_mx_reg_kernel``: logits [T, mb*B] fp32.

    q [T, heads <= 64, 128] bf16 (exact e4m3 after ``q_codes``'s shift, else ValueError; ``check_exact=False``
    skips that device sync, e.g. under CUDA-graph capture), w [T, heads] fp32; keys read in place from
    ``key_cache`` (uint8 pages, SPEC §9.3). ``maxnreg`` caps the registers (80: six programs a SM)."""
    codes, w2, logits, splits, chunk = mx.prepare(q, w, layout, key_block_table, num_splits, check_exact)
    _mx_reg_kernel[(q.shape[0], splits)](
        codes, w2, positions, token_request, key_block_table, key_block_table.stride(0),
        *mx.key_args(key_cache, layout), logits, logits.shape[1], chunk, ratio, topk, q.shape[1],
        D=q.shape[2], HP=64, BN=mx.BLOCK_KEYS, num_warps=4, **({"maxnreg": maxnreg} if maxnreg else {}))
    return logits


def main(argv: list[str] | None = None) -> int:
    import indexer_async_fp8

    def rows(inputs):
        async_row = ("twelfth round: async fp8, shared-memory operand (`indexer_async_fp8`)",
                     lambda i: indexer_async_fp8.async_fp8_logits(*inputs, topk=512, ratio=4,
                                                                  check_exact=False))
        return [async_row] + [
            (f"register operand, maxnreg {mr}, splits {sp or 'auto'}",
             lambda i, mr=mr, sp=sp: reg_fp8_logits(*inputs, topk=512, ratio=4, num_splits=sp, maxnreg=mr,
                                                    check_exact=False))
            for mr, sp in ((None, None), (96, None), (80, None), (80, 24))]
    variants = [(f"maxnreg {m}", {"maxnreg": m}) for m in (None, 80)]
    return mx.run_tool(argv, __doc__, "indexer_reg_fp8", reg_fp8_logits, variants, rows, "register operand")


if __name__ == "__main__":
    sys.exit(main())
