"""Intel XPU backend: torch's XPU device + Triton (vLLM's bf16 sparse MLA kernel), sink applied.

No intel-extension-for-pytorch (discontinued). The kernel is imported lazily from vLLM.
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from dsv4.backend import Backend, Capabilities
from dsv4.backends.xpu import attention
from dsv4.backends.xpu.capabilities import CAPABILITIES
from dsv4.hookspecs import hookimpl

__all__ = ["XPUBackend", "dsv4_register_backends"]


def _xpu_available() -> bool:
    xpu = getattr(torch, "xpu", None)
    return bool(xpu is not None and xpu.is_available())


class XPUBackend(Backend):
    """``sparse_attention`` on an Intel XPU through a bf16 workspace; the sink is never dropped."""

    name: ClassVar[str] = "xpu"
    capabilities: ClassVar[Capabilities] = CAPABILITIES
    packages: ClassVar[tuple[str, ...]] = ("vllm", "triton")

    def __init__(self, *, kernel: Any = None) -> None:
        self.kernel = kernel

    def probe(self) -> list[str]:
        """Empty on a torch XPU device with the Triton kernel importable."""
        reasons: list[str] = []
        if not _xpu_available():
            reasons.append(f"needs an Intel XPU (torch.xpu), found {'cuda' if torch.cuda.is_available() else 'cpu'}")
        if not reasons:  # import the vendor package only where it can run
            reasons += attention.KERNEL.reasons(self.kernel)
        return reasons

    def sparse_attention(self, q: torch.Tensor, swa_cache: torch.Tensor, swa_indices: torch.Tensor,
                         swa_lens: torch.Tensor, extra_cache: torch.Tensor | None,
                         extra_indices: torch.Tensor | None, extra_lens: torch.Tensor | None,
                         sink: torch.Tensor, *, kv_format: str, softmax_scale: float,
                         profile: str) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T,H,512] bf16 -> (out [T,H,512] bf16, lse [T,H] fp32)."""
        del profile
        return attention.sparse_attention(q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices,
                                          extra_lens, sink, kv_format=kv_format, softmax_scale=softmax_scale,
                                          kernel=self.kernel)


@hookimpl
def dsv4_register_backends(register: Any) -> None:
    """Register the XPU backend (its probe explains when it cannot run here)."""
    register(XPUBackend())
