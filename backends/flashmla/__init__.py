"""FlashMLA backend: DeepSeek's sparse MLA kernels (sm_90a, sm_100f) for ``sparse_attention``.

Vendor package: ``flash_mla`` from the ``sgl-flash-mla==1.0.0`` wheel (install with ``--no-deps``;
its metadata asks for a newer torch than it needs), legacy kernels (``use_legacy=True``).
Imported lazily: this module loads on any machine, and ``probe()`` says why it cannot run.
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from dsv4.backend import Backend, Capabilities, device_arch
from dsv4.backends.flashmla import attention
from dsv4.backends.flashmla.attention import SchedulerMetadataCache
from dsv4.backends.flashmla.capabilities import CAPABILITIES, SUPPORTED_ARCHS
from dsv4.hookspecs import hookimpl

__all__ = ["FlashMLABackend", "SchedulerMetadataCache", "dsv4_register_backends"]


def _cuda_arch() -> str | None:
    """The current GPU's arch (``sm_90``, ``gfx950``) or None (``dsv4.backend.device_arch``)."""
    return device_arch("cuda")


class FlashMLABackend(Backend):
    """``sparse_attention`` on FlashMLA (decode kernel below ``prefill_min_tokens``, else prefill).

    ``scheduler_cache`` holds the tile-scheduler metadata per layer kind per step (reused by
    every layer of that kind in the step). ``flash_mla`` may be set to a module with the same
    API (tests use a CPU model of the kernels); None imports the real one on first use.
    """

    name: ClassVar[str] = "flashmla"
    capabilities: ClassVar[Capabilities] = CAPABILITIES
    packages: ClassVar[tuple[str, ...]] = ("sgl-flash-mla",)

    def __init__(self, *, prefill_min_tokens: int = attention.DEFAULT_PREFILL_MIN_TOKENS,
                 flash_mla: Any = None) -> None:
        self.prefill_min_tokens = prefill_min_tokens
        self.flash_mla = flash_mla
        self.scheduler_cache = SchedulerMetadataCache()

    def probe(self) -> list[str]:
        """Empty on a GPU of the right arch with ``flash_mla`` (legacy kernels) importable."""
        reasons: list[str] = []
        arch = _cuda_arch()
        if arch is None:
            found = "rocm" if getattr(torch.version, "hip", None) else "cpu"
            reasons.append(f"needs sm_90a or sm_100f, found {found}")
        elif arch not in SUPPORTED_ARCHS:
            reasons.append(f"needs sm_90a or sm_100f, found {arch}")
        if not reasons:  # import the vendor package only where it can run
            reasons += attention.FLASH_MLA.reasons(self.flash_mla)
        return reasons

    def sparse_attention(self, q: torch.Tensor, swa_cache: torch.Tensor, swa_indices: torch.Tensor,
                         swa_lens: torch.Tensor, extra_cache: torch.Tensor | None,
                         extra_indices: torch.Tensor | None, extra_lens: torch.Tensor | None,
                         sink: torch.Tensor, *, kv_format: str, softmax_scale: float,
                         profile: str) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T,H,512] bf16 -> (out [T,H,512] bf16, lse [T,H] fp32); see ``attention.sparse_attention``."""
        return attention.sparse_attention(
            q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices, extra_lens, sink,
            kv_format=kv_format, softmax_scale=softmax_scale, profile=profile,
            scheduler_cache=self.scheduler_cache, prefill_min_tokens=self.prefill_min_tokens,
            flash_mla=self.flash_mla)


@hookimpl
def dsv4_register_backends(register: Any) -> None:
    """Register the FlashMLA backend (its probe explains when it cannot run here)."""
    register(FlashMLABackend())
