"""AscendDSA backend (Huawei Ascend A2/A3/A5 through vllm-ascend's ``_C_ascend`` operators).

``sparse_attention`` runs ``npu_sparse_attn_sharedkv`` (A2/A3, ``ascend_bf16``) or
``npu_kv_quant_sparse_attn_sharedkv`` (A5, ``ascend_a5``) with tables from ``layout.build_tables``:
every token becomes its own virtual request, so the operator's band mask, block tables and
causal compressed rule read exactly our global-slot tables (ARCHITECTURE §3). No LSE.
torch_npu is never imported at module level and never installed here: importing it on a machine
without CANN breaks ``import torch`` itself (research: vendor_backends.md §5).
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from dsv4.backend import Backend, Capabilities, OpRequest, one_line
from dsv4.backends.ascend_dsa import attention
from dsv4.backends.ascend_dsa.capabilities import CAPABILITIES, request_reasons
from dsv4.hookspecs import hookimpl

__all__ = ["AscendDSABackend", "dsv4_register_backends"]


class AscendDSABackend(Backend):
    """Ascend sparse attention through vllm-ascend's operators; see the module note.

    ``ops``: an object with the four operator methods (tests pass a CPU model); default
    ``torch.ops._C_ascend``, resolved lazily on an NPU.
    """

    name: ClassVar[str] = "ascend-dsa"
    capabilities: ClassVar[Capabilities] = CAPABILITIES
    packages: ClassVar[tuple[str, ...]] = ("torch-npu", "vllm-ascend")

    def __init__(self, *, ops: Any = None) -> None:
        self.ops = ops

    def probe(self) -> list[str]:
        """Never imports torch_npu: without a registered npu device it only reports that."""
        npu = getattr(torch, "npu", None)
        if npu is None or not npu.is_available():
            return ["needs an Ascend NPU (torch_npu + CANN), found "
                    + ("cuda" if torch.cuda.is_available() else "cpu")]
        if self.ops is not None:
            return []
        try:
            attention.import_ascend_ops()
        except Exception as exc:  # noqa: BLE001 - any load failure means "absent", with its reason
            return [one_line(f"vllm-ascend custom ops unavailable: {type(exc).__name__}: {exc}")]
        return []

    def not_supported_reasons(self, request: OpRequest) -> list[str]:
        """Capability reasons plus the per-generation head-count and top-k rules."""
        return super().not_supported_reasons(request) + request_reasons(request)

    def sparse_attention(self, q: torch.Tensor, swa_cache: torch.Tensor, swa_indices: torch.Tensor,
                         swa_lens: torch.Tensor, extra_cache: torch.Tensor | None,
                         extra_indices: torch.Tensor | None, extra_lens: torch.Tensor | None,
                         sink: torch.Tensor, *, kv_format: str, softmax_scale: float,
                         profile: str) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T,H,512] bf16 -> (out [T,H,512] bf16, lse [T,H] NaN: the operator returns no LSE)."""
        del profile  # one numerics per operator; profiles differ upstream of attention
        return attention.sparse_attention(q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices,
                                          extra_lens, sink, kv_format=kv_format, softmax_scale=softmax_scale,
                                          ops=self.ops)


@hookimpl
def dsv4_register_backends(register: Any) -> None:
    """Register the AscendDSA backend (its probe explains why it cannot run here)."""
    register(AscendDSABackend())
