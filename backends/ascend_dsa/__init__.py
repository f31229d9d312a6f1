"""AscendDSA backend (Huawei Ascend A2/A3/A5 through vllm-ascend's custom ops). torch_npu is never
imported at module level and never installed here: importing it on a machine without CANN breaks
``import torch`` itself (research: vendor_backends.md §5).

Status: registered with its capabilities and an honest probe. ``sparse_attention`` is NOT wired:
``npu_sparse_attn_sharedkv`` takes request-local compressed positions + block tables and treats
the SWA window as a band mask over positions, which the global-slot op contract (ARCHITECTURE §3)
does not carry; see docs/backends.md.
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from dsv4.backend import Backend, Capabilities
from dsv4.backends.ascend_dsa.capabilities import CAPABILITIES
from dsv4.hookspecs import hookimpl
from dsv4.specs.errors import BackendUnavailableError

__all__ = ["AscendDSABackend", "dsv4_register_backends"]


class AscendDSABackend(Backend):
    """Ascend sparse attention (``_C_ascend.npu_sparse_attn_sharedkv``); see the module note."""

    name: ClassVar[str] = "ascend-dsa"
    capabilities: ClassVar[Capabilities] = CAPABILITIES
    packages: ClassVar[tuple[str, ...]] = ("torch-npu", "vllm-ascend")

    def probe(self) -> list[str]:
        """Never imports torch_npu unless torch already has the npu device registered."""
        reasons: list[str] = []
        npu = getattr(torch, "npu", None)
        if npu is None or not npu.is_available():
            reasons.append("needs an Ascend NPU (torch_npu + CANN), found "
                           + ("cuda" if torch.cuda.is_available() else "cpu"))
            return reasons
        ops = getattr(torch.ops, "_C_ascend", None)
        if ops is None or not hasattr(ops, "npu_sparse_attn_sharedkv"):
            reasons.append("vllm-ascend custom op _C_ascend.npu_sparse_attn_sharedkv not loaded")
        reasons.append("sparse_attention over global slots is not wired to npu_sparse_attn_sharedkv yet "
                       "(needs request-local indices and positions)")
        return reasons

    def sparse_attention(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Not wired (see the module note): raises ``BackendUnavailableError``."""
        raise BackendUnavailableError.of(
            "sparse_attention inputs", "request-local compressed indices, block tables and positions "
            "(npu_sparse_attn_sharedkv)", "global slot tables (ARCHITECTURE §3)")


@hookimpl
def dsv4_register_backends(register: Any) -> None:
    """Register the AscendDSA backend (its probe explains why it cannot run here)."""
    register(AscendDSABackend())
