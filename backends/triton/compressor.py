"""Fused compressor (SPEC §5): state save with APE, per-channel softmax pooling of each closing block,
weighted RMSNorm + RoPE + (indexer: Hadamard) + quantize + cache insert.

Two launches over all T tokens (prefill and decode tokens mixed), no order pre-pass:

- ``_save_fuse_kernel``: one program per group of G tokens (G = r when fusing). It saves the group's
  state rows (SPEC §5.1) from one 2-D tile load and, when the group holds a token closing a block of
  one request whose window rows are all tokens of this call (checked per row: position, request and
  state slot, so the shortcut equals reading the state), pools that block and finishes it: norm,
  RoPE, Hadamard, quantize, write (``compressor_finish``). A block that is the group itself pools
  from the rows the group holds in registers (r = 4 re-reads the previous block's half columns from
  ``kv_score``, in L2); a block of a request that starts at an unaligned token index (packed
  multi-request prefill) re-reads its own rows from ``kv_score`` too. It never reads the state, so no
  program depends on another's writes. A per-group flag records which closing token it finished and
  how many it left.
- ``_state_pool_kernel``: every other closing token (decode, first block of a chunk, a second closing
  token in one group, out-of-order batches) pools its window from the state, now complete
  (a later launch), and finishes it. When the first launch left nothing it only reads the flags.

Under the caller's ``windows_in_call`` promise (a fresh prefill batch: every closing block's window is in the
call) the first launch trusts it, with no window check and no flags, and the second launch is not made.

r = 4 pools in two passes over the 8 rows in registers; r = 128 streams its 128 rows in chunks of
R rows with an online (rescaled) softmax, so the pooled row stays in registers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from dsv4.backends.triton._common import INTERPRET, device_facts, gdc_launch_dependents, gdc_wait, next_pow2
from dsv4.backends.triton.compressor_finish import OUT_KEY_FP8, OUT_KEY_MXFP4, OUT_LATENT, _finish
from dsv4.backends.triton.layout import KeyLayout, LatentLayout

__all__ = ["compress_insert"]

@triton.jit
def _online(m, s, acc, kv, score):
    """One chunk [R, D] of an online per-channel softmax pool: running max m, sum s, sum e*kv acc."""
    top = tl.maximum(m, tl.max(score, 0))
    safe = tl.where(top == float("-inf"), 0.0, top)  # all rows so far masked (positions < 0)
    scale = tl.exp(m - safe)
    e = tl.exp(score - safe[None, :])
    return top, s * scale + tl.sum(e, 0), acc * scale + tl.sum(e * kv, 0)


@triton.jit
def _row(x, k, N: tl.constexpr):
    """Row k of an [N, D] fp32 tile, exactly: an integer sum of its bits and zeros, which the compiler folds
    away (an fp32 ``x + 0.0`` stays an add)."""
    bits = tl.where(tl.arange(0, N)[:, None] == k, x.to(tl.int32, bitcast=True), 0)
    return tl.sum(bits, 0).to(tl.float32, bitcast=True)


@triton.jit
def _splat(flag, like):
    """Scalar bool -> bool tensor shaped like ``like`` (the CPU interpreter turns scalar & tensor into ints)."""
    return (flag.to(tl.int32) + tl.zeros_like(like).to(tl.int32)) != 0


@triton.jit
def _store_flag(ptr, fast, closing, idx):
    """Group flag (int32) for the second launch: bit 0 = one closing token finished here, bits 1-7 = its index
    in the group (``idx`` < 128), bits 8.. = closing tokens left (``closing``: bool flags or int32 counts
    of the group's closing tokens, summed)."""
    left = tl.sum(closing.to(tl.int32), 0) - fast.to(tl.int32)
    tl.store(ptr, fast.to(tl.int32) | (tl.where(fast, idx, 0) << 1) | (left << 8))


@triton.jit
def _window_in_call(t_first, q, live, request, positions, token_request, slot_mapping, block_table, stride_bt,
                    state_block_size, N: tl.constexpr):
    """[n] bool: position q (live: q >= 0 of a closing block) of ``request`` is held by token
    t_first + i of this call, whose state slot is the block table's slot (so its kv_score row plus
    ape is exactly the state row the reference would read)."""
    u = t_first + tl.arange(0, N)
    maybe = live & (u >= 0)
    q_safe = tl.where(live, q, 0).to(tl.int32)  # 32-bit division (positions < 2**31): no 64-bit call
    page = tl.load(block_table + request * stride_bt + q_safe // state_block_size, mask=live, other=0)
    rows = page.to(tl.int64) * state_block_size + q_safe % state_block_size
    hit = maybe & (tl.load(positions + u, mask=maybe, other=-1) == q)
    hit = hit & (tl.load(token_request + u, mask=maybe, other=-1) == request)
    return hit & (tl.load(slot_mapping + u, mask=maybe, other=-1) == rows)


@triton.jit
def _pick_vector(t0, p, out, req, ok, RATIO: tl.constexpr):
    """The group's (G = r tokens) last token that closes a block, at any index, from the group's loaded
    positions, output slots, requests and validity [r]: (closes, tc, idx, pc, oc, rc); no load waits on the
    choice."""
    j = tl.arange(0, RATIO)
    idx = tl.max(tl.where(ok & (out >= 0) & ((p + 1) % RATIO == 0), j, -1), 0)
    pc = tl.sum(tl.where(j == idx, p, 0), 0)
    oc = tl.sum(tl.where(j == idx, out, 0), 0)
    rc = tl.sum(tl.where(j == idx, req, 0), 0).to(tl.int64)
    return idx >= 0, t0 + tl.maximum(idx, 0), idx, pc, oc, rc


@triton.jit
def _pick_scalar(t0, num_tokens, positions, out_slot_mapping, token_request, G: tl.constexpr,
                 RATIO: tl.constexpr):
    """r = 128 (G = r, several warps, no cross-warp reductions): the candidate block of the group, found from the
    group's last token t (position p): tc = t - (p + 1) % r, the token whose position closes a block if the
    tokens from tc to t are one request's consecutive positions (the caller's window check verifies the rows).
    Aligned groups (tc = t) read nothing more. Returns (closes, tc, idx, pc, oc, rc); ``closes`` is False
    when tc holds no closing token (a request boundary inside the group)."""
    t_last = tl.minimum(t0 + G - 1, num_tokens - 1)
    p_last = tl.load(positions + t_last)
    o_last = tl.load(out_slot_mapping + t_last)
    r_last = tl.load(token_request + t_last)
    tc = t_last - (p_last + 1) % RATIO
    inside = (tc >= t0) & (tc <= t_last)
    other = inside & (tc != t_last)
    pc = tl.where(other, tl.load(positions + tc, mask=other, other=0), p_last)
    oc = tl.where(other, tl.load(out_slot_mapping + tc, mask=other, other=-1), o_last)
    rc = tl.where(other, tl.load(token_request + tc, mask=other, other=0), r_last).to(tl.int64)
    closes = inside & (oc >= 0) & ((pc + 1) % RATIO == 0)
    return closes, tc, (tc - t0).to(tl.int32), pc, oc, rc


@triton.jit
def _window_check(closes, tc, pc, rc, positions, token_request, slot_mapping, block_table, stride_bt,
                  state_block_size, RATIO: tl.constexpr, COFF: tl.constexpr):
    """fast: the block closing at token tc (position pc, request rc) has every row of its window held by a
    token of this call at its expected index (or at a position < 0)."""
    j = tl.arange(0, RATIO)
    q_own = pc - RATIO + 1 + j
    own = _window_in_call(tc - RATIO + 1, q_own, _splat(closes, q_own) & (q_own >= 0), rc, positions,
                          token_request, slot_mapping, block_table, stride_bt, state_block_size, RATIO)
    fast = closes & (tl.sum(own.to(tl.int32), 0) == RATIO)
    if COFF == 2:
        # r = 4 overlap: positions pc-7..pc-4 (previous block) are tokens tc-7..tc-4 or before position 0.
        q_prev = pc - 2 * RATIO + 1 + j
        prev_live = _splat(closes, q_prev) & (q_prev >= 0)
        prev = _window_in_call(tc - 2 * RATIO + 1, q_prev, prev_live, rc, positions, token_request, slot_mapping,
                               block_table, stride_bt, state_block_size, RATIO)
        fast = fast & (tl.sum((prev_live & ~prev).to(tl.int32), 0) == 0)
    return fast


@triton.jit
def _save_fuse_kernel(kv_score, stride_t, positions, token_request, slot_mapping, out_slot_mapping, state, ape,
                      stride_ape, block_table, stride_bt, state_block_size: tl.constexpr, fused, num_tokens,
                      norm_weight, cos_sin, stride_cs, hadamard, hadamard_scale, eps,
                      u8_ptr, bf16_ptr, block_size: tl.constexpr, page_stride, token_stride, nope_offset,
                      rope_offset, scale_offset, scale_stride,
                      RATIO: tl.constexpr, D: tl.constexpr, COFF: tl.constexpr, G: tl.constexpr, R: tl.constexpr,
                      FUSE: tl.constexpr, IN_CALL: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr,
                      NOPE: tl.constexpr, ROPE: tl.constexpr,
                      QBLOCK: tl.constexpr, SCALE_ROW: tl.constexpr, FP8: tl.constexpr, OUT_KIND: tl.constexpr,
                      DEEPSEEK_ROUNDING: tl.constexpr, HADAMARD: tl.constexpr, HAD_A: tl.constexpr):
    """Program g: the G tokens from g*G. Saves their state rows [kv | score + ape[p % r]] (SPEC §5.1); with
    FUSE (G = r) also pools + finishes the block closing at the group's last closing token (``_pick_vector``
    / ``_pick_scalar``, any index in the group) when ``_window_check`` finds its whole window in this call,
    and writes ``fused[g]`` (``_store_flag``: which token it finished, closing tokens left). IN_CALL (the
    caller's ``windows_in_call`` promise; no second launch): the window is known to be in the call, so no
    window check and no flag."""
    HALF: tl.constexpr = COFF * D
    cols = tl.arange(0, D)
    if PDL:
        gdc_wait()  # launched early (PDL): the previous kernel's writes (kv_score, state) are visible after this
        gdc_launch_dependents()  # the second launch may start (and wait) on SMs this one leaves idle
    if COFF == 2:
        group = tl.program_id(0)
        t0 = group.to(tl.int64) * G
        # r = 4: row = [kv_a | kv_b | sc_a | sc_b], one [G, D] tile per segment; the tiles are loaded first
        # (their addresses need no other load), so the window check's loads overlap them.
        t = t0 + tl.arange(0, G)
        ok = t < num_tokens
        src = kv_score + t[:, None] * stride_t + cols[None, :]
        kv_a = tl.load(src, mask=ok[:, None], other=0.0)
        kv_b = tl.load(src + D, mask=ok[:, None], other=0.0)
        sc_a = tl.load(src + 2 * D, mask=ok[:, None], other=0.0)
        sc_b = tl.load(src + 3 * D, mask=ok[:, None], other=0.0)
        p = tl.load(positions + t, mask=ok, other=0)
        slot = tl.load(slot_mapping + t, mask=ok, other=-1)
        out = tl.load(out_slot_mapping + t, mask=ok, other=-1)
        req = tl.load(token_request + t, mask=ok, other=-1) if FUSE else p
        if EARLY:
            tl.debug_barrier()  # keeps the compiler from sinking the loads above below the window check
        if FUSE:
            closes, tc, idx, pc, oc, rc = _pick_vector(t0, p, out, req, ok, RATIO)
            if IN_CALL:
                fast = closes
            else:
                fast = _window_check(closes, tc, pc, rc, positions, token_request, slot_mapping, block_table,
                                     stride_bt, state_block_size, RATIO, COFF)
                _store_flag(fused + group, fast, ok & (out >= 0) & ((p + 1) % RATIO == 0), idx)
        save = (ok & (slot >= 0))[:, None]
        dst = state + slot[:, None] * (2 * HALF) + cols[None, :]
        ape_row = ape + (p % RATIO)[:, None] * stride_ape + cols[None, :]
        ape_a = tl.load(ape_row, mask=ok[:, None], other=0.0)
        sc_a = sc_a + ape_a
        sc_b = sc_b + tl.load(ape_row + D, mask=ok[:, None], other=0.0)
        tl.store(dst, kv_a, mask=save)
        tl.store(dst + D, kv_b, mask=save)
        tl.store(dst + 2 * D, sc_a, mask=save)
        tl.store(dst + 3 * D, sc_b, mask=save)
        if FUSE:  # noqa: SIM102 - a compile-time guard (fast, pc, oc exist only when FUSE)
            if fast:
                # The block closing at token tc: columns [d:2d] of tokens tc-3..tc and, previous block, columns
                # [0:d] of tokens tc-7..tc-4 (this call, or positions < 0), with APE phases 0..3.
                j = tl.arange(0, G)
                live = (pc - 2 * G + 1 + j) >= 0
                prev_src = kv_score + (tc - 2 * G + 1 + j)[:, None] * stride_t + cols[None, :]
                kv_p = tl.load(prev_src, mask=live[:, None], other=0.0)
                if idx == G - 1:  # aligned: the block is this group's rows, in registers, phases 0..3 in order
                    ape_p = ape_a
                    kv_c = kv_b
                    sc_c = sc_b
                else:  # a request starting at an unaligned token index: its rows from kv_score (L2) as well
                    ape_rows = ape + j[:, None] * stride_ape + cols[None, :]
                    ape_p = tl.load(ape_rows)
                    cur_src = kv_score + (tc - G + 1 + j)[:, None] * stride_t + D + cols[None, :]
                    kv_c = tl.load(cur_src)
                    sc_c = tl.load(cur_src + 2 * D) + tl.load(ape_rows + D)
                sc_p = tl.load(prev_src + 2 * D, mask=live[:, None], other=0.0) + ape_p
                sc_p = tl.where(live[:, None], sc_p, float("-inf"))
                top = tl.maximum(tl.max(sc_p, 0), tl.max(sc_c, 0))
                e_p = tl.exp(sc_p - top[None, :])
                e_b = tl.exp(sc_c - top[None, :])
                # Sums in window order (rows p-7 .. p): the order of one 8-row tl.sum under the interpreter
                # and of torch's CPU reduction, so fewer last-bit differences for FP4 keys to amplify.
                total = tl.sum(e_p, 0)
                for k in tl.static_range(G):
                    total += _row(e_b, k, G)
                # e / total on the GPU is e * rcp.approx(total) (div.full; total in [1, 8] needs no range
                # scaling), so one reciprocal a column gives the same bits with 2 instructions less a quotient.
                inv = 1.0 / total
                c = tl.sum(e_p * inv[None, :] * kv_p, 0)
                w_kv = e_b * inv[None, :] * kv_c
                for k in tl.static_range(G):
                    c += _row(w_kv, k, G)
                _finish(c, pc, oc, norm_weight, cos_sin, stride_cs, hadamard, hadamard_scale, eps,
                        u8_ptr, bf16_ptr, block_size, page_stride, token_stride, nope_offset, rope_offset,
                        scale_offset, scale_stride, RATIO, D, NOPE, ROPE, QBLOCK, SCALE_ROW, FP8, OUT_KIND,
                        DEEPSEEK_ROUNDING, HADAMARD, HAD_A)
    else:
        # r = 128: row = [kv | sc]; the G rows in chunks of R, pooled online on the way (used if the group is the
        # block); a block of a request that starts at an unaligned token index is pooled in a second pass.
        t0 = tl.program_id(0).to(tl.int64) * G
        if FUSE:
            closes, tc, idx, pc, oc, rc = _pick_scalar(t0, num_tokens, positions, out_slot_mapping, token_request,
                                                       G, RATIO)
            if not closes:  # a request boundary inside the group: search all G tokens (cross-warp reductions)
                tg = t0 + tl.arange(0, G)
                ok_g = tg < num_tokens
                closes, tc, idx, pc, oc, rc = _pick_vector(
                    t0, tl.load(positions + tg, mask=ok_g, other=0), tl.load(out_slot_mapping + tg, mask=ok_g, other=-1),
                    tl.load(token_request + tg, mask=ok_g, other=-1), ok_g, RATIO)
            if IN_CALL:
                fast = closes
            else:
                fast = _window_check(closes, tc, pc, rc, positions, token_request, slot_mapping, block_table,
                                     stride_bt, state_block_size, RATIO, COFF)
            closing = tl.zeros((R,), tl.int32)
            m = tl.full((D,), float("-inf"), tl.float32)
            s = tl.zeros((D,), tl.float32)
            acc = tl.zeros((D,), tl.float32)
        for i in range(G // R):
            t = t0 + i * R + tl.arange(0, R)
            ok = t < num_tokens
            p = tl.load(positions + t, mask=ok, other=0)
            slot = tl.load(slot_mapping + t, mask=ok, other=-1)
            src = kv_score + t[:, None] * stride_t + cols[None, :]
            kv = tl.load(src, mask=ok[:, None], other=0.0)
            sc = tl.load(src + D, mask=ok[:, None], other=0.0) + tl.load(
                ape + (p % RATIO)[:, None] * stride_ape + cols[None, :], mask=ok[:, None], other=0.0)
            dst = state + slot[:, None] * (2 * HALF) + cols[None, :]
            save = (ok & (slot >= 0))[:, None]
            tl.store(dst, kv, mask=save)
            tl.store(dst + D, sc, mask=save)
            if FUSE:
                m, s, acc = _online(m, s, acc, kv, sc)
                if not IN_CALL:
                    out = tl.load(out_slot_mapping + t, mask=ok, other=-1)
                    closing += (ok & (out >= 0) & ((p + 1) % RATIO == 0)).to(tl.int32)
        if FUSE and not IN_CALL:
            _store_flag(fused + tl.program_id(0), fast, closing, idx)
        if FUSE:  # noqa: SIM102 - a compile-time guard (fast, pc, oc exist only when FUSE)
            if fast:
                if idx != G - 1:  # the block is tokens tc-127..tc (this call): re-read them from kv_score (L2)
                    m = tl.full((D,), float("-inf"), tl.float32)
                    s = tl.zeros((D,), tl.float32)
                    acc = tl.zeros((D,), tl.float32)
                    for i in range(G // R):
                        k = i * R + tl.arange(0, R)  # row k of the block: APE phase k
                        src = kv_score + (tc - G + 1 + k)[:, None] * stride_t + cols[None, :]
                        sc = tl.load(src + D) + tl.load(ape + k[:, None] * stride_ape + cols[None, :])
                        m, s, acc = _online(m, s, acc, tl.load(src), sc)
                _finish(tl.div_rn(acc, s), pc, oc, norm_weight, cos_sin, stride_cs, hadamard, hadamard_scale, eps,
                        u8_ptr, bf16_ptr, block_size, page_stride, token_stride, nope_offset, rope_offset,
                        scale_offset, scale_stride, RATIO, D, NOPE, ROPE, QBLOCK, SCALE_ROW, FP8, OUT_KIND,
                        DEEPSEEK_ROUNDING, HADAMARD, HAD_A)


@triton.jit
def _state_pool_kernel(positions, token_request, out_slot_mapping, state, block_table, stride_bt,
                       state_block_size: tl.constexpr,
                       fused, num_tokens, norm_weight, cos_sin, stride_cs, hadamard, hadamard_scale, eps,
                       u8_ptr, bf16_ptr, block_size: tl.constexpr, page_stride, token_stride, nope_offset,
                       rope_offset, scale_offset, scale_stride,
                       RATIO: tl.constexpr, D: tl.constexpr, COFF: tl.constexpr, GB: tl.constexpr,
                       FUSE_G: tl.constexpr, R: tl.constexpr, PDL: tl.constexpr, NOPE: tl.constexpr,
                       ROPE: tl.constexpr,
                       QBLOCK: tl.constexpr, SCALE_ROW: tl.constexpr, FP8: tl.constexpr, OUT_KIND: tl.constexpr,
                       DEEPSEEK_ROUNDING: tl.constexpr, HADAMARD: tl.constexpr, HAD_A: tl.constexpr):
    """Program b: tokens [b*GB, b*GB+GB). Each closing token that ``_save_fuse_kernel`` did not finish
    (FUSE_G > 0: its group size, else none) pools its window from the state (every row of this call
    is written by then, SPEC §5.2 / §5.4) and finishes it."""
    HALF: tl.constexpr = COFF * D
    WINDOW: tl.constexpr = COFF * RATIO
    if PDL:
        gdc_wait()  # the first launch's writes (flags, state rows) are visible after this
        gdc_launch_dependents()  # the next call's first launch may start; it waits for this one
    t = tl.program_id(0).to(tl.int64) * GB + tl.arange(0, GB)
    ok = t < num_tokens
    if FUSE_G > 0:
        # The first launch's group flags (_store_flag) say whether any closing token is left (one load, no
        # positions) and which one the first launch finished.
        flag = tl.load(fused + t // FUSE_G, mask=ok, other=0)
        left = tl.sum(flag >> 8, 0)
        done = ((flag & 1) != 0) & (t % FUSE_G == ((flag >> 1) & 127))
    else:
        left = 1
    todo = t < 0
    if left > 0:
        p = tl.load(positions + t, mask=ok, other=0)
        out = tl.load(out_slot_mapping + t, mask=ok, other=-1)
        todo = ok & (out >= 0) & ((p + 1) % RATIO == 0)
        if FUSE_G > 0:
            todo = todo & ~done
    if tl.sum(todo.to(tl.int32), 0) > 0:
        cols = tl.arange(0, D)
        for k in range(GB):
            tk = tl.program_id(0).to(tl.int64) * GB + k
            ok_k = tk < num_tokens
            pk = tl.load(positions + tk, mask=ok_k, other=0)
            ok_k = ok_k & (tl.sum(tl.where(tl.arange(0, GB) == k, todo.to(tl.int32), 0), 0) > 0)
            if ok_k:
                request = tl.load(token_request + tk).to(tl.int64)
                out_k = tl.load(out_slot_mapping + tk)
                bt_row = block_table + request * stride_bt
                if COFF == 2:
                    # r = 4: positions p-7..p-4 use columns [0:d], p-3..p columns [d:2d]; < 0: kv 0, score -inf.
                    j = tl.arange(0, WINDOW)
                    q = pk - WINDOW + 1 + j
                    live = q >= 0
                    q_safe = tl.where(live, q, 0).to(tl.int32)
                    page = tl.load(bt_row + q_safe // state_block_size, mask=live, other=0)
                    rows = page.to(tl.int64) * state_block_size + q_safe % state_block_size
                    src = state + (rows * (2 * HALF) + (j // RATIO) * D)[:, None] + cols[None, :]
                    kv = tl.load(src, mask=live[:, None], other=0.0)
                    score = tl.load(src + HALF, mask=live[:, None], other=float("-inf"))
                    e = tl.exp(score - tl.max(score, 0)[None, :])
                    c = tl.sum(e / tl.sum(e, 0)[None, :] * kv, 0)  # per-channel softmax over the window
                else:
                    m = tl.full((D,), float("-inf"), tl.float32)
                    s = tl.zeros((D,), tl.float32)
                    acc = tl.zeros((D,), tl.float32)
                    for i in range(WINDOW // R):
                        q = pk - WINDOW + 1 + i * R + tl.arange(0, R)
                        live = q >= 0
                        q_safe = tl.where(live, q, 0).to(tl.int32)
                        page = tl.load(bt_row + q_safe // state_block_size, mask=live, other=0)
                        rows = page.to(tl.int64) * state_block_size + q_safe % state_block_size
                        src = state + (rows * (2 * HALF))[:, None] + cols[None, :]
                        kv = tl.load(src, mask=live[:, None], other=0.0)
                        score = tl.load(src + HALF, mask=live[:, None], other=float("-inf"))
                        m, s, acc = _online(m, s, acc, kv, score)
                    c = tl.div_rn(acc, s)
                _finish(c, pk, out_k, norm_weight, cos_sin, stride_cs, hadamard, hadamard_scale, eps,
                        u8_ptr, bf16_ptr, block_size, page_stride, token_stride, nope_offset, rope_offset,
                        scale_offset, scale_stride, RATIO, D, NOPE, ROPE, QBLOCK, SCALE_ROW, FP8, OUT_KIND,
                        DEEPSEEK_ROUNDING, HADAMARD, HAD_A)


def compress_insert(kv_score: torch.Tensor, positions: torch.Tensor, token_request: torch.Tensor,
                    state_cache: torch.Tensor, state_block_table: torch.Tensor,
                    state_slot_mapping: torch.Tensor, ape: torch.Tensor, norm_weight: torch.Tensor,
                    cos_sin: torch.Tensor, out_cache: torch.Tensor, out_layout: LatentLayout | KeyLayout,
                    out_slot_mapping: torch.Tensor, *, ratio: int, head_dim: int, deepseek_rounding: bool,
                    hadamard: torch.Tensor | None, rope_dim: int, eps: float, _fuse: bool | None = None,
                    _rows: int | None = None, _warps: int | None = None, _pool_group: int | None = None,
                    _pool_warps: int | None = None, _save_only: bool = False, _second: bool = True,
                    _early: bool | None = None, _pdl: bool | None = None, windows_in_call: bool = False) -> None:
    """Launch. kv_score [T, 2*coff*d] fp32; state_cache fp32 [nb, bs, 2*coff*d]; see ARCHITECTURE §3.2.

    Tuning (benchmarks and tests; defaults from the H200 sweep in docs/triton.md): ``_fuse`` forces the
    fused path on / off (default: r = 4 always, r = 128 from 8192 tokens on, where 128-token groups
    still fill the GPU); ``_rows`` rows per chunk (r = 128), ``_warps`` / ``_pool_warps`` warps of the
    two launches, ``_pool_group`` tokens per program of the second launch; ``_save_only`` skips
    pooling, ``_second`` = False the second launch (docs/triton.md's time split); ``_early`` (r = 4) issues
    the group's loads before the window check (a barrier keeps the compiler from sinking them; default on
    for d = 128). ``hadamard`` [d, d] (Sylvester, SPEC §6.5) only switches the rotation on: its factors are
    built in registers. ``_pdl`` (default: on where supported, NVIDIA sm_90+) launches both kernels with
    programmatic dependent launch: each waits (griddepcontrol.wait) for the previous kernel's writes before
    its first access, so results are unchanged; the launch latency overlaps the previous kernel's tail.
    ``windows_in_call`` (the caller's promise that every closing block's window is tokens of this call or
    positions < 0, each request's tokens consecutive in position order, state slots from the block table:
    then at most one token a group closes and the window check would pass for it) drops the window check
    and the flags from the first launch and skips the second when the first one pools (``fuse``): a fresh
    prefill batch costs one launch (H200, 32K tokens: d = 128 44.7 us vs 49.6, docs/triton.md tenth round).
    """
    num_tokens = kv_score.shape[0]
    if num_tokens == 0:
        return
    coff = 2 if ratio == 4 else 1
    fuse = (ratio == 4 or num_tokens >= 8192) if _fuse is None else _fuse
    fuse = fuse and not _save_only
    group = ratio if fuse else (4 if ratio == 4 else 1)
    rows = _rows or min(group, 8)
    if isinstance(out_layout, LatentLayout):
        kind, fp8 = OUT_LATENT, out_layout.fp8_nope
        u8, bf16 = out_layout.byte_views(out_cache)
        args = out_layout.kernel_args()
        nope, qblock = out_layout.nope_dim, out_layout.quant_block
        scale_row = next_pow2(max(out_layout.scale_row_bytes, 1)) if fp8 else 1
    else:
        kind = OUT_KEY_FP8 if out_layout.format_name == "indexer_fp8" else OUT_KEY_MXFP4
        fp8 = False
        u8 = bf16 = out_cache
        block, stride, value_bytes, scale_offset, scale_bytes = out_layout.kernel_args()
        args = (block, stride, value_bytes, 0, 0, scale_offset, scale_bytes)
        nope, qblock, scale_row = head_dim - rope_dim, out_layout.quant_block, 1
    use_hadamard = hadamard is not None
    programs = triton.cdiv(num_tokens, group)
    in_call = fuse and windows_in_call  # the first launch finishes every block: no window check, flags, second launch
    fused = torch.empty((programs if fuse and not in_call else 1,), dtype=torch.int32, device=kv_score.device)
    finish_args = (norm_weight, cos_sin, cos_sin.stride(0), hadamard if use_hadamard else norm_weight,
                   head_dim ** -0.5, eps, u8, bf16, *args)
    finish_meta = {"NOPE": nope, "ROPE": rope_dim, "QBLOCK": qblock, "SCALE_ROW": scale_row, "FP8": fp8,
                   "OUT_KIND": kind, "DEEPSEEK_ROUNDING": deepseek_rounding, "HADAMARD": use_hadamard,
                   "HAD_A": 1 << (head_dim.bit_length() - 1) // 2}
    # Warps: many small programs in flight beat wide ones (H200, 32K tokens: r = 4 d = 512 4 warps 166 us,
    # 8 warps 331 us; d = 128 1 warp 51 us, 4 warps 228 us; r = 128 4 warps 84 us, 8 warps 93 us).
    default_warps = 4 if head_dim == 512 else 1
    warps = {} if INTERPRET else {"num_warps": _warps or default_warps}
    pdl = device_facts(kv_score.device).pdl and (_pdl is None or _pdl)
    launch = {"launch_pdl": True} if pdl else {}
    _save_fuse_kernel[(programs,)](
        kv_score, kv_score.stride(0), positions, token_request, state_slot_mapping, out_slot_mapping, state_cache,
        ape, ape.stride(0), state_block_table, state_block_table.stride(0), state_cache.shape[1], fused, num_tokens,
        *finish_args, RATIO=ratio, D=head_dim, COFF=coff, G=group, R=rows, FUSE=fuse, IN_CALL=in_call,
        EARLY=head_dim == 128 if _early is None else _early, PDL=pdl, **finish_meta, **warps, **launch)
    if _save_only or not _second or in_call:
        return
    # Second launch: one token a program for small batches (decode); groups of 16 for large ones, where
    # most programs only read the flags and exit (wider groups serialise unaligned requests' blocks).
    pool_group = _pool_group or (1 if num_tokens <= 2048 else 16)
    # d = 128 pools on one warp, as the first launch (H200, 8 requests x ~4K unaligned: 64 us vs 160 us on 4).
    pool_warps = {} if INTERPRET else {"num_warps": _pool_warps or (4 if head_dim == 512 else 1)}
    _state_pool_kernel[(triton.cdiv(num_tokens, pool_group),)](
        positions, token_request, out_slot_mapping, state_cache, state_block_table, state_block_table.stride(0),
        state_cache.shape[1], fused, num_tokens, *finish_args, RATIO=ratio, D=head_dim, COFF=coff, GB=pool_group,
        FUSE_G=group if fuse else 0, R=_rows or 8, PDL=pdl, **finish_meta, **pool_warps, **launch)
