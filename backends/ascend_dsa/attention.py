"""Ascend sparse attention (SPEC §7) through vllm-ascend's ``_C_ascend`` operators.

A2/A3: ``npu_sparse_attn_sharedkv`` over ``ascend_bf16`` caches ``[nb, B, 1, 512]``; A5:
``npu_kv_quant_sparse_attn_sharedkv`` over ``ascend_a5`` records, viewed as the operator's
``[nb, B, 1, record]`` e4m3 tensor (``kv_quant_mode`` 1). Each call is preceded by the operator's
tiling-metadata op. Call shapes per research/vendor_backends.md §1.3-§1.5 (TND q, ``PA_ND`` KV,
band mask 4 with ``ori_win_left`` 127, causal compressed mask 3); the tables come from
:func:`dsv4.backends.ascend_dsa.layout.build_tables` (one virtual request per token). The
operators return no LSE: the result's ``lse`` is NaN (``capabilities.returns_lse`` is False).

Neither ``torch_npu`` nor ``vllm_ascend`` is imported at module level: importing ``torch_npu``
without CANN breaks ``import torch`` itself (research §5).
"""
from __future__ import annotations

from typing import Any

import torch
from dsv4.backends.ascend_dsa import layout
from dsv4.backends.ascend_dsa.capabilities import (
    BLOCK_SIZE_MULTIPLE,
    MAX_BLOCK_SIZE,
    WINDOW,
    AscendFamily,
    family_for,
)
from dsv4.codecs import get_codec
from dsv4.specs.errors import BackendUnavailableError, CacheLayoutError, DSV4TypeError, DSV4ValueError
from dsv4.specs.formats import get_format

__all__ = ["import_ascend_ops", "kv_view", "op_arguments", "sparse_attention"]

_HEAD_DIM = get_format("ascend_bf16").row_dim


def import_ascend_ops() -> Any:
    """``torch.ops._C_ascend`` with the DSV4 attention ops, loading vllm-ascend's library if needed.

    Raises ``BackendUnavailableError`` (never imports anything without an NPU).
    """
    npu = getattr(torch, "npu", None)
    if npu is None or not npu.is_available():
        raise BackendUnavailableError.of("device", "an Ascend NPU (torch_npu + CANN)", "none")
    ops = torch.ops._C_ascend
    if not hasattr(ops, "npu_sparse_attn_sharedkv"):
        try:  # vllm-ascend binds its custom ops on demand (docs: "Adding a custom aclnn operation")
            from vllm_ascend.utils import enable_custom_op
            enable_custom_op()
        except (ImportError, OSError, RuntimeError) as exc:
            raise BackendUnavailableError(f"vllm-ascend custom ops not loadable: {type(exc).__name__}: {exc}") from exc
    if not hasattr(ops, "npu_sparse_attn_sharedkv"):
        raise BackendUnavailableError("vllm-ascend loaded without _C_ascend.npu_sparse_attn_sharedkv")
    return ops


def _block_size(cache: torch.Tensor, family: AscendFamily, argument: str) -> int:
    """Tokens a page of ``cache``, checked against the operator's tiling rule."""
    codec = get_codec(family.kv_format)
    if family.quantized_kv:
        block = codec.block_size_of(cache)
    else:
        # ascend_bf16 [nb, B, 1, 512]; pages may be padded (stride(0) > B * 512), rows must be dense.
        if cache.dtype != torch.bfloat16 or cache.dim() != 4 or tuple(cache.shape[2:]) != (1, _HEAD_DIM) \
                or cache.stride(1) != _HEAD_DIM or cache.stride(3) != 1:
            raise CacheLayoutError.of(argument, f"bf16 [nb, B, 1, {_HEAD_DIM}] with contiguous rows",
                                      f"{cache.dtype} {tuple(cache.shape)} strides {cache.stride()}")
        block = cache.shape[1]
    if block % BLOCK_SIZE_MULTIPLE or block > MAX_BLOCK_SIZE:
        raise CacheLayoutError.of(argument, f"a page size that is a multiple of {BLOCK_SIZE_MULTIPLE} and at most "
                                  f"{MAX_BLOCK_SIZE} (the operator's tiling check)", block)
    return block


def kv_view(cache: torch.Tensor, family: AscendFamily, block_size: int) -> torch.Tensor:
    """The operator's KV tensor: ``ascend_bf16`` as is; ``ascend_a5`` uint8 ``[nb, stride]`` as the
    ``[nb, B, 1, record_bytes]`` float8_e4m3fn view the A5 cache is allocated as (page stride kept)."""
    if not family.quantized_kv:
        return cache
    record = get_format(family.kv_format).token_bytes
    view = cache.as_strided((cache.shape[0], block_size, 1, record), (cache.stride(0), record, record, 1))
    return view.view(torch.float8_e4m3fn)


