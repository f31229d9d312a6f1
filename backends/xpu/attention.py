"""XPU sparse attention (SPEC §7): vLLM's Triton bf16 sparse MLA on a workspace, plus the sink.

``vllm.v1.attention.ops.xpu_mla_sparse.triton_bf16_mla_sparse_interface(q [T,H,512] bf16,
kv [S,1,512] bf16, indices [T,1,K] int32 (K % 16 == 0, -1 invalid), sm_scale, d_v=512, block_dpe=64)
-> (out, max_logits, lse)``. DeepSeek-V4's rows keep RoPE inside the 512 (no separate positional part),
so it is called with ``block_dpe=0``, as vLLM's DSV4 path does; the default 64 would split the row into
448 + 64, which is not a power of two, and releases without the parameter assume 512 + 64 rows. It has
no sink parameter (vLLM's XPU path therefore ignores it). The
sink is applied here from the returned LSE (natural log, without the sink):
``out * exp(lse) / (exp(lse) + exp(sink)) = out * sigmoid(lse - sink)``, which is exact (SPEC §7).
"""
from __future__ import annotations

from typing import Any

import torch
from dsv4.backend import OptionalImport, missing_parameters
from dsv4.backends.xpu import layout
from dsv4.specs.errors import BackendUnavailableError, DSV4TypeError, DSV4ValueError

__all__ = ["apply_sink", "import_kernel", "sparse_attention"]

_HEAD_DIM = 512


def _check_kernel(kernel: Any) -> Any:
    """``kernel`` if it takes ``block_dpe``, else BackendUnavailableError with the reason."""
    if missing_parameters(kernel, ("block_dpe",)):
        raise BackendUnavailableError("vllm's triton_bf16_mla_sparse_interface has no block_dpe: this vLLM "
                                      "predates DeepSeek-V4 on XPU (its kernel needs 512 + 64-wide rows)")
    return kernel


def _load_kernel() -> Any:
    from vllm.v1.attention.ops.xpu_mla_sparse import triton_bf16_mla_sparse_interface

    return _check_kernel(triton_bf16_mla_sparse_interface)


KERNEL = OptionalImport("vllm XPU sparse MLA kernel", _load_kernel)
import_kernel = KERNEL.get  # the Triton kernel entry point, or BackendUnavailableError with the reason


def apply_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor,
               counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """out [T,H,512], lse [T,H] (no sink), sink [H] fp32, counts [T] -> sink applied (SPEC §7).

    Empty rows: out 0, lse +inf (whatever the kernel left there).
    """
    lse = lse.float()
    empty = (counts == 0)[:, None]
    weight = torch.sigmoid(lse - sink[None, :]).nan_to_num(0.0)
    out = (out.float() * weight[..., None]).masked_fill(empty[..., None], 0.0).to(out.dtype)
    return out, lse.masked_fill(empty, float("inf"))


def sparse_attention(q: torch.Tensor, swa_cache: torch.Tensor, swa_indices: torch.Tensor,
                     swa_lens: torch.Tensor, extra_cache: torch.Tensor | None,
                     extra_indices: torch.Tensor | None, extra_lens: torch.Tensor | None,
                     sink: torch.Tensor, *, kv_format: str, softmax_scale: float,
                     kernel: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T,H,512] bf16; caches uint8 fp8_ds_mla; global-slot tables; sink [H] fp32 ->
    (out [T,H,512] bf16, lse [T,H] fp32 without the sink)."""
    if kv_format != "fp8_ds_mla":
        raise DSV4ValueError.of("kv_format", "fp8_ds_mla (XPU path)", kv_format)
    if q.dtype != torch.bfloat16 or q.dim() != 3 or q.shape[2] != _HEAD_DIM:
        raise DSV4TypeError.of("q", f"bf16 [T, H, {_HEAD_DIM}]", f"{q.dtype} {tuple(q.shape)}")
    if sink is None or sink.dtype != torch.float32 or tuple(sink.shape) != (q.shape[1],):
        raise DSV4ValueError.of("sink", f"fp32 [{q.shape[1]}] (SPEC §12: vLLM drops it on XPU; we must not)",
                                None if sink is None else f"{sink.dtype} {tuple(sink.shape)}")
    if (extra_cache is None) != (extra_indices is None) or (extra_indices is None) != (extra_lens is None):
        raise DSV4ValueError.of("extra_cache/extra_indices/extra_lens", "all three or none", "a mix")
    for name, t in (("swa_indices", swa_indices), ("swa_lens", swa_lens),
                    ("extra_indices", extra_indices), ("extra_lens", extra_lens)):
        if t is not None and t.dtype != torch.int32:
            raise DSV4TypeError.of(name, "dtype torch.int32", t.dtype)
    if q.shape[0] == 0:
        return q.new_zeros(q.shape), torch.full(q.shape[:2], float("inf"), device=q.device)
    kernel = kernel if kernel is not None else import_kernel()
    ws = layout.build_workspace(swa_cache, swa_indices, swa_lens, extra_cache, extra_indices, extra_lens,
                                kv_format=kv_format)
    out, _, lse = kernel(q, ws.kv, ws.indices, softmax_scale, d_v=_HEAD_DIM, block_dpe=0)
    return apply_sink(out, lse.reshape(q.shape[0], q.shape[1]), sink, ws.counts)
