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
  through ``ptx_eval`` in tests/tools. The bytes go to a 2-deep fp8 [64, 128] NVMMA ring;
- one K=128 chain of four K=32 fp8 MMAs per tile (keys = A, q^T = B), issued asynchronously: tile i+1 is
  decoded while tile i's MMA runs, and tile i's epilogue (relu, weighted head sum, the key's 2**(m - 139),
  -inf for invalid entries) runs while tile i+1's MMA runs.

Numerics differ from the installed kernel. The K=128 fp8 chain accumulates at the tensor core's reduced
precision: the H200 measured 2-3e-4 of the row maximum against the installed kernel's exact fp32 sums,
inside SPEC §13's 1e-3 top-k slack. Blocks far below their key's largest are flushed (``fast``) or
rounded. The H200 result and what bounds it are in docs/triton.md ("Twelfth round").
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    GLUON_ERROR = None
except Exception as exc:  # noqa: BLE001 - any import failure: the kernel cannot be built here, say why
    GLUON_ERROR = f"Gluon not importable: {type(exc).__name__}: {exc}"

    class _NoGluon:
        """Stands in for ``gluon`` / ``gl`` where Gluon is missing: the kernels are defined, never built."""
        jit = staticmethod(lambda fn: fn)
        constexpr = staticmethod(lambda value: value)

    gluon = gl = _NoGluon()

HERE = Path(__file__).resolve().parent
BLOCK_KEYS = 64  # keys a tile (the wgmma M)
_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1 codes 0..7


def check_layout(layout, dim: int) -> None:
    """ValueError naming what this kernel needs that ``layout`` (``dsv4`` KeyLayout) or q's dim lacks."""
    if layout.format_name != "indexer_mxfp4":
        raise ValueError(f"key layout: expected indexer_mxfp4, got {layout.format_name}")
    if dim != 128 or layout.value_bytes != 64 or layout.scale_bytes != 4:
        raise ValueError(f"geometry: expected q dim 128, 64 code bytes and 4 scale bytes a key, got {dim}, "
                         f"{layout.value_bytes}, {layout.scale_bytes}")
    b = layout.block_size
    if b % BLOCK_KEYS or b & (b - 1):
        raise ValueError(f"block_size: expected a power of two divisible by {BLOCK_KEYS}, got {b}")
    if layout.page_stride % 16 or layout.scale_offset % 16:
        raise ValueError(f"page_stride / scale_offset: expected multiples of 16 (cp.async), got "
                         f"{layout.page_stride} / {layout.scale_offset}")


