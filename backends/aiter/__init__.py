"""AITER backend (AMD ROCm, gfx950): ``sparse_attention`` through AITER's Triton sparse MLA.

Vendor package ``aiter`` (a source build newer than PyPI's amd-aiter 0.1.7.post2.dev18, which lacks
``aiter.ops.triton.attention.sparse_mla``), imported lazily.
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from dsv4.backend import Backend, Capabilities, device_arch
from dsv4.backends.aiter import attention
from dsv4.backends.aiter.capabilities import CAPABILITIES, SUPPORTED_ARCHS
from dsv4.hookspecs import hookimpl

__all__ = ["AiterBackend", "dsv4_register_backends"]


def _rocm_arch() -> str | None:
    """The current GPU's arch (``sm_90``, ``gfx950``) or None (``dsv4.backend.device_arch``)."""
    return device_arch("cuda")


class AiterBackend(Backend):
    """AITER sparse MLA on gfx950: ragged CSR of global slots, fp8_ds_mla pages in place, no LSE."""

    name: ClassVar[str] = "aiter"
    capabilities: ClassVar[Capabilities] = CAPABILITIES
    packages: ClassVar[tuple[str, ...]] = ("amd-aiter",)

    def __init__(self, *, sparse_mla: Any = None) -> None:
        self.sparse_mla = sparse_mla

    def probe(self) -> list[str]:
        """Empty on gfx950 with aiter's sparse_mla importable."""
        reasons: list[str] = []
        arch = _rocm_arch()
        if arch is None:
            found = "cuda" if torch.cuda.is_available() else "cpu"
            reasons.append(f"needs ROCm gfx950, found {found}")
        elif arch not in SUPPORTED_ARCHS:
            hint = " (its SWA cache is FNUZ e4m3, not the OCP fp8_ds_mla)" if arch == "gfx942" else ""
            reasons.append(f"needs gfx950 (AITER sparse MLA fast path), found {arch}{hint}")
        if not reasons:  # import the vendor package only where it can run
            reasons += attention.SPARSE_MLA.reasons(self.sparse_mla)
        return reasons

    def sparse_attention(self, q: torch.Tensor, swa_cache: torch.Tensor, swa_indices: torch.Tensor,
                         swa_lens: torch.Tensor, extra_cache: torch.Tensor | None,
                         extra_indices: torch.Tensor | None, extra_lens: torch.Tensor | None,
                         sink: torch.Tensor, *, kv_format: str, softmax_scale: float,
                         profile: str) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T,H,512] bf16 -> (out [T,H,512] bf16, lse [T,H] NaN: AITER returns no LSE)."""
        del profile
        return attention.sparse_attention(q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices,
                                          extra_lens, sink, kv_format=kv_format, softmax_scale=softmax_scale,
                                          sparse_mla=self.sparse_mla)


@hookimpl
def dsv4_register_backends(register: Any) -> None:
    """Register the AITER backend (its probe explains when it cannot run here)."""
    register(AiterBackend())