def op_arguments(family: AscendFamily, tables: layout.AscendTables, heads: int) -> tuple[dict, dict]:
    """Keyword arguments of (the metadata op, the attention op) shared by every call of ``tables``."""
    mask = {"cmp_ratio": tables.cmp_ratio, "ori_mask_mode": 4, "cmp_mask_mode": 3,
            "ori_win_left": WINDOW - 1, "ori_win_right": 0, "layout_q": "TND", "layout_kv": "PA_ND"}
    quant: dict[str, Any] = {}
    if family.quantized_kv:
        fmt = get_format(family.kv_format)
        # A5: kv_quant_mode 1 (the only one), tile = nope dims per UE8M0 scale, rope dims in bf16.
        quant = {"kv_quant_mode": 1, "tile_size": fmt.nope_bytes // fmt.scale_bytes,
                 "rope_head_dim": fmt.rope_bytes // torch.bfloat16.itemsize}
    num_tokens = tables.seqused_kv.shape[0]
    metadata = {"num_heads_q": heads, "num_heads_kv": 1, "head_dim": _HEAD_DIM,
                "cu_seqlens_q": tables.cu_seqlens_q, "seqused_kv": tables.seqused_kv,
                "batch_size": num_tokens, "max_seqlen_q": 1, "max_seqlen_kv": tables.max_seqlen_kv,
                "ori_topk": 0, "cmp_topk": tables.cmp_topk, "has_ori_kv": True,
                "has_cmp_kv": tables.mode != "swa", "device": str(tables.seqused_kv.device), **mask, **quant}
    attention = {"ori_block_table": tables.ori_block_table, "cmp_block_table": tables.cmp_block_table,
                 "cmp_sparse_indices": tables.cmp_sparse_indices, "cu_seqlens_q": tables.cu_seqlens_q,
                 "seqused_kv": tables.seqused_kv, "return_softmax_lse": False, **mask, **quant}
    return metadata, attention


def _check_inputs(q: torch.Tensor, family: AscendFamily, sink: torch.Tensor | None,
                  tables: list[tuple[str, torch.Tensor | None, int]]) -> None:
    if q.dtype != torch.bfloat16:
        raise DSV4TypeError.of("q", "dtype torch.bfloat16", q.dtype)
    if q.dim() != 3 or q.shape[2] != _HEAD_DIM:
        raise DSV4ValueError.of("q", f"shape [T, H, {_HEAD_DIM}]", tuple(q.shape))
    if q.shape[1] not in family.q_heads:
        heads = " or ".join(str(h) for h in sorted(family.q_heads))
        raise DSV4ValueError.of("q", f"{heads} heads on {family.name} (operator README)", q.shape[1])
    if sink is None:
        raise DSV4ValueError.of("sink", "a [H] fp32 tensor (SPEC §12: a missing sink is an error)", None)
    if sink.dtype != torch.float32 or tuple(sink.shape) != (q.shape[1],):
        raise DSV4ValueError.of("sink", f"fp32 [{q.shape[1]}]", f"{sink.dtype} {tuple(sink.shape)}")
    for name, t, dims in tables:
        if t is None:
            continue
        if t.dtype != torch.int32:
            raise DSV4TypeError.of(name, "dtype torch.int32", t.dtype)
        if t.dim() != dims or t.shape[0] != q.shape[0]:
            raise DSV4ValueError.of(name, f"{dims}-D with {q.shape[0]} rows", tuple(t.shape))


def sparse_attention(q: torch.Tensor, swa_cache: torch.Tensor, swa_indices: torch.Tensor,
                     swa_lens: torch.Tensor, extra_cache: torch.Tensor | None,
                     extra_indices: torch.Tensor | None, extra_lens: torch.Tensor | None,
                     sink: torch.Tensor, *, kv_format: str, softmax_scale: float,
                     ops: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ARCHITECTURE §3 ``sparse_attention`` on the Ascend operator.

    q ``[T, H, 512]`` bf16 (H = 64; A5 64 or 128); caches of ``kv_format`` ``ascend_bf16`` or
    ``ascend_a5``; indices ``[T, W]`` int32 global slots with lens ``[T]`` int32; sink ``[H]`` fp32.
    ``ops``: an object with the operator methods (default ``torch.ops._C_ascend``).
    Returns ``(out [T, H, 512] bf16, lse [T, H] fp32 NaN)``.
    """
    family = family_for(kv_format)
    given = [x is not None for x in (extra_cache, extra_indices, extra_lens)]
    if any(given) and not all(given):
        raise DSV4ValueError.of("extra_cache/extra_indices/extra_lens", "all three or none",
                                ["set" if g else "None" for g in given])
    _check_inputs(q, family, sink, [("swa_indices", swa_indices, 2), ("swa_lens", swa_lens, 1),
                                    ("extra_indices", extra_indices, 2), ("extra_lens", extra_lens, 1)])
    swa_block = _block_size(swa_cache, family, "swa_cache")
    extra_block = None if extra_cache is None else _block_size(extra_cache, family, "extra_cache")
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=q.device)
    mode = layout.extra_mode(None if extra_indices is None else extra_indices.shape[1], family.topk_widths)
    topk = extra_indices.shape[1] if mode == "sparse" else 0
    tables = layout.build_tables(swa_indices, swa_lens, swa_block, extra_indices, extra_lens, extra_block,
                                 mode=mode, topk=topk, device=q.device)
    if q.shape[0] == 0:
        return q.new_zeros(q.shape), lse  # contiguous whatever q's strides (ARCHITECTURE §3)
    ops = import_ascend_ops() if ops is None else ops
    meta_kwargs, kwargs = op_arguments(family, tables, q.shape[1])
    metadata = getattr(ops, family.metadata_op)(**meta_kwargs)
    out, _ = getattr(ops, family.op)(
        q, ori_kv=kv_view(swa_cache, family, swa_block),
        cmp_kv=None if extra_cache is None else kv_view(extra_cache, family, extra_block),
        sinks=sink, metadata=metadata, softmax_scale=softmax_scale, **kwargs)
    return out.contiguous(), lse  # the operator's layout is not documented; ARCHITECTURE §3 wants contiguous