def _prmt(a: torch.Tensor, b: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """PTX ``prmt.b32`` (default mode) on int64 tensors of 32-bit values: output byte i is byte sel[4i:4i+2]
    of {b, a} (0-3 from a), or that byte's bit 7 replicated when sel bit 4i+3 is set."""
    pool = a & 0xFFFFFFFF | (b & 0xFFFFFFFF) << 32
    out = torch.zeros_like(pool + sel)
    for i in range(4):
        nib = (sel >> (4 * i)) & 15
        byte = (pool >> (8 * (nib & 7))) & 255
        out |= torch.where(nib >= 8, ((byte >> 7) & 1) * 255, byte) << (8 * i)
    return out


def _e4m3x2(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """PTX ``cvt.rn.satfinite.e4m3x2.f32 d, a, b``: a's e4m3 byte in d's upper half, b's in the lower."""
    def code(x: torch.Tensor) -> torch.Tensor:
        x = x.float().clamp(-448.0, 448.0)
        return x.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int64)
    return code(a) << 8 | code(b)


def ptx_eval(asm: str, args: list[torch.Tensor], outputs: int) -> list[torch.Tensor]:
    """Run one of this tool's inline-PTX blocks (``_CVT4``, ``_DECODE``) on CPU tensors: ``args`` bind
    $outputs.. (int64 tensors of 32-bit values; fp32 for cvt sources). Only the instructions those use."""
    env: dict[str, torch.Tensor] = {f"${outputs + i}": v for i, v in enumerate(args)}

    def val(token: str) -> torch.Tensor:
        return env[token] if token in env else torch.tensor(int(token, 0), dtype=torch.int64)

    for stmt in asm.strip("{} ").split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        if op == "mov.b32" and "{" in rest:  # mov.b32 d, {lo16, hi16}
            d, pair = rest.split(",", 1)
            lo, hi = (t.strip() for t in pair.strip(" {}").split(","))
            env[d.strip()] = (val(lo) & 0xFFFF) | (val(hi) & 0xFFFF) << 16
            continue
        d, *src = (t.strip() for t in rest.split(","))
        x = [val(t) for t in src]
        if op == "mov.b32":
            r = x[0] & 0xFFFFFFFF
        elif op == "and.b32":
            r = x[0] & x[1]
        elif op == "shl.b32":
            r = (x[0] << x[1]) & 0xFFFFFFFF
        elif op == "shr.u32":
            r = (x[0] & 0xFFFFFFFF) >> x[1]
        elif op == "prmt.b32":
            r = _prmt(x[0], x[1], x[2])
        elif op == "lop3.b32":  # bitwise LUT over (a, b, c) = (0xF0, 0xCC, 0xAA)
            r = torch.zeros_like(x[0] + x[1])
            for bit in range(8):
                if int(x[3]) >> bit & 1:
                    a, b, c = (v if bit >> k & 1 else ~v for k, v in ((2, x[0]), (1, x[1]), (0, x[2])))
                    r |= a & b & c
            r &= 0xFFFFFFFF
        elif op == "cvt.rn.satfinite.e4m3x2.f32":
            r = _e4m3x2(env[src[0]], env[src[1]])
        else:
            raise ValueError(f"ptx_eval: unsupported instruction {op!r}")
        env[d] = r
    return [env[f"${i}"] for i in range(outputs)]


# The integer tables (``FAST``): e4m3 bytes of {0, .5, 1, 1.5} / {2, 3, 4, 6} x 2**6 at d = 0; d < 0 lowers
# every nonzero byte's exponent field by -d (d * 8 added a byte), normal down to d = -11.
_TABLE_LO = gl.constexpr(0x6C686000)
_TABLE_HI = gl.constexpr(0x7C787470)
_CVT4 = gl.constexpr(
    "{ .reg .b16 l, h; cvt.rn.satfinite.e4m3x2.f32 l, $2, $1; cvt.rn.satfinite.e4m3x2.f32 h, $4, $3;"
    " mov.b32 $0, {l, h}; }")


@gluon.jit
def _cvt4(a, b, c, d):
    """four fp32 -> int32 of e4m3 bytes [a, b, c, d] (byte 0 = a), RN, saturating."""
    return gl.inline_asm_elementwise(_CVT4, "=r,f,f,f,f", [a, b, c, d], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _max_scale(sword):
    """int32 scale words (4 UE8M0 bytes) -> the largest byte."""
    s0 = sword & 255
    s1 = (sword >> 8) & 255
    s2 = (sword >> 16) & 255
    s3 = (sword >> 24) & 255
    return gl.maximum(gl.maximum(s0, s1), gl.maximum(s2, s3))


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
    LS: gl.constexpr = gl.SliceLayout(2, L3)
    r3 = gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    b3 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    c3 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    base = gl.maximum(page, 0).to(gl.int64) * page_stride_w
    row = base + (in_page + r3).to(gl.int64) * 16
    ptr = i32_ptr + (gl.expand_dims(gl.expand_dims(row, 1), 2) + gl.expand_dims(gl.expand_dims(b3 * 4, 0), 2)
                     + gl.expand_dims(gl.expand_dims(c3, 0), 1))
    ok = gl.expand_dims(gl.expand_dims(r3 < nvalid, 1), 2) & gl.expand_dims(gl.expand_dims(c3 >= 0, 0), 1)
    ok = ok & gl.expand_dims(gl.expand_dims(b3 >= 0, 0), 2)
    cp.async_copy_global_to_shared(raw_ring.index(stage), ptr, mask=ok)
    rs = gl.arange(0, BN, layout=gl.SliceLayout(1, LS))
    sptr = gl.where(rs < nvalid, i32_ptr + base + scale_off_w + (in_page + rs), sentinel)
    if FAST:  # one scale word a key ([BN], the two threads of a row share it after the ring's barrier)
        cp.async_copy_global_to_shared(sc_ring.index(stage), sptr)
    else:  # the key's scale word once for each of the thread's two blocks ([BN, 4])
        bs = gl.arange(0, 4, layout=gl.SliceLayout(0, LS))
        sptr2 = gl.expand_dims(sptr, 1) + gl.expand_dims(bs * 0, 0)
        cp.async_copy_global_to_shared(sc_ring.index(stage), sptr2)
    cp.commit_group()


@gluon.jit
def _page(bt_row, start, scored_end, log2b):
    """The page of the tile at ``start`` (tiles never cross a page); -1 past the scored range."""
    return gl.load(bt_row + (start >> log2b), mask=start < scored_end, other=-1)


@gluon.jit
def _geometry(page, start, scored_end, log2b):
    """(offset in page, valid rows) of the tile at ``start`` on ``page``."""
    return start & ((1 << log2b) - 1), gl.where(page >= 0, scored_end - start, 0)


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
    t = gl.program_id(0).to(gl.int64)
    lo = gl.program_id(1) * chunk
    hi = gl.minimum(lo + chunk, max_entries)
    visible = ((gl.load(positions + t) + 1) // ratio).to(gl.int32)
    out_row = logits + t * max_entries
    RL: gl.constexpr = gl.SliceLayout(1, MMA)
    offs = gl.arange(0, BN, layout=RL)
    if visible <= topk:
        for start in range(lo, hi, BN):
            j = start + offs
            gl.store(out_row + j, gl.where(j < visible, 0.0, float("-inf")), mask=j < hi)
    else:
        scored_end = gl.minimum(hi, visible)
        bt_row = block_table + gl.load(token_request + t).to(gl.int64) * stride_bt
        # q codes [HP, D] -> shared (B operand, K-major), w2 [HP]
        qh = gl.arange(0, HP, layout=gl.SliceLayout(1, QL))
        qk = gl.arange(0, D, layout=gl.SliceLayout(0, QL))
        qc = gl.load(codes_ptr + t * num_heads * D + gl.expand_dims(qh, 1) * D + gl.expand_dims(qk, 0),
                     mask=gl.expand_dims(qh < num_heads, 1), other=0)
        q_smem = gl.allocate_shared_memory(gl.float8e4nv, [HP, D], KEY_F8,
                                           qc.to(gl.float8e4nv, bitcast=True))
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
        tail = gl.maximum(scored_end, lo)
        tail = lo + ((tail - lo) // BN) * BN
        for start in range(tail, hi, BN):
            j = start + offs
            gl.store(out_row + j, gl.full([BN], float("-inf"), gl.float32, RL),
                     mask=(j < hi) & (j >= scored_end))


def async_fp8_logits(q, w, positions, token_request, key_cache, layout, key_block_table, *, topk: int,
                     ratio: int, num_splits: int | None = None, stages: int = 4, fast: bool = True,
                     check_exact: bool = True) -> torch.Tensor:
    """``indexer.indexer_logits`` for mxfp4 keys through ``_mx_async_kernel``: logits [T, mb*B] fp32.

    q [T, heads <= 64, 128] bf16 (exact e4m3 after ``q_codes``'s shift, else ValueError: the bf16 path is not
    here; ``check_exact=False`` skips that device sync, e.g. under CUDA-graph capture), w [T, heads] fp32;
    keys read in place from ``key_cache`` (uint8 pages, SPEC §9.3)."""
    from dsv4.backends.triton import indexer
    from dsv4.backends.triton._common import device_facts

    if GLUON_ERROR is not None:
        raise RuntimeError(GLUON_ERROR)
    num_tokens, heads, dim = q.shape
    check_layout(layout, dim)
    if heads > 64:
        raise ValueError(f"q: expected at most 64 heads, got {heads}")
    max_entries = key_block_table.shape[1] * layout.block_size
    logits = torch.empty((num_tokens, max_entries), dtype=torch.float32, device=q.device)
    codes, w2, exact = indexer.q_codes(q.contiguous(), w.contiguous(), mxfp4=True)
    if check_exact and not bool((exact == 1).all()):
        raise ValueError("q: expected every token's q exact in e4m3 after its shift (FP4/FP8-quantized q)")
    sms = device_facts(q.device).num_sms
    tiles = -(-max_entries // BLOCK_KEYS)
    splits = num_splits or max(1, min(round(16 * sms / num_tokens), tiles // 4))  # H200 b=128: 16 was best
    chunk = -(-tiles // splits) * BLOCK_KEYS
    splits = -(-max_entries // chunk)
    _mx_async_kernel[(num_tokens, splits)](
        codes, w2, positions, token_request, key_block_table, key_block_table.stride(0),
        key_cache.view(torch.int32), torch.full((4,), -1, dtype=torch.int32, device=q.device),
        layout.block_size.bit_length() - 1, layout.page_stride // 4,
        layout.scale_offset // 4, logits, max_entries, chunk, ratio, topk, heads,
        D=dim, HP=64, BN=BLOCK_KEYS, S=stages, FAST=fast, num_warps=4)
    return logits


def _inputs(batch: int, context: int, *, seed: int = 0, **options) -> tuple:
    """``bench_attention.indexer_decode_inputs`` (the bench row's inputs; ``options`` vary it for the checks)
    as the positional arguments of ``indexer_logits`` / ``async_fp8_logits`` up to the key block table."""
    from bench_attention import indexer_decode_inputs

    gen = torch.Generator("cuda").manual_seed(seed)
    x = indexer_decode_inputs(batch, context, rotations=1, generator=gen, **options)
    return (x["qs"][0], x["w"], x["positions"], x["token_request"], x["cache"], x["layout"], x["table"])


def compare(ref: torch.Tensor, got: torch.Tensor) -> tuple[bool, float]:
    """(same -inf / shortcut-zero pattern, largest |got - ref| / the row's largest |ref|)."""
    fin = torch.isfinite(ref)
    same = bool((torch.isfinite(got) == fin).all()) and bool((got[~fin] == ref[~fin]).all())
    rowmax = ref.masked_fill(~fin, 0).abs().amax(1, keepdim=True).clamp_min(1e-30)
    err = ((got - ref).abs() / rowmax).masked_fill(~fin, 0).nan_to_num(nan=float("inf"))
    return same, float(err.max())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--once", action="store_true", help="two calls at the bench shape, nothing timed")
    args = p.parse_args(argv)
    why = GLUON_ERROR or (None if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
                          else "needs an sm_90 CUDA device")
    if why:
        print(f"indexer_async_fp8: not run: {why}")
        return 2
    sys.path.insert(0, str(HERE))
    import bench_attention as bench
    from dsv4.backends.triton import TritonBackend, indexer

    if args.once:
        inputs = _inputs(128, 131072)
        for _ in range(2):
            async_fp8_logits(*inputs, topk=512, ratio=4)
        torch.cuda.synchronize()
        return 0
    failed = 0
    print("| check | -inf pattern | max abs diff / row max |\n|---|---|---|")
    checks = [("b8 32K", {"batch": 8, "context": 32768}, 1e-3),
              ("b8 32K, unmapped pages, ragged contexts",
               {"batch": 8, "context": 32768, "unmapped": 40, "ragged": True, "seed": 1}, 1e-3),
              ("UE8M0 100..130", {"batch": 4, "context": 16384, "scale_range": (100, 131), "seed": 2}, 1e-3),
              ("UE8M0 0..254 (flushed or rounded blocks)",
               {"batch": 4, "context": 16384, "scale_range": (0, 255), "seed": 3}, None)]
    for name, kw, tol in checks:
        inputs = _inputs(**kw)
        ref = indexer.indexer_logits(*inputs, topk=512, ratio=4)
        for fast, stages in ((False, 2), (False, 4), (True, 2), (True, 4)):
            same, err = compare(ref, async_fp8_logits(*inputs, topk=512, ratio=4, stages=stages, fast=fast))
            bad = not same or (tol is not None and not err < tol)
            failed += bad
            print(f"| {name}, {'integer' if fast else 'cvt'} tables, stages {stages} | "
                  f"{'equal' if same else 'DIFFERENT'} | {err:.2e}{' FAIL' if bad else ''} |")
    inputs = _inputs(128, 131072)
    key_bytes = 128 * (131072 // 4) * 68
    copy_gbs = bench.measure_ceilings()["copy_gbs"]
    backend = TritonBackend()
    q, w, positions, token_request, cache, _, table = inputs
    rows = [("installed logits + top-k (`indexer_topk`)",
             lambda i: backend.indexer_topk(q, w, positions, token_request, cache, table, topk=512,
                                            key_format="indexer_mxfp4")),
            ("installed logits (Triton, exact)",
             lambda i: indexer.indexer_logits(*inputs, topk=512, ratio=4))]
    rows += [(f"async fp8 logits, {'integer' if fast else 'cvt'} tables, stages {st}, splits {sp or 'auto'}",
              lambda i, st=st, sp=sp, fast=fast: async_fp8_logits(
                  *inputs, topk=512, ratio=4, stages=st, num_splits=sp, fast=fast, check_exact=False))
             for fast, st, sp in ((False, 4, 8), (True, 4, None), (True, 4, 16), (True, 6, 16), (True, 8, 16),
                                  (True, 2, 12))]
    print(f"\nb=128 decode tokens at 128K context, mxfp4 keys ({key_bytes / 1e6:.0f} MB), CUDA-graph "
          f"medians; copy {copy_gbs:.0f} GB/s\n\n| call | µs | GB/s | % copy |\n|---|---|---|---|")
    for name, fn in rows:
        us = bench.time_cuda_graph(fn, rotations=8, reps=10) * 1e3  # 8 calls a graph: launch cost amortized
        print(f"| {name} | {us:.1f} | {key_bytes / us / 1e3:.0f} | {key_bytes / us / 1e3 / copy_gbs:.1%} |")
    print(f"\nchecks: {'FAIL' if failed else 'pass'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
