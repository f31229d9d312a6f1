"""fp8_ds_mla producer of ``sparse_hopper`` (sm_90a, Gluon): records -> bf16 K tiles in shared memory.

Record geometry: the fp8_ds_mla format (SPEC §9.1, ``dsv4.specs.formats``; offsets and strides reach the
kernel from ``LatentLayout``): NOPE_CHUNKS chunks of e4m3 nope values with one UE8M0 scale byte each, the
bf16 rope chunk, and a token's scale bytes (one 8-byte word) in the page's scale area. A 64-key tile is
PARTS units of RH rows; a unit's bytes are gathered straight into registers (int32 words; the scale
word as one int64), dequantized there and stored as one bf16 ``[RH, 512]`` block; the loads of unit u+1
are in flight while unit u is dequantized, unit u+2's records are prefetched into L2.

Dequantization (``_dq_chunk``): a PRMT puts e4m3 bytes 2k, 2k+1 in the high bytes of two 16-bit halves,
mask / shift / or give bf16 bits s.0000eeee.mmm0000 = the e4m3 value * 2**-120 (subnormals included),
then two packed ``fma.rn.bf16x2 x, f, -0`` by 2**(min(byte, 134) - 7) and 2**max(byte - 134, 0): exact
for every scale byte 0..254 (one rounding where the result is below the bf16 normal range, as the
fp32 -> bf16 cast). Every PTX block works on whole int32 words (pack=1), so nothing depends on how
Triton packs elements; ``dequant_check`` runs it on given bytes (tools/gpu_check.py compares it bit for
bit with the reference decode).
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

__all__ = ["cta_barrier", "dequant_check"]

# Gluon's CTA-wide barrier (bar.sync): ``thread_barrier`` up to Triton 3.8, ``barrier`` from 3.9
cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

_ASM_HEAD = """{
.reg .b32 d0, d1, e0, e1, z, nz;
mov.b32 z, 0;
mov.b32 nz, 0x80008000;
prmt.b32 d0, $2, z, 0x1404;
prmt.b32 d1, $2, z, 0x3424;
and.b32 e0, d0, 0x7F007F00;
and.b32 e1, d1, 0x7F007F00;
shr.b32 e0, e0, 4;
shr.b32 e1, e1, 4;
and.b32 d0, d0, 0x80008000;
and.b32 d1, d1, 0x80008000;
or.b32 d0, d0, e0;
or.b32 d1, d1, e1;
"""
_ASM = gl.constexpr(_ASM_HEAD + """fma.rn.bf16x2 d0, d0, $3, nz;
fma.rn.bf16x2 d1, d1, $3, nz;
fma.rn.bf16x2 $0, d0, $4, nz;
fma.rn.bf16x2 $1, d1, $4, nz;
}""")


@gluon.jit
def _words_to_bf16(o0, o1):
    """int32 [R, C] words o0 (elements 4k, 4k+1) and o1 (4k+2, 4k+3) of bf16 pairs -> bf16 [R, 4C]."""
    pr = gl.join(o0, o1)
    h = gl.join(pr.to(gl.int16), (pr >> 16).to(gl.int16))
    return gl.reshape(h, [o0.shape[0], 4 * o0.shape[1]]).to(gl.bfloat16, bitcast=True)


@gluon.jit
def _dq_chunk(w, sb):
    """w int32 [R, 16] (64 e4m3 codes of a row chunk, little-endian), sb int32 [R] scale bytes (SliceLayout(1)
    of w's layout) -> bf16 [R, 64] = e4m3 * 2**(sb - 127), by bit placement (module docstring)."""
    e1 = gl.minimum(sb, 134) + 120
    f1 = gl.expand_dims((e1 << 7) | (e1 << 23), 1)  # bf16x2 2**(min(byte, 134) - 7)
    e2 = gl.maximum(sb - 134, 0) + 127
    f2 = gl.expand_dims((e2 << 7) | (e2 << 23), 1)  # bf16x2 2**max(byte - 134, 0)
    o0, o1 = gl.inline_asm_elementwise(_ASM, "=r,=r,r,r,r", [w, f1, f2], dtype=(gl.int32, gl.int32), is_pure=True,
                                       pack=1)
    return _words_to_bf16(o0, o1)


@gluon.jit
def _rope_bf16(rp):
    """int32 [R, 32] words of 64 bf16 rope values -> bf16 [R, 64] (low half of word k is element 2k)."""
    h = gl.join(rp.to(gl.int16), (rp >> 16).to(gl.int16))
    return gl.reshape(h, [rp.shape[0], 2 * rp.shape[1]]).to(gl.bfloat16, bitcast=True)


@gluon.jit
def _list_position(tile, n_swa, swa_row, ext_row, swa_len, ext_len, HAS_EXTRA: gl.constexpr):
    """Virtual tile ``tile`` (SWA tiles, then extra tiles) -> (index row pointer, tile within that list,
    list length); shared with ``sparse_hopper``."""
    in_swa = tile < n_swa
    if HAS_EXTRA:
        return gl.where(in_swa, swa_row, ext_row), gl.where(in_swa, tile, tile - n_swa), gl.where(in_swa, swa_len,
                                                                                                 ext_len)
    return swa_row, tile, swa_len


@gluon.jit
def _record_words(tile, slots, n_swa, swa_i32, ext_i32, swa_i64, ext_i64, SWA_LOG2B: gl.constexpr,
                  SWA_PAGE: gl.constexpr, SWA_SCALE_OFF: gl.constexpr, EXT_LOG2B: gl.constexpr,
                  EXT_PAGE: gl.constexpr, EXT_SCALE_OFF: gl.constexpr, TOKEN_STRIDE: gl.constexpr,
                  SCALE_STRIDE: gl.constexpr, HAS_EXTRA: gl.constexpr):
    """Where the records of ``slots`` (virtual tile ``tile``'s cache) live: (int32 view, int64 view,
    validity, record start in int32 words (16-byte aligned), scale word index in the int64 view)."""
    if HAS_EXTRA:
        in_swa = tile < n_swa
        i32 = gl.where(in_swa, swa_i32, ext_i32)
        i64 = gl.where(in_swa, swa_i64, ext_i64)
        log2b = gl.where(in_swa, SWA_LOG2B, EXT_LOG2B)
        pw = gl.where(in_swa, SWA_PAGE // 16, EXT_PAGE // 16)
        so = gl.where(in_swa, SWA_SCALE_OFF // 8, EXT_SCALE_OFF // 8)
    else:
        i32 = swa_i32
        i64 = swa_i64
        log2b = SWA_LOG2B
        pw = SWA_PAGE // 16
        so = SWA_SCALE_OFF // 8
    valid = slots >= 0
    safe = gl.where(valid, slots, 0)
    page = (safe >> log2b).to(gl.int64)
    in_page = (safe & ((1 << log2b) - 1)).to(gl.int64)
    recw = page * pw * 4 + in_page * (TOKEN_STRIDE // 4)
    return i32, i64, valid, recw, page * pw * 2 + so + in_page * (SCALE_STRIDE // 8)


@gluon.jit
def _unit_slots(tile, PART: gl.constexpr, hi, n_swa, swa_row, ext_row, swa_len, ext_len, BN: gl.constexpr,
                RH: gl.constexpr, ROW: gl.constexpr, HAS_EXTRA: gl.constexpr):
    """[RH] int32 slots of rows [PART*RH, (PART+1)*RH) of virtual tile ``tile`` (-1: invalid, past the
    list, or tile >= hi)."""
    idx_row, local, length = _list_position(tile, n_swa, swa_row, ext_row, swa_len, ext_len, HAS_EXTRA)
    j = local * BN + PART * RH + gl.arange(0, RH, layout=ROW)
    ok = (j < length) & (tile < hi)
    return gl.load(idx_row + j, mask=ok, other=-1)


@gluon.jit
def _unit_load(tile, slots, n_swa, swa_i32, ext_i32, swa_i64, ext_i64,
               SWA_LOG2B: gl.constexpr, SWA_PAGE: gl.constexpr, SWA_SCALE_OFF: gl.constexpr,
               EXT_LOG2B: gl.constexpr, EXT_PAGE: gl.constexpr, EXT_SCALE_OFF: gl.constexpr,
               TOKEN_STRIDE: gl.constexpr, NOPE_OFF: gl.constexpr, ROPE_OFF: gl.constexpr,
               SCALE_STRIDE: gl.constexpr, NOPE_CHUNKS: gl.constexpr, HAS_EXTRA: gl.constexpr,
               LW: gl.constexpr):
    """Issue the loads of one unit: NOPE_CHUNKS nope chunks int32 [RH, 16], rope int32 [RH, 32], scale word
    int64 [RH] (all zero for slot -1). Returns them as a tuple."""
    gl.static_assert(NOPE_CHUNKS == 7, "the unrolled gathers and _unit_store cover 7 nope chunks")
    i32, i64, valid, recw, swi = _record_words(tile, slots, n_swa, swa_i32, ext_i32, swa_i64, ext_i64, SWA_LOG2B,
                                               SWA_PAGE, SWA_SCALE_OFF, EXT_LOG2B, EXT_PAGE, EXT_SCALE_OFF,
                                               TOKEN_STRIDE, SCALE_STRIDE, HAS_EXTRA)
    recw = gl.multiple_of(recw, 4)  # int32 words; 16-byte aligned records
    sw = gl.load(i64 + swi, mask=valid, other=0)
    base = i32 + gl.expand_dims(recw, 1)
    m = gl.expand_dims(valid, 1)
    c16 = gl.arange(0, 16, layout=gl.SliceLayout(0, LW))
    n0 = gl.load(base + (NOPE_OFF // 4 + 0 * 16) + gl.expand_dims(c16, 0), mask=m, other=0)
    n1 = gl.load(base + (NOPE_OFF // 4 + 1 * 16) + gl.expand_dims(c16, 0), mask=m, other=0)
    n2 = gl.load(base + (NOPE_OFF // 4 + 2 * 16) + gl.expand_dims(c16, 0), mask=m, other=0)
    n3 = gl.load(base + (NOPE_OFF // 4 + 3 * 16) + gl.expand_dims(c16, 0), mask=m, other=0)
    n4 = gl.load(base + (NOPE_OFF // 4 + 4 * 16) + gl.expand_dims(c16, 0), mask=m, other=0)
    n5 = gl.load(base + (NOPE_OFF // 4 + 5 * 16) + gl.expand_dims(c16, 0), mask=m, other=0)
    n6 = gl.load(base + (NOPE_OFF // 4 + 6 * 16) + gl.expand_dims(c16, 0), mask=m, other=0)
    # rope: 8 words a thread where a nope chunk has 4, so both decode to the same [RH, 64] layout
    LR: gl.constexpr = gl.BlockedLayout([1, 2 * LW.size_per_thread[1]], LW.threads_per_warp, LW.warps_per_cta, [1, 0])
    recw_r = gl.convert_layout(recw, gl.SliceLayout(1, LR))
    valid_r = gl.convert_layout(valid, gl.SliceLayout(1, LR))
    c32 = gl.arange(0, 32, layout=gl.SliceLayout(0, LR))
    rp = gl.load(i32 + gl.expand_dims(recw_r, 1) + ROPE_OFF // 4 + gl.expand_dims(c32, 0),
                 mask=gl.expand_dims(valid_r, 1), other=0)
    return n0, n1, n2, n3, n4, n5, n6, rp, sw


@gluon.jit
def _unit_prefetch(tile, slots, n_swa, swa_i32, ext_i32, swa_i64, ext_i64,
                   SWA_LOG2B: gl.constexpr, SWA_PAGE: gl.constexpr, SWA_SCALE_OFF: gl.constexpr,
                   EXT_LOG2B: gl.constexpr, EXT_PAGE: gl.constexpr, EXT_SCALE_OFF: gl.constexpr,
                   TOKEN_STRIDE: gl.constexpr, SCALE_STRIDE: gl.constexpr, HAS_EXTRA: gl.constexpr,
                   LP: gl.constexpr):
    """``prefetch.global.L2`` of the records of ``slots`` (LINES 128-byte lines cover a record) and their scale
    words; no registers held. slots [N] in SliceLayout(1, LP), LP an [N, 8] layout."""
    LINES: gl.constexpr = (TOKEN_STRIDE + 127) // 128
    gl.static_assert(LINES < 8, "a record and its scale word take at most 8 prefetch lanes")
    i32, i64, valid, recw, sw = _record_words(tile, slots, n_swa, swa_i32, ext_i32, swa_i64, ext_i64, SWA_LOG2B,
                                              SWA_PAGE, SWA_SCALE_OFF, EXT_LOG2B, EXT_PAGE, EXT_SCALE_OFF,
                                              TOKEN_STRIDE, SCALE_STRIDE, HAS_EXTRA)
    c = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, LP)), 0)
    rec_ptr = i32 + gl.expand_dims(recw, 1) + c * 32
    sc_ptr = (i64 + gl.expand_dims(sw, 1) + c * 0).to(gl.pointer_type(gl.int32), bitcast=True)
    ptr = gl.where(c < LINES, rec_ptr, sc_ptr)
    ok = gl.expand_dims(valid, 1) & (c < LINES + 1)
    gl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
                              "=r,l,r", [ptr, ok.to(gl.int32)], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _unit_store(raw, dst):
    """Dequantize one unit's registers into dst, a bf16 [RH, 512] shared-memory view: the [RH, 512] tile
    is assembled in registers (join tree + permute, no data movement) and stored at once, so the
    producer warps pass one barrier a unit instead of one per 64-column chunk."""
    n0, n1, n2, n3, n4, n5, n6, rp, sw = raw
    c0 = _dq_chunk(n0, (sw & 255).to(gl.int32))
    c1 = _dq_chunk(n1, ((sw >> 8) & 255).to(gl.int32))
    c2 = _dq_chunk(n2, ((sw >> 16) & 255).to(gl.int32))
    c3 = _dq_chunk(n3, ((sw >> 24) & 255).to(gl.int32))
    c4 = _dq_chunk(n4, ((sw >> 32) & 255).to(gl.int32))
    c5 = _dq_chunk(n5, ((sw >> 40) & 255).to(gl.int32))
    c6 = _dq_chunk(n6, ((sw >> 48) & 255).to(gl.int32))
    c7 = _rope_bf16(rp)
    j = gl.join(gl.join(gl.join(c0, c1), gl.join(c2, c3)), gl.join(gl.join(c4, c5), gl.join(c6, c7)))
    # j[r, e, i, jj, k] = chunk 4k + 2jj + i, element e
    dst.store(gl.reshape(gl.permute(j, (0, 4, 3, 2, 1)), [c0.shape[0], 512]))


@gluon.jit
def _fp8_producer(lo, hi, n_swa, swa_row, ext_row, swa_len, ext_len, swa_i32, ext_i32, swa_i64, ext_i64,
                  k_ring, k_ready, k_free,
                  SWA_LOG2B: gl.constexpr, SWA_PAGE: gl.constexpr, SWA_SCALE_OFF: gl.constexpr,
                  EXT_LOG2B: gl.constexpr, EXT_PAGE: gl.constexpr, EXT_SCALE_OFF: gl.constexpr,
                  TOKEN_STRIDE: gl.constexpr, NOPE_OFF: gl.constexpr, ROPE_OFF: gl.constexpr,
                  SCALE_STRIDE: gl.constexpr, NOPE_CHUNKS: gl.constexpr, HAS_EXTRA: gl.constexpr,
                  BN: gl.constexpr, STAGES: gl.constexpr, PARTS: gl.constexpr):
    """Producer partition (its warps): tiles of BN keys in PARTS units of RH = BN / PARTS rows; the register
    gathers of unit u+1 are in flight while unit u is dequantized into k_ring[tile % STAGES], unit u+2's
    records are prefetched into L2 when unit u starts (slot indices loaded a unit earlier). k_ready
    arrives once per tile (count 1); k_free (count 2: both consumer warpgroups) gates a slot's reuse."""
    PW: gl.constexpr = gl.num_warps()
    RH: gl.constexpr = BN // PARTS
    TR: gl.constexpr = RH // PW
    TC: gl.constexpr = 32 // TR
    LW: gl.constexpr = gl.BlockedLayout([1, 16 // TC], [TR, TC], [PW, 1], [1, 0])
    LU: gl.constexpr = gl.BlockedLayout([1, 8 // TC], [TR, TC], [PW, 1], [1, 0])  # [RH, 8] prefetch lanes
    ROW: gl.constexpr = gl.SliceLayout(1, LW)
    s0 = _unit_slots(lo, 0, hi, n_swa, swa_row, ext_row, swa_len, ext_len, BN, RH, ROW, HAS_EXTRA)
    s1 = _unit_slots(lo + 1 // PARTS, 1 % PARTS, hi, n_swa, swa_row, ext_row, swa_len, ext_len, BN, RH, ROW,
                     HAS_EXTRA)
    s2 = _unit_slots(lo + 2 // PARTS, 2 % PARTS, hi, n_swa, swa_row, ext_row, swa_len, ext_len, BN, RH, ROW,
                     HAS_EXTRA)
    raw = _unit_load(lo, s0, n_swa, swa_i32, ext_i32, swa_i64, ext_i64, SWA_LOG2B, SWA_PAGE, SWA_SCALE_OFF,
                     EXT_LOG2B, EXT_PAGE, EXT_SCALE_OFF, TOKEN_STRIDE, NOPE_OFF, ROPE_OFF, SCALE_STRIDE,
                     NOPE_CHUNKS, HAS_EXTRA, LW)
    for tile in range(lo, hi):
        r = tile - lo
        kb = r % STAGES
        k_cur = k_ring.index(kb)
        for part in gl.static_range(PARTS):
            # unit u + k is part (part + k) % PARTS of tile tile + (part + k) // PARTS
            raw_n = _unit_load(tile + (part + 1) // PARTS, s1, n_swa, swa_i32, ext_i32, swa_i64, ext_i64,
                               SWA_LOG2B, SWA_PAGE, SWA_SCALE_OFF, EXT_LOG2B, EXT_PAGE, EXT_SCALE_OFF, TOKEN_STRIDE,
                               NOPE_OFF, ROPE_OFF, SCALE_STRIDE, NOPE_CHUNKS, HAS_EXTRA, LW)
            _unit_prefetch(tile + (part + 2) // PARTS, gl.convert_layout(s2, gl.SliceLayout(1, LU)), n_swa,
                           swa_i32, ext_i32, swa_i64, ext_i64, SWA_LOG2B, SWA_PAGE, SWA_SCALE_OFF, EXT_LOG2B,
                           EXT_PAGE, EXT_SCALE_OFF, TOKEN_STRIDE, SCALE_STRIDE, HAS_EXTRA, LU)
            s1 = s2
            s2 = _unit_slots(tile + (part + 3) // PARTS, (part + 3) % PARTS, hi, n_swa, swa_row, ext_row,
                             swa_len, ext_len, BN, RH, ROW, HAS_EXTRA)
            if part == 0:
                mbarrier.wait(k_free.index(kb), ((r // STAGES) - 1) & 1, pred=r >= STAGES)
            _unit_store(raw, k_cur.slice(part * RH, RH, dim=0))
            raw = raw_n
        fence_async_shared()
        cta_barrier()  # producer warps only: the whole K tile is in shared memory
        mbarrier.arrive(k_ready.index(kb), count=1)


@gluon.jit
def _dequant_check_kernel(words_ptr, bytes_ptr, out_ptr, R: gl.constexpr):
    """words [R, 16] int32 (64 e4m3 codes a row), bytes [R] int32 scale bytes -> out [R, 64] bf16 (4 warps)."""
    LW: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
    rows = gl.arange(0, R, layout=gl.SliceLayout(1, LW))
    cols = gl.arange(0, 16, layout=gl.SliceLayout(0, LW))
    w = gl.load(words_ptr + gl.expand_dims(rows, 1) * 16 + gl.expand_dims(cols, 0))
    x = _dq_chunk(w, gl.load(bytes_ptr + rows))
    OL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    x = gl.convert_layout(x, OL)
    r2 = gl.arange(0, R, layout=gl.SliceLayout(1, OL))
    c2 = gl.arange(0, 64, layout=gl.SliceLayout(0, OL))
    gl.store(out_ptr + gl.expand_dims(r2, 1) * 64 + gl.expand_dims(c2, 0), x)


def dequant_check(codes: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [R, 64] (R a multiple of 32), scale_bytes [R] -> bf16 [R, 64] through the kernel's dequant
    (for gpu_check: compare bit-exactly with (e4m3 * 2**(byte - 127)) in fp32 rounded to bf16)."""
    out = torch.empty((codes.shape[0], 64), dtype=torch.bfloat16, device=codes.device)
    _dequant_check_kernel[(1,)](codes.contiguous().view(torch.int32), scale_bytes.to(torch.int32).contiguous(),
                                out, R=codes.shape[0], num_warps=4)
    return out
