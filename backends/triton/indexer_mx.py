"""mxfp4 indexer keys on the bf16 tensor cores (SPEC §6.3, §9.3): ``_mx_tiles`` scores a token's range of
entries for ``indexer._indexer_logits_kernel`` when q is exactly e4m3 (see ``indexer._q_codes_kernel``).

Per 64-key tile: the packed nibbles are decoded with their UE8M0 block scales straight into bf16 (or
fp16) operand registers by integer ops and one packed multiply (``_mx_keys``), then ONE K=128 MMA with
fp32 accumulation, relu and the weighted head sum; products are exact and sums fp32 (the precision of
the per-block fp8 kernel it replaces). Keys are normalised to their largest block scale (a power of two
applied to the score), so blocks within 133 binades (fp16: 24) of a key's largest are exact.

``_mx_tiles_scaled``: the same scores through ``tl.dot_scaled``, keys and scale bytes as they lie in the
page; the default where the device has block-scaled MMAs (sm_100 / sm_103, gfx950), where no key is decoded.
"""
from __future__ import annotations

import re

import triton
import triton.language as tl
from dsv4.backends.triton._common import decode_e4m3, pow2_from_exponent

__all__ = ["RUNTIME_ZERO_ACC", "_key_rows", "_mx_tiles", "_mx_tiles_scaled"]

# Triton's zero-accumulator rewrite fails on the sm_100 block-scaled MMA before 3.9 ("uninitialized alloc
# must have a mutable memdesc"; 3.6, 3.7.1 and 3.8.0 checked with tools/target_isa.py --zero-acc constant);
# 3.9 compiles it. Before 3.9 _mx_tiles_scaled starts each tile from a runtime zero, which costs a register
# fill and a tensor-memory store a tile (64 register moves and one STTM in sm_100 SASS).
RUNTIME_ZERO_ACC = tl.constexpr(tuple(int(v) for v in re.findall(r"\d+", triton.__version__)[:2]) < (3, 9))


