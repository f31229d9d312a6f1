"""What the generated cases contain: the inputs serving produces, so a backend that mishandles them fails."""
from __future__ import annotations

import torch
from dsv4.backends.reference import ReferenceBackend
from dsv4.conformance.cases import default_cases, prepare, select_cases
from dsv4.conformance.runner import run_suite
from dsv4.registry import Registry

EXTRA_CASES = select_cases(default_cases(), ["sparse_attention"], "not swa")


def _holes_inside_lens(indices: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    inside = torch.arange(indices.shape[1])[None, :] < lens[:, None].long()
    return inside & (indices < 0)


class ExtraHoleAsSlot0(ReferenceBackend):
    """Reads a -1 inside the first extra_lens compressed entries as slot 0 (a real row) instead of skipping
    it (SPEC §7)."""

    name = "extra-hole-as-slot0"

    def sparse_attention(self, q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices, extra_lens, sink,
                         **kwargs):
        holes = _holes_inside_lens(extra_indices.cpu(), extra_lens.cpu()).to(extra_indices.device)
        extra_indices = torch.where(holes, torch.zeros_like(extra_indices), extra_indices)
        return super().sparse_attention(q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices,
                                        extra_lens, sink, **kwargs)


def test_every_extra_list_has_a_hole_inside_its_lens():
    """Pages not allocated yet give -1 entries inside extra_lens in serving; every case with an extra list,
    prefill and decode, has one."""
    assert len(EXTRA_CASES) >= 10
    for case in EXTRA_CASES:
        args = prepare(case).steps[0][0]
        assert bool(_holes_inside_lens(args[5], args[6]).any()), case.id


def test_a_hole_read_as_slot_0_fails():
    reg = Registry()
    reg.register_backend(ReferenceBackend())
    reg.register_backend(ExtraHoleAsSlot0())
    cases = select_cases(EXTRA_CASES, keyword="deepseek")
    rows = run_suite(["extra-hole-as-slot0"], cases, registry=reg, far=False).rows
    assert len(rows) == 4 and all(r.outcome == "failed" for r in rows), [(r.case, r.outcome) for r in rows]
    assert all(r.metrics["out"]["passed"] is False for r in rows)
