"""``ReferenceBackend``: thin wrappers over ``dsv4.reference`` with the ARCHITECTURE.md §3 signatures.

``dsv4.reference`` is imported on first use so that a broken reference shows up as this
backend's probe reason instead of a plugin load failure.
"""
from __future__ import annotations

from types import ModuleType
from typing import ClassVar

import torch
from dsv4.backend import Backend, Capabilities
from dsv4.backends.reference.capabilities import CAPABILITIES

__all__ = ["ReferenceBackend"]


def _reference() -> ModuleType:
    from dsv4 import reference  # core module; lazy only to keep plugin loading cheap

    return reference


class ReferenceBackend(Backend):
    """The reference implementation of every op (float32 serving numerics, float64 ideal)."""

    name: ClassVar[str] = "reference"
    capabilities: ClassVar[Capabilities] = CAPABILITIES

    def probe(self) -> list[str]:
        try:
            reference = _reference()
        except Exception as exc:  # noqa: BLE001 - any failure is the reason it is unavailable
            return [f"dsv4.reference not importable: {type(exc).__name__}: {exc}"]
        missing = [op for op in sorted(self.capabilities.ops) if not hasattr(reference, op)]
        return [f"dsv4.reference lacks {', '.join(missing)}"] if missing else []

    def qnorm_rope_insert(self, q, kv, positions, cos_sin, swa_cache, swa_slot_mapping, *,
                          kv_format: str, eps: float, profile: str = "deepseek") -> torch.Tensor:
        return _reference().qnorm_rope_insert(q, kv, positions, cos_sin, swa_cache, swa_slot_mapping,
                                              kv_format=kv_format, eps=eps, profile=profile)

    def compress_insert(self, kv_score, positions, token_request, state_cache, state_block_table,
                        state_slot_mapping, ape, norm_weight, cos_sin, out_cache, out_slot_mapping, *,
                        ratio: int, head_dim: int, out_format: str, profile: str, eps: float,
                        windows_in_call: bool = False) -> None:
        _reference().compress_insert(kv_score, positions, token_request, state_cache, state_block_table,
                                     state_slot_mapping, ape, norm_weight, cos_sin, out_cache,
                                     out_slot_mapping, ratio=ratio, head_dim=head_dim,
                                     out_format=out_format, profile=profile, eps=eps,
                                     windows_in_call=windows_in_call)

    def indexer_q(self, index_q, weights, positions, cos_sin, *, profile: str):
        return _reference().indexer_q(index_q, weights, positions, cos_sin, profile=profile)

    def indexer_topk(self, q, w, positions, token_request, key_cache, key_block_table, *,
                     topk: int, key_format: str, ratio: int = 4) -> torch.Tensor:
        return _reference().indexer_topk(q, w, positions, token_request, key_cache, key_block_table,
                                         topk=topk, key_format=key_format, ratio=ratio)

    def sparse_attention(self, q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices,
                         extra_lens, sink, *, kv_format: str, softmax_scale: float, profile: str):
        return _reference().sparse_attention(q, swa_cache, swa_indices, swa_lens, extra_cache,
                                             extra_indices, extra_lens, sink, kv_format=kv_format,
                                             softmax_scale=softmax_scale, profile=profile)

    def output_projection(self, o, positions, cos_sin, wo_a, wo_b, *, fp8_activations: bool) -> torch.Tensor:
        return _reference().output_projection(o, positions, cos_sin, wo_a, wo_b,
                                              fp8_activations=fp8_activations)
