"""Deliberately wrong backends shared by the conformance tests (each must fail the suite)."""
from __future__ import annotations

import torch
from dsv4.backend import Backend
from dsv4.backends.reference import ReferenceBackend
from dsv4.registry import Registry


def registry_of(*backends: Backend, reference: bool = True) -> Registry:
    """A registry of a fresh ``ReferenceBackend`` (unless ``reference=False``) and ``backends``, in that
    order; no plugin loaded."""
    registry = Registry()
    for backend in ((ReferenceBackend(),) if reference else ()) + backends:
        registry.register_backend(backend)
    return registry


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


class StrayWrite(AfterSwaWrite):
    """Writes one row more than it was given (a write rounded up to an even count): the last written slot's
    row again, at the next slot that no token of the call names. ``stray`` records the slots it wrote."""

    name = "stray-write"

    def __init__(self) -> None:
        self.stray: list[int] = []

    def corrupt(self, swa_cache, swa_slot_mapping, kv_format):
        from dsv4.codecs import get_codec

        codec = get_codec(kv_format)
        written = swa_slot_mapping[swa_slot_mapping >= 0].tolist()
        capacity = swa_cache.shape[0] * codec.block_size_of(swa_cache)
        stray = next(s % capacity for s in range(written[-1] + 1, written[-1] + capacity) if s % capacity not in written)
        row = codec.read_rows(swa_cache, torch.tensor([written[-1]]))
        codec.write_rows(swa_cache, torch.tensor([stray]), row)
        self.stray.append(stray)


class ReadsPastLens(ReferenceBackend):
    """Sparse attention that reads ``past`` entries more than ``lens[t]`` of every index row (SWA and extra),
    or the whole row when ``past`` is None (lens ignored, -1 entries still skipped). SPEC §7 reads the first
    ``lens[t]`` only; an engine's persistent index buffers hold stale slots past it."""

    def __init__(self, past: int | None) -> None:
        self.past = past
        self.name = "ignores-lens" if past is None else f"reads-{past}-past-lens"

    def _lens(self, indices, lens):
        width = indices.shape[1]
        return torch.full_like(lens, width) if self.past is None else (lens + self.past).clamp(max=width)

    def sparse_attention(self, q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices, extra_lens, sink,
                         **kwargs):
        if extra_indices is not None:
            extra_lens = self._lens(extra_indices, extra_lens)
        return super().sparse_attention(q, swa_cache, swa_indices, self._lens(swa_indices, swa_lens), extra_cache,
                                        extra_indices, extra_lens, sink, **kwargs)


class SinkPerHeadTile(ReferenceBackend):
    """Indexes the sink per tile of ``tile`` heads (head h gets sink[h % tile]): right for up to ``tile``
    heads, wrong past them."""

    name = "sink-per-head-tile"

    def __init__(self, tile: int = 8) -> None:
        self.tile = tile

    def sparse_attention(self, q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices, extra_lens, sink,
                         **kwargs):
        tiled = sink[torch.arange(q.shape[1], device=sink.device) % self.tile]
        return super().sparse_attention(q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices,
                                        extra_lens, tiled, **kwargs)


class HeadMajorOut(ReferenceBackend):
    """Sparse attention whose ``out`` holds the right values in a head-major layout (a ``[H, T, 512]``
    buffer transposed): eager callers see nothing, torch.compile trusts the fake kernel's contiguous strides."""

    name = "head-major-out"

    def sparse_attention(self, *args, **kwargs):
        out, lse = super().sparse_attention(*args, **kwargs)
        return out.transpose(0, 1).contiguous().transpose(0, 1), lse
