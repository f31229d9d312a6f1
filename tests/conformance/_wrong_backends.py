"""Deliberately wrong backends shared by the conformance tests (each must fail the suite)."""
from __future__ import annotations

from dsv4.backends.reference import ReferenceBackend


class AfterSwaWrite(ReferenceBackend):
    """``qnorm_rope_insert`` as the reference, then ``corrupt(swa_cache, swa_slot_mapping, kv_format)``
    edits the SWA rows it wrote."""

    def corrupt(self, swa_cache, swa_slot_mapping, kv_format: str) -> None:
        raise NotImplementedError

    def qnorm_rope_insert(self, q, kv, positions, cos_sin, swa_cache, swa_slot_mapping, *, kv_format, eps,
                          profile="deepseek"):
        out = super().qnorm_rope_insert(q, kv, positions, cos_sin, swa_cache, swa_slot_mapping,
                                        kv_format=kv_format, eps=eps, profile=profile)
        self.corrupt(swa_cache, swa_slot_mapping, kv_format)
        return out


class HeadMajorOut(ReferenceBackend):
    """Sparse attention whose ``out`` holds the right values in a head-major layout (a ``[H, T, 512]``
    buffer transposed): eager callers see nothing, torch.compile trusts the fake kernel's contiguous strides."""

    name = "head-major-out"

    def sparse_attention(self, *args, **kwargs):
        out, lse = super().sparse_attention(*args, **kwargs)
        return out.transpose(0, 1).contiguous().transpose(0, 1), lse
