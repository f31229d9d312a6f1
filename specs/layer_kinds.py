"""The three attention layer kinds of DeepSeek-V4 (SPEC §2).

A layer's kind is fixed by its compress ratio: 1 (``0`` in config.json) is SWA-only, 128 is HCA
(C128A, every compressed entry visible), 4 is CSA (C4A, Lightning-Indexer top-k). Any other ratio
is a configuration error.
"""
from __future__ import annotations

from enum import Enum

from dsv4.specs.errors import ConfigError

__all__ = ["LayerKind"]


class LayerKind(str, Enum):
    """``SWA`` (ratio 1), ``HCA`` (ratio 128), ``CSA`` (ratio 4); SPEC §2."""

    SWA = "swa"
    HCA = "hca"
    CSA = "csa"

    @property
    def ratio(self) -> int:
        """Raw tokens per compressed entry (1 for SWA-only)."""
        return _RATIOS[self]

    @property
    def coff(self) -> int:
        """Compressor overlap factor: 2 for CSA (overlapping windows, SPEC §5.2), else 1."""
        return 2 if self is LayerKind.CSA else 1

    @property
    def has_compressor(self) -> bool:
        """Whether the layer runs the 512-d compressor of SPEC §5 (HCA and CSA)."""
        return self is not LayerKind.SWA

    @property
    def has_indexer(self) -> bool:
        """Whether the layer runs the Lightning Indexer of SPEC §6 (CSA only)."""
        return self is LayerKind.CSA

    @property
    def compressed_list(self) -> str:
        """What attention's compressed list is (SPEC §2): ``"topk"`` (CSA: the indexer's picks), ``"dense"``
        (HCA: every visible compressed entry) or ``"none"`` (SWA-only)."""
        return {LayerKind.SWA: "none", LayerKind.HCA: "dense", LayerKind.CSA: "topk"}[self]

    @classmethod
    def from_ratio(cls, ratio: int) -> LayerKind:
        """Kind of a layer with compress ratio ``ratio``; 0 and 1 both mean SWA-only (SPEC §1)."""
        kind = _BY_RATIO.get(int(ratio)) if isinstance(ratio, int) else None
        if kind is None:
            raise ConfigError.of("compress_ratio", "one of 0, 1, 4, 128", ratio)
        return kind


_RATIOS = {LayerKind.SWA: 1, LayerKind.HCA: 128, LayerKind.CSA: 4}
_BY_RATIO = {0: LayerKind.SWA, 1: LayerKind.SWA, 4: LayerKind.CSA, 128: LayerKind.HCA}
