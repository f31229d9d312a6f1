"""Fused compressor (SPEC §5): state save with APE, then per closing block gather + per-channel
softmax + weighted RMSNorm + RoPE + (indexer: Hadamard) + quantize + insert.

Two launches over all T tokens (prefill and decode tokens mixed): ``_save_pool_kernel`` writes
every token's state row and, for a closing token, pools channel chunks of its window into an fp32
scratch, taking rows of tokens in this same call from ``kv_score`` (so no program waits on another's
state write, SPEC §5.4) and older rows from the state; ``_finish_kernel`` normalises, rotates,
(Hadamard, in Kronecker form) quantizes and writes the cache row. Tokens that close no block skip
the pooling and the finish at once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from dsv4.backends.triton._common import (
    INTERPRET,
    ceil_log2_exponent,
    encode_e4m3,
    fp4_code,
    next_pow2,
    pow2_from_exponent,
    round_bf16,
    simulate_fp4,
)
from dsv4.backends.triton.layout import KeyLayout, LatentLayout
from dsv4.backends.triton.qnorm_rope_insert import write_latent_row

__all__ = ["compress_insert"]

# Output kinds of _finish_kernel.
_OUT_LATENT, _OUT_KEY_FP8, _OUT_KEY_MXFP4 = 0, 1, 2


@triton.jit
def _order_check_kernel(positions, token_request, slot_mapping, out_slot_mapping, ratio, num_tokens, result,
                        BLOCK: tl.constexpr):
    """result[0] = min over t of the first token whose pair (t-1, t) is neither (same request, next
    position) nor (request id increases); result[1] = min over active tokens (saving a state row or
    closing a block) of T-1-t. Both start at T (one fill)."""
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < num_tokens
    prev = tl.maximum(idx - 1, 0)
    req = tl.load(token_request + idx, mask=ok, other=0)
    req_prev = tl.load(token_request + prev, mask=ok, other=0)
    pos = tl.load(positions + idx, mask=ok, other=0)
    pos_prev = tl.load(positions + prev, mask=ok, other=0)
    good = ((req == req_prev) & (pos == pos_prev + 1)) | (req > req_prev) | (idx == 0)
    tl.atomic_min(result, tl.min(tl.where(ok & ~good, idx, num_tokens).to(tl.int64), 0))
    slot = tl.load(slot_mapping + idx, mask=ok, other=-1)
    out = tl.load(out_slot_mapping + idx, mask=ok, other=-1)
    active = ok & ((slot >= 0) | ((out >= 0) & ((pos + 1) % ratio == 0)))
    tl.atomic_min(result + 1, tl.min(tl.where(active, num_tokens - 1 - idx, num_tokens).to(tl.int64), 0))


@triton.jit
def _in_order(order, num_tokens):
    """True when every active token precedes the first out-of-order pair (see _order_check_kernel):
    then a request's tokens in this call are one run of consecutive positions, so the window row of
    position q is token t - (p - q) or was written by an earlier call."""
    return tl.load(order) > num_tokens - 1 - tl.load(order + 1)


@triton.jit
def _save_pool_kernel(kv_score, stride_t, positions, token_request, slot_mapping, out_slot_mapping, state, ape,
                      stride_ape, block_table, stride_bt, state_block_size, pooled, ratio, order, num_tokens,
                      D: tl.constexpr, COFF: tl.constexpr, WINDOW: tl.constexpr, WINDOW_P2: tl.constexpr,
                      BD: tl.constexpr, POOL: tl.constexpr):
    """Program t: save token t's state row (SPEC §5.1), then, if t closes a block, pool its window in
    channel chunks of BD (SPEC §5.2) into ``pooled[t]``.

    Window rows of tokens in this call are rebuilt from ``kv_score`` (+ ape, the same fp32 add as the
    save, so bit-identical to the state row) instead of being read back from the state: no program
    depends on another's writes (one launch), and those rows come from L2, not HBM. Only rows
    written by earlier calls are read from the state (SPEC §5.4). ``POOL`` = False (benchmarks
    only) times the save alone.
    """
    HALF: tl.constexpr = COFF * D
    t = tl.program_id(0).to(tl.int64)
    p = tl.load(positions + t)
    slot = tl.load(slot_mapping + t)
    if slot >= 0:
        # SPEC §5.1: state row = [kv | score + ape[p % r]], fp32; whole segments, 16-byte accesses.
        cols = tl.arange(0, D)
        phase = p % ratio
        for seg in tl.static_range(2 * COFF):
            x = tl.load(kv_score + t * stride_t + seg * D + cols)
            if seg >= COFF:
                x = x + tl.load(ape + phase * stride_ape + (seg - COFF) * D + cols)
            tl.store(state + slot * (2 * HALF) + seg * D + cols, x)
    out_slot = tl.load(out_slot_mapping + t)
    if POOL & (out_slot >= 0) & ((p + 1) % ratio == 0) & _in_order(order, num_tokens):
        request = tl.load(token_request + t).to(tl.int64)
        j = tl.arange(0, WINDOW_P2)
        q = p - WINDOW + 1 + j  # gathered positions p-coff*r+1 .. p (SPEC §5.2)
        live = (j < WINDOW) & (q >= 0)
        q_safe = tl.where(live, q, 0)
        page = tl.load(block_table + request * stride_bt + q_safe // state_block_size, mask=live, other=0)
        rows = page.to(tl.int64) * state_block_size + q_safe % state_block_size
        # Token u = t - (p - q) holds position q in this call when its position, request and state slot
        # say so (the slot check makes the shortcut exactly equivalent to reading the state row).
        u = t - (p - q)
        maybe = live & (u >= 0)
        u_safe = tl.where(maybe, u, t)
        in_call = maybe & (tl.load(positions + u_safe, mask=maybe, other=-1) == q)
        in_call = in_call & (tl.load(token_request + u_safe, mask=maybe, other=-1) == request)
        in_call = in_call & (tl.load(slot_mapping + u_safe, mask=maybe, other=-1) == rows)
        from_state = live & ~in_call
        # Separate masked loads (not one select of pointers) keep the 16-byte vector accesses.
        in_base = (u_safe * stride_t)[:, None]
        state_base = (rows * (2 * HALF))[:, None]
        ape_base = ((q_safe % ratio) * stride_ape)[:, None]
        part = (j // ratio)[:, None] * D  # r = 4: previous block columns [0:d], current block [d:2d]
        for c in range(0, D, BD):
            kv_col = part + c + tl.arange(0, BD)[None, :]
            kv_in = tl.load(kv_score + in_base + kv_col, mask=in_call[:, None], other=0.0)
            kv_st = tl.load(state + state_base + kv_col, mask=from_state[:, None], other=0.0)
            kv = tl.where(in_call[:, None], kv_in, kv_st)
            sc_in = tl.load(kv_score + in_base + HALF + kv_col, mask=in_call[:, None], other=0.0)
            sc_in = sc_in + tl.load(ape + ape_base + kv_col, mask=in_call[:, None], other=0.0)
            sc_st = tl.load(state + state_base + HALF + kv_col, mask=from_state[:, None], other=float("-inf"))
            score = tl.where(in_call[:, None], sc_in, sc_st)
            top = tl.max(score, 0)
            e = tl.exp(score - top[None, :])
            weight = e / tl.sum(e, 0)[None, :]  # per-channel softmax over the gathered tokens
            tl.store(pooled + t * D + c + tl.arange(0, BD), tl.sum(weight * kv, 0))


@triton.jit
def _pool_kernel(positions, token_request, out_slot_mapping, state, block_table, stride_bt, state_block_size,
                 pooled, ratio, order, num_tokens, D: tl.constexpr, HALF: tl.constexpr, WINDOW: tl.constexpr,
                 WINDOW_P2: tl.constexpr, BD: tl.constexpr):
    """Fallback pooling for batches out of order (a later launch, so every state row of this call
    is written): the window read from the state (SPEC §5.2). Exits at once for ordered batches."""
    t = tl.program_id(0).to(tl.int64)
    p = tl.load(positions + t)
    out_slot = tl.load(out_slot_mapping + t)
    if (out_slot >= 0) & ((p + 1) % ratio == 0) & (_in_order(order, num_tokens) == 0):
        request = tl.load(token_request + t).to(tl.int64)
        j = tl.arange(0, WINDOW_P2)
        q = p - WINDOW + 1 + j  # gathered positions p-coff*r+1 .. p (SPEC §5.2)
        live = (j < WINDOW) & (q >= 0)
        q_safe = tl.where(live, q, 0)
        page = tl.load(block_table + request * stride_bt + q_safe // state_block_size, mask=live, other=0)
        base = state + (page.to(tl.int64) * state_block_size + q_safe % state_block_size)[:, None] * (2 * HALF)
        part = (j // ratio)[:, None] * D  # r = 4: previous block columns [0:d], current block [d:2d]
        for c in range(0, D, BD):
            kv_col = part + c + tl.arange(0, BD)[None, :]
            kv = tl.load(base + kv_col, mask=live[:, None], other=0.0)
            score = tl.load(base + HALF + kv_col, mask=live[:, None], other=float("-inf"))
            top = tl.max(score, 0)
            e = tl.exp(score - top[None, :])
            weight = e / tl.sum(e, 0)[None, :]  # per-channel softmax over the gathered tokens
            tl.store(pooled + t * D + c + tl.arange(0, BD), tl.sum(weight * kv, 0))


@triton.jit
def _finish_kernel(positions, out_slot_mapping, pooled, norm_weight, cos_sin, stride_cs, hadamard, hadamard_scale,
                   ratio, eps,
                   u8_ptr, bf16_ptr, block_size, page_stride, token_stride, nope_offset, rope_offset,
                   scale_offset, scale_stride,
                   D: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr, QBLOCK: tl.constexpr,
                   SCALE_ROW: tl.constexpr, FP8: tl.constexpr, OUT_KIND: tl.constexpr,
                   DEEPSEEK_ROUNDING: tl.constexpr, HADAMARD: tl.constexpr, HAD_A: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    p = tl.load(positions + t)
    out_slot = tl.load(out_slot_mapping + t)
    if (out_slot >= 0) & ((p + 1) % ratio == 0):
        cols = tl.arange(0, D)
        partner_cols = cols ^ 1
        c = tl.load(pooled + t * D + cols)
        c_partner = tl.load(pooled + t * D + partner_cols)
        w = tl.load(norm_weight + cols)
        w_partner = tl.load(norm_weight + partner_cols)
        if DEEPSEEK_ROUNDING:
            c = round_bf16(c)
            c_partner = round_bf16(c_partner)
        inv = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(c * c, 0) / D + eps))
        n = c * inv * w
        n_partner = c_partner * inv * w_partner
        if DEEPSEEK_ROUNDING:
            n = round_bf16(n)
            n_partner = round_bf16(n_partner)
        # SPEC §4: a compressed entry rotates at the first position of its block.
        cs_row = cos_sin + ((p // ratio) * ratio) * stride_cs
        in_rope = cols >= NOPE
        pair = tl.where(in_rope, (cols - NOPE) // 2, 0)
        cos = tl.load(cs_row + pair, mask=in_rope, other=1.0)
        sin = tl.load(cs_row + ROPE // 2 + pair, mask=in_rope, other=0.0)
        odd = (cols & 1) == 1
        rotated = tl.where(odd, n * cos + n_partner * sin, n * cos - n_partner * sin)
        row = round_bf16(tl.where(in_rope, rotated, n))
        if HADAMARD:
            # SPEC §6.5: Sylvester Walsh-Hadamard, fp32 math, one bf16 round. Sylvester H_D = H_A (x) H_B
            # (D = A*B, index a*B + b), so H x = vec(H_A X H_B) with X = x as [A, B]: A*B*(A+B) products
            # instead of D*D, and only H_B = H[:B, :B] and H_A[a, c] = H[a*B, c*B] are read.
            HB: tl.constexpr = D // HAD_A
            x = tl.reshape(row, (HAD_A, HB))
            ia = tl.arange(0, HAD_A)
            ib = tl.arange(0, HB)
            h_b = tl.load(hadamard + ib[:, None] * D + ib[None, :])
            h_a = tl.load(hadamard + (ia[:, None] * HB) * D + ia[None, :] * HB)
            y = tl.sum(x[:, :, None] * h_b[None, :, :], 1)  # [A, B] = X @ H_B
            z = tl.sum(h_a[:, :, None] * y[None, :, :], 1)  # [A, B] = H_A @ (X @ H_B)
            row = round_bf16(tl.reshape(z, (D,)) * hadamard_scale)
        if OUT_KIND == 0:
            write_latent_row(u8_ptr, bf16_ptr, out_slot, row, cols, block_size, page_stride, token_stride,
                             nope_offset, rope_offset, scale_offset, scale_stride, FP8, D, NOPE, QBLOCK,
                             SCALE_ROW)
        else:
            slot = out_slot.to(tl.int64)
            page_base = (slot // block_size) * page_stride
            in_page = slot % block_size
            if OUT_KIND == 1:
                # SPEC §9.3 fp8 keys: one pow2 scale per vector, 2**ceil(log2(max(amax,1e-4)/448)).
                amax = tl.maximum(tl.max(tl.abs(row), 0), 1e-4)
                e = ceil_log2_exponent(tl.div_rn(amax, 448.0))
                scaled = tl.minimum(tl.maximum(row * pow2_from_exponent(-e), -448.0), 448.0)
                tl.store(u8_ptr + page_base + in_page * token_stride + cols, encode_e4m3(scaled))
                scale_ptr = (u8_ptr + page_base + scale_offset + in_page * scale_stride).to(
                    tl.pointer_type(tl.float32))
                tl.store(scale_ptr, pow2_from_exponent(e))
            else:
                # SPEC §9.3 mxfp4 keys: e2m1 per QBLOCK with UE8M0 scales, nibbles packed low-first.
                blocks = tl.reshape(row, (D // QBLOCK, QBLOCK))
                amax = tl.maximum(tl.max(tl.abs(blocks), 1), 6.0 * 1.1754943508222875e-38)
                e = ceil_log2_exponent(tl.div_rn(amax, 6.0))
                scaled = blocks * pow2_from_exponent(-e)[:, None]
                q = simulate_fp4(scaled)
                code = fp4_code(tl.abs(q)) | ((q < 0) | ((q == 0) & (scaled < 0))).to(tl.int32) * 8
                code = tl.reshape(code, (D // 2, 2))
                low, high = tl.split(code)
                tl.store(u8_ptr + page_base + in_page * token_stride + tl.arange(0, D // 2),
                         (low | (high << 4)).to(tl.uint8))
                tl.store(u8_ptr + page_base + scale_offset + in_page * scale_stride + tl.arange(0, D // QBLOCK),
                         (e + 127).to(tl.uint8))


def compress_insert(kv_score: torch.Tensor, positions: torch.Tensor, token_request: torch.Tensor,
                    state_cache: torch.Tensor, state_block_table: torch.Tensor,
                    state_slot_mapping: torch.Tensor, ape: torch.Tensor, norm_weight: torch.Tensor,
                    cos_sin: torch.Tensor, out_cache: torch.Tensor, out_layout: LatentLayout | KeyLayout,
                    out_slot_mapping: torch.Tensor, *, ratio: int, head_dim: int, deepseek_rounding: bool,
                    hadamard: torch.Tensor | None, rope_dim: int, eps: float, _pool: bool = True,
                    _finish: bool = True, _pool_block: int | None = None, _num_warps: int | None = None) -> None:
    """Launch. kv_score [T, 2*coff*d] fp32; state_cache fp32 [nb, bs, 2*coff*d]; see ARCHITECTURE §3.2.

    ``_pool`` / ``_finish`` = False (benchmarks only: docs/triton.md's time split) skip the pooling of
    the first launch / the fallback pool and finish launches; ``_pool_block`` / ``_num_warps`` tune
    the first launch.
    """
    num_tokens = kv_score.shape[0]
    if num_tokens == 0:
        return
    coff = 2 if ratio == 4 else 1
    window = coff * ratio
    window_p2 = next_pow2(window)
    # Pool channel chunk: [window, BD] tiles of ~2K floats (five such tiles live in registers: the
    # in-call and state candidates of kv and score, and the ape bias): r = 4 [8, 256], r = 128 [128, 16].
    bd = _pool_block or min(head_dim, max(16, 2048 // window_p2))
    extra = {} if INTERPRET else {"num_warps": _num_warps or 4}
    pooled = torch.empty((num_tokens, head_dim), dtype=torch.float32, device=kv_score.device)
    order = torch.full((2,), num_tokens, dtype=torch.int64, device=kv_score.device)
    check_block = 1024
    _order_check_kernel[(-(-num_tokens // check_block),)](
        positions, token_request, state_slot_mapping, out_slot_mapping, ratio, num_tokens, order, BLOCK=check_block)
    _save_pool_kernel[(num_tokens,)](
        kv_score, kv_score.stride(0), positions, token_request, state_slot_mapping, out_slot_mapping, state_cache,
        ape, ape.stride(0), state_block_table, state_block_table.stride(0), state_cache.shape[1], pooled, ratio,
        order, num_tokens, D=head_dim, COFF=coff, WINDOW=window, WINDOW_P2=window_p2, BD=bd, POOL=_pool, **extra)
    if not _finish:
        return
    _pool_kernel[(num_tokens,)](
        positions, token_request, out_slot_mapping, state_cache, state_block_table, state_block_table.stride(0),
        state_cache.shape[1], pooled, ratio, order, num_tokens, D=head_dim, HALF=coff * head_dim, WINDOW=window,
        WINDOW_P2=window_p2, BD=bd)
    if isinstance(out_layout, LatentLayout):
        kind, fp8 = _OUT_LATENT, out_layout.fp8_nope
        u8, bf16 = out_layout.byte_views(out_cache)
        args = out_layout.kernel_args()
        nope, qblock = out_layout.nope_dim, out_layout.quant_block
        scale_row = next_pow2(max(out_layout.scale_row_bytes, 1)) if fp8 else 1
    else:
        kind = _OUT_KEY_FP8 if out_layout.format_name == "indexer_fp8" else _OUT_KEY_MXFP4
        fp8 = False
        u8 = bf16 = out_cache
        block, stride, value_bytes, scale_offset, scale_bytes = out_layout.kernel_args()
        args = (block, stride, value_bytes, 0, 0, scale_offset, scale_bytes)
        nope, qblock, scale_row = head_dim - rope_dim, out_layout.quant_block, 1
    use_hadamard = hadamard is not None
    _finish_kernel[(num_tokens,)](
        positions, out_slot_mapping, pooled, norm_weight, cos_sin, cos_sin.stride(0),
        hadamard if use_hadamard else pooled, head_dim ** -0.5, ratio, eps,
        u8, bf16, *args,
        D=head_dim, NOPE=nope, ROPE=rope_dim, QBLOCK=qblock, SCALE_ROW=scale_row, FP8=fp8, OUT_KIND=kind,
        DEEPSEEK_ROUNDING=deepseek_rounding, HADAMARD=use_hadamard, HAD_A=1 << (head_dim.bit_length() - 1) // 2)