@triton.jit
def _mul_x2(x, f, FP16: tl.constexpr):
    """int32 words of bf16 (FP16: fp16) pairs x times pairs f: one packed, singly rounded product (GPU).
    bf16 is ``fma.rn.bf16x2 x, f, -0`` (sm_80+; ``mul.rn.bf16x2`` needs sm_90): adding -0 keeps every
    product, the sign of a zero included, so both give the same bits."""
    if FP16:
        return tl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [x, f], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        neg_zero = tl.full(x.shape, -2147450880, tl.int32)  # 0x80008000: -0.0 in both bf16 halves
        return tl.inline_asm_elementwise("fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r", [x, f, neg_zero],
                                         dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _half_value(h, FP16: tl.constexpr):
    """int32 holding 16 bf16 (FP16: fp16) bits -> fp32 value (the interpreter's emulation)."""
    if FP16:
        return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        return (h << 16).to(tl.float32, bitcast=True)


@triton.jit
def _mx_keys(words, f2, BN: tl.constexpr, FP16: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """int32 words [BN, 16] of packed mxfp4 nibbles, f2 [BN, 4] int32 (block t's factor in both halves)
    -> operand values e2m1 * 2**X * factor, [BN, 4 (t), 32 (i, g1, g0, h)], bf16 (X = -126) or FP16
    (X = -14); fp32 under the interpreter (same values).

    Integer decode: nibble s.e1e0.m -> bits s, e1e0 in the exponent's two low bits, m in the mantissa's
    top bit (exact for normal and subnormal codes: e2m1 0.5 is the subnormal 2**(X-1)). Nibbles g and
    g + 4 of a word make one pair (2 shifts + 2 logic ops), scaled by one packed multiply. Word 4t + i,
    nibble n = 4h + g (g = 2 g1 + g0) is element e = 32t + 8i + n (block t); it becomes operand column
    k = 32i + 16g1 + 8g0 + 2t + h (``_mx_tile``), which the thread holding the word owns in the wgmma A
    fragment (lane % 4 = t holds columns 2t, 2t+1, 2t+8, 2t+9 of each 16): no data moves between threads.
    """
    sgn = -2147450880  # 0x80008000
    if FP16:
        mant = 0x0E000E00
        p0 = ((words << 9) & mant) | ((words << 12) & sgn)  # nibbles 0 (low half) and 4 (high half)
        p1 = ((words << 5) & mant) | ((words << 8) & sgn)
        p2 = ((words << 1) & mant) | ((words << 4) & sgn)
        p3 = ((words >> 3) & mant) | (words & sgn)
    else:
        mant = 0x01C001C0
        p0 = ((words << 6) & mant) | ((words << 12) & sgn)
        p1 = ((words << 2) & mant) | ((words << 8) & sgn)
        p2 = ((words >> 2) & mant) | ((words << 4) & sgn)
        p3 = ((words >> 6) & mant) | (words & sgn)
    g = tl.reshape(tl.join(tl.join(p0, p2), tl.join(p1, p3)), (BN, 4, 4, 2, 2))  # [BN, t, i, g1, g0]
    f = f2[:, :, None, None, None]
    if DOT_DTYPE == tl.float32:  # interpreter
        lo = _half_value(g & 0xFFFF, FP16) * _half_value(f & 0xFFFF, FP16)
        hi = _half_value((g >> 16) & 0xFFFF, FP16) * _half_value((f >> 16) & 0xFFFF, FP16)
        if FP16:  # the fp16 grid, as the GPU rounds
            lo = lo.to(tl.float16).to(tl.float32)
            hi = hi.to(tl.float16).to(tl.float32)
        return tl.reshape(tl.join(lo, hi), (BN, 4, 32))
    else:
        g = _mul_x2(g, f, FP16)
        pair = tl.join(g.to(tl.int16), (g >> 16).to(tl.int16))  # the two halves of one register
        if FP16:
            return tl.reshape(pair.to(tl.float16, bitcast=True), (BN, 4, 32))
        else:
            return tl.reshape(pair.to(tl.bfloat16, bitcast=True), (BN, 4, 32))


@triton.jit
def _mx_tile(words, sword, q16, w2, BN: tl.constexpr, D: tl.constexpr, FP16: tl.constexpr,
             DOT_DTYPE: tl.constexpr):
    """[BN] scores of one mxfp4 key tile: words int32 [BN, D/8] (packed nibbles, tile-row order), sword
    int32 [BN] (4 UE8M0 bytes), q16 [D, HP] (q's e4m3 codes as values, ``_mx_keys`` column order), w2.

    Key j's largest block scale m_j = max_b s_jb; block b becomes e2m1 * 2**(d + 1), d = s_jb - m_j,
    exact for d >= -LIM (bf16: 133 binades, FP16: 24), rounded to the operand grid below that. ONE K=D
    MMA with fp32 accumulation, relu, the weighted head sum, then the key's 2**(m_j - 134) (relu commutes
    with a positive per-key factor; the 2**-6 of w2's fold and the operand's 2**1 included).
    """
    s0 = sword & 255
    s1 = (sword >> 8) & 255
    s2 = (sword >> 16) & 255
    s3 = (sword >> 24) & 255
    m = tl.maximum(tl.maximum(s0, s1), tl.maximum(s2, s3))
    d = ((sword[:, None] >> (8 * tl.arange(0, 4))[None, :]) & 255) - m[:, None]  # [BN, 4], <= 0
    if FP16:  # fp16 2**(d + 15) (0 below 2**-25)
        fb = pow2_from_exponent(tl.maximum(d + 15, -126)).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
        fb = fb & 0xFFFF
    else:  # bf16 2**(d + 127) (0 below 2**-126)
        fb = tl.where(d >= -253, (pow2_from_exponent(tl.maximum(d + 127, -126)).to(tl.int32, bitcast=True) >> 16)
                      & 0xFFFF, 0)
    keys = tl.reshape(_mx_keys(words, fb | (fb << 16), BN, FP16, DOT_DTYPE), (BN, 4, 4, 2, 2, 2))
    keys = tl.reshape(tl.permute(keys, (0, 2, 3, 4, 1, 5)), (BN, D))  # [t, i, g1, g0, h] -> column k
    if DOT_DTYPE == tl.float32:
        acc = tl.dot(keys.to(tl.float32), q16.to(tl.float32))
    else:
        acc = tl.dot(keys, q16)
    e = m - 134
    half = e >> 1
    score = tl.sum(tl.maximum(acc, 0.0) * w2[None, :], 1)
    return score * pow2_from_exponent(half) * pow2_from_exponent(e - half)


@triton.jit
def _perm_rows(x, BN: tl.constexpr, W: tl.constexpr):
    """[BN, ...] in load order (load row r holds tile row rho(r), see _mx_tiles) -> tile-row order."""
    R: tl.constexpr = BN // (8 * W)
    if len(x.shape) == 2:
        y = tl.reshape(x, (R // 2, 2, W, 8, x.shape[1]))
        return tl.reshape(tl.permute(y, (0, 2, 1, 3, 4)), (BN, x.shape[1]))
    else:
        y = tl.reshape(x, (R // 2, 2, W, 8))
        return tl.reshape(tl.permute(y, (0, 2, 1, 3)), (BN,))


@triton.jit
def _advance(pidx, inpg, BN: tl.constexpr, block_size):
    """(page slot, offset) of the tile BN entries further (BN divides block_size when PAGE_TILE)."""
    inpg += BN
    wrap = inpg >= block_size
    return tl.where(wrap, pidx + 1, pidx), tl.where(wrap, inpg - block_size, inpg)


@triton.jit
def _page(bt_row, pidx, start, scored_end, PAGE_TILE: tl.constexpr):
    """The page number of slot pidx (PAGE_TILE; -1 for a tile past the scored range), else an unused 0."""
    if PAGE_TILE:
        return tl.load(bt_row + pidx, mask=start < scored_end, other=-1)
    else:
        return 0


@triton.jit
def _key_rows(bt_row, j, scored_end, block_size, page_stride, value_bytes, scale_offset, scale_bytes):
    """Request-local entries j [N] of a paged key cache, one page-table load and division each: (valid
    [N] (j < scored_end on a mapped page), value byte offsets int64 [N], scale word indices int64 [N])."""
    valid = j < scored_end
    page = tl.load(bt_row + j // block_size, mask=valid, other=-1)
    valid = valid & (page >= 0)
    in_page = j % block_size
    page_base = tl.where(valid, page, 0).to(tl.int64) * page_stride
    return valid, page_base + in_page * value_bytes, (page_base + scale_offset + in_page * scale_bytes) // 4


@triton.jit
def _mx_loads(i32_ptr, bt_row, page, start, inpg, rows, scored_end, block_size, page_stride, value_bytes,
              scale_offset, scale_bytes, NW: tl.constexpr, PAGE_TILE: tl.constexpr):
    """The tile at ``start`` (rows ``rows``, load order): (valid [BN], words int32 [BN, NW], scale words
    int32 [BN]). PAGE_TILE: the tile lies in ``page`` from offset ``inpg`` (one scalar page base); else a
    page-table load and a division per entry."""
    j = start + rows
    if PAGE_TILE:
        valid = j < tl.where(page >= 0, scored_end, start)
        page_base = tl.maximum(page, 0).to(tl.int64) * page_stride
        in_page = inpg + rows
        row_w = page_base // 4 + in_page * (value_bytes // 4)
        scale_w = (page_base + scale_offset) // 4 + in_page * (scale_bytes // 4)
    else:
        valid, row_b, scale_w = _key_rows(bt_row, j, scored_end, block_size, page_stride, value_bytes, scale_offset,
                                          scale_bytes)
        row_w = row_b // 4
    words = tl.load(i32_ptr + row_w[:, None] + tl.arange(0, NW)[None, :], mask=valid[:, None], other=0)
    return valid, words, tl.load(i32_ptr + scale_w, mask=valid, other=0)


@triton.jit
def _mx_tiles(codes_row, heads, head_ok, w2, bt_row, f32_ptr, block_size, page_stride, value_bytes,
              scale_offset, scale_bytes, out_row, lo, scored_end, hi, D: tl.constexpr, BN: tl.constexpr,
              PAGE_TILE: tl.constexpr, W: tl.constexpr, PF: tl.constexpr, FP16: tl.constexpr,
              DOT_DTYPE: tl.constexpr):
    """Scores of mxfp4 entries [lo, scored_end) (q exact, see _q_codes_kernel), one ``_mx_tile`` a tile.

    Loads: the words [BN, 16] in the default blocked layout (4 lanes x 4 words a row, 8 rows a warp, W
    warps, then registers): load row r = 8 W x + 8 w + l (x = 2 x1 + x0) holds tile row
    rho = l + 8 x0 + 16 w + 16 W x1, the rows that thread owns in the wgmma fragment. Page numbers are
    loaded one tile ahead of the words that use them, the words PF (1, 2) tiles ahead of their scoring,
    so no warp waits on a load it has just issued; PAGE_TILE (BN divides the page): page slot and offset
    carried from tile to tile.
    """
    offs = tl.arange(0, BN)
    k = tl.arange(0, D)  # operand column k = 32i + 16g1 + 8g0 + 2t + h holds element 32t + 8i + 4h + 2g1 + g0
    k = 32 * ((k >> 1) & 3) + 8 * (k >> 5) + 4 * (k & 1) + 2 * ((k >> 4) & 1) + ((k >> 3) & 1)
    qc = tl.load(codes_row + heads[:, None] * D + k[None, :], mask=head_ok[:, None], other=0)
    if DOT_DTYPE == tl.float32:
        q16 = tl.trans(decode_e4m3(qc))  # [D, HP], exact
    elif FP16:
        q16 = tl.trans(qc.to(tl.float8e4nv, bitcast=True).to(tl.float16))  # hardware cvt, exact
    else:
        q16 = tl.trans(qc.to(tl.float8e4nv, bitcast=True).to(tl.float16).to(tl.float32).to(tl.bfloat16))
    rows = (offs & 7) + 8 * ((offs // (8 * W)) & 1) + 16 * ((offs >> 3) & (W - 1)) + 16 * W * (offs // (16 * W))
    i32_ptr = f32_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    geometry = (scored_end, block_size, page_stride, value_bytes, scale_offset, scale_bytes)
    pid_a = lo // block_size
    in_a = lo % block_size
    pid_b, in_b = _advance(pid_a, in_a, BN, block_size)
    pid_c, in_c = _advance(pid_b, in_b, BN, block_size)
    pg_a = _page(bt_row, pid_a, lo, scored_end, PAGE_TILE)
    pg_b = _page(bt_row, pid_b, lo + BN, scored_end, PAGE_TILE)
    va, aw, asw = _mx_loads(i32_ptr, bt_row, pg_a, lo, in_a, rows, *geometry, D // 8, PAGE_TILE)
    if PF == 2:
        pg_c = _page(bt_row, pid_c, lo + 2 * BN, scored_end, PAGE_TILE)
        vb, bw, bsw = _mx_loads(i32_ptr, bt_row, pg_b, lo + BN, in_b, rows, *geometry, D // 8, PAGE_TILE)
        pid_d, in_d = _advance(pid_c, in_c, BN, block_size)
    for start in range(lo, scored_end, BN):
        if PF == 2:
            pg_d = _page(bt_row, pid_d, start + 3 * BN, scored_end, PAGE_TILE)
            vc, cw, csw = _mx_loads(i32_ptr, bt_row, pg_c, start + 2 * BN, in_c, rows, *geometry, D // 8, PAGE_TILE)
        else:
            pg_c = _page(bt_row, pid_c, start + 2 * BN, scored_end, PAGE_TILE)
            vb, bw, bsw = _mx_loads(i32_ptr, bt_row, pg_b, start + BN, in_b, rows, *geometry, D // 8, PAGE_TILE)
        score = _mx_tile(_perm_rows(aw, BN, W), _perm_rows(asw, BN, W), q16, w2, BN, D, FP16, DOT_DTYPE)
        j = start + offs
        tl.store(out_row + j, tl.where(_perm_rows(va, BN, W), score, float("-inf")), mask=j < hi)
        va, aw, asw = vb, bw, bsw
        if PF == 2:
            vb, bw, bsw = vc, cw, csw
            pg_c, in_c = pg_d, in_d
            pid_d, in_d = _advance(pid_d, in_d, BN, block_size)
        else:
            pg_b, in_b = pg_c, in_c
            pid_c, in_c = _advance(pid_c, in_c, BN, block_size)


@triton.jit
def _mx_tiles_scaled(codes_row, heads, head_ok, w2, bt_row, u8_ptr, block_size, page_stride, value_bytes,
                     scale_offset, scale_bytes, out_row, lo, scored_end, hi, D: tl.constexpr, BN: tl.constexpr,
                     PAGE_SHIFT: tl.constexpr):
    """Scores of mxfp4 entries [lo, scored_end) through ``tl.dot_scaled`` (q exact, see _q_codes_kernel
    with no 2**-6 fold): the packed nibbles [BN, D/2] and UE8M0 bytes [BN, D/32] go to the MMA as they
    lie in the page (element 2i in the low nibble, SPEC §9.3, is dot_scaled's packing), q's e4m3 codes
    [D, HP] unscaled.

    Where the target has microscaling MMAs (``DeviceFacts.mx_mma``: sm_100 / sm_103, gfx950) the keys
    are never decoded: one e2m1 x e4m3 MMA a tile with the block scales applied by the tensor core.
    Elsewhere Triton upcasts both operands to bf16 first (exact: e2m1 * 2**(s-127) and e4m3 fit bf16
    for every finite scale), and the interpreter computes it in fp32. Products are exact, sums fp32.

    Rows past the scored range or on unmapped pages read page 0's bytes unmasked (in bounds; an MMA row
    depends on its own key only) and their scores become -inf. PAGE_SHIFT: log2 of a power-of-two
    block_size (page slot and offset by shift and mask), else 0 (division).
    """
    offs = tl.arange(0, BN)
    half_w = w2 * 0.5  # (x + |x|) (w / 2) = relu(x) w: exact doubling and halving
    kq = tl.arange(0, D)
    q = tl.trans(tl.load(codes_row + heads[:, None] * D + kq[None, :], mask=head_ok[:, None], other=0))
    kb = tl.arange(0, D // 2)
    ks = tl.arange(0, D // 32)
    # Triton lowers dot_scaled to the block-scaled MMA (sm_100) only when both operands carry scales: q's
    # are 2**0 (3.6 and 3.9: with None, a bf16 MMA on upcast operands).
    unit = tl.full([q.shape[1], D // 32], 127, tl.uint8)
    zero = tl.zeros([BN, q.shape[1]], tl.float32) + (lo < 0).to(tl.float32)  # 0, not a constant
    for start in range(lo, scored_end, BN):
        j = start + offs
        valid = j < scored_end
        if PAGE_SHIFT > 0:
            slot = j >> PAGE_SHIFT
            in_page = j & ((1 << PAGE_SHIFT) - 1)
        else:
            slot = j // block_size
            in_page = j % block_size
        page = tl.load(bt_row + slot, mask=valid, other=-1)
        valid = valid & (page >= 0)
        base = tl.where(valid, page, 0).to(tl.int64) * page_stride
        row = tl.multiple_of(base + in_page * value_bytes, 16)
        keys = tl.load(u8_ptr + row[:, None] + kb[None, :])
        srow = tl.multiple_of(base + scale_offset + in_page * scale_bytes, 4)
        scales = tl.load(u8_ptr + srow[:, None] + ks[None, :])
        if RUNTIME_ZERO_ACC:
            acc = tl.dot_scaled(keys, scales, "e2m1", q, unit, "e4m3", acc=zero)  # [BN, HP] fp32
        else:
            acc = tl.dot_scaled(keys, scales, "e2m1", q, unit, "e4m3")
        score = tl.sum((acc + tl.abs(acc)) * half_w[None, :], 1)  # relu on the FMA pipe, same bits
        tl.store(out_row + j, tl.where(valid, score, float("-inf")), mask=j < hi)
