"""What the generated cases contain: the inputs serving produces, so a backend that mishandles them fails."""
from __future__ import annotations

import pytest
import torch
from _wrong_backends import ReadsPastLens, SinkPerHeadTile, registry_of
from dsv4.backends.reference import ReferenceBackend
from dsv4.codecs import get_codec
from dsv4.conformance.cases import default_cases, prepare, select_cases
from dsv4.conformance.runner import run_suite

SPARSE_CASES = select_cases(default_cases(), ["sparse_attention"])
EXTRA_CASES = select_cases(SPARSE_CASES, keyword="not swa")


def _run(backend, cases):
    reg = registry_of(backend)
    return run_suite([backend.name], cases, registry=reg, far=False).rows


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
    reg = registry_of(ExtraHoleAsSlot0())
    cases = select_cases(EXTRA_CASES, keyword="deepseek")
    rows = run_suite(["extra-hole-as-slot0"], cases, registry=reg, far=False).rows
    assert len(rows) == len(cases) >= 4 and all(r.outcome == "failed" for r in rows), [(r.case, r.outcome) for r in rows]
    assert all(r.metrics["out"]["passed"] is False for r in rows)


def test_index_rows_hold_slots_of_written_rows_past_lens():
    """An engine's persistent index buffers keep stale slots past lens[t], which SPEC §7 never reads: every
    entry past lens, SWA and extra, is a slot of a written row (reading it changes the result), and every
    prefill case has such entries in each of its lists."""
    for case in SPARSE_CASES:
        args = prepare(case).steps[0][0]
        codec = get_codec(case.cache_format)
        for cache, indices, lens in ((args[1], args[2], args[3]), (args[4], args[5], args[6])):
            if indices is None:
                continue
            stale = indices[torch.arange(indices.shape[1])[None, :] >= lens[:, None].long()]
            assert case.variant == "decode" or stale.numel() > 0, case.id
            rows = codec.read_rows(cache, stale.to(torch.int64))  # raises on -1 or a slot past the cache
            assert bool((stale >= 0).all()) and bool(rows.isfinite().all()), case.id
            assert bool((rows.abs().amax(1) > 0).all()), case.id


@pytest.mark.parametrize("past", [1, None])
def test_reading_past_lens_fails(past):
    """A window one entry too long, or lens ignored (the whole row read, -1 skipped), fails every prefill
    case: the rows past lens hold real slots."""
    cases = select_cases(SPARSE_CASES, keyword="prefill and vllm")
    rows = _run(ReadsPastLens(past), cases)
    assert len(rows) == len(cases) >= 4
    assert all(r.outcome == "failed" and r.metrics["out"]["passed"] is False for r in rows), \
        [(r.case, r.outcome) for r in rows]


def test_cases_with_more_heads_than_the_tiny_preset():
    """The tiny preset has 8 heads; vendor kernels tile and pad heads (16, 64, 128). Sparse attention runs
    16, 128 (two 64-head tiles) and a count that is no power of two; qnorm_rope_insert a count past 8."""
    heads = {prepare(c).steps[0][0][0].shape[1] for c in SPARSE_CASES}
    assert {8, 16, 128} <= heads and any(h & (h - 1) for h in heads), heads
    qnorm = {prepare(c).steps[0][0][0].shape[1] for c in default_cases() if c.op == "qnorm_rope_insert"}
    assert any(h > 8 for h in qnorm), qnorm
    assert all(c.id.endswith(f"-h{c.heads}") for c in default_cases() if c.heads is not None)


def test_a_sink_indexed_per_8_head_tile_fails_the_cases_with_more_heads():
    many = [c for c in SPARSE_CASES if c.heads is not None]
    eight = select_cases([c for c in SPARSE_CASES if c.heads is None], keyword="vllm and decode")
    rows = {r.case: r for r in _run(SinkPerHeadTile(8), many + eight)}
    assert len(many) >= 3 and all(rows[c.id].outcome == "failed" for c in many), [(r.case, r.outcome) for r in
                                                                                  rows.values()]
    assert all(rows[c.id].outcome == "passed" for c in eight)  # right for 8 heads: only the new cases see it


def _tensors(prepared) -> list[torch.Tensor]:
    """The distinct input tensors of ``prepared`` (a tensor shared between steps once), in order."""
    seen: dict[int, torch.Tensor] = {}
    for args, kwargs in prepared.steps:
        for x in (*args, *kwargs.values()):
            if isinstance(x, torch.Tensor):
                seen.setdefault(id(x), x)
    return list(seen.values())


class _CopyCount(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops that copy a tensor's data (``clone``, ``_to_copy``, ``copy_``) run inside it."""

    COPIES = ("aten::clone", "aten::_to_copy", "aten::copy_")

    def __init__(self) -> None:
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.copies += func._schema.name in self.COPIES
        return func(*args, **(kwargs or {}))


# one multi-step case (its caches are shared between steps) and one single-step case
_COPY_CASES = [c for c in default_cases() if c.id in ("compress_insert/csa/deepseek/fp8_ds_mla/multi-step",
                                                      "indexer_topk/csa/vllm/indexer_fp8/mixed")]


@pytest.mark.parametrize("device", ["cpu", "meta"])  # meta: a move off the CPU, as onto an accelerator
@pytest.mark.parametrize("case", _COPY_CASES, ids=lambda c: c.id)
def test_private_copy_copies_every_input_once_and_shares_no_storage(case, device):
    from dsv4.conformance.cases import private_copy

    assert len(_COPY_CASES) == 2
    prepared = prepare(case)
    originals = _tensors(prepared)
    with _CopyCount() as count:
        copy = private_copy(prepared, device)
    copies = _tensors(copy)
    assert count.copies == len(originals) == len(copies)  # one copy each, a tensor shared by steps once
    assert all(c.device.type == device for c in copies)
    assert [(c.shape, c.dtype, c.stride()) for c in copies] == [(o.shape, o.dtype, o.stride()) for o in originals]
    if device == "cpu":
        storages = {o.untyped_storage().data_ptr() for o in originals}
        assert not storages & {c.untyped_storage().data_ptr() for c in copies}
        assert all(torch.equal(c.view(torch.uint8), o.view(torch.uint8)) for c, o in zip(copies, originals))
    for step in range(1, len(copy.steps)):  # the caches stay one tensor across steps
        assert all(copy.steps[step][0][i] is copy.steps[0][0][i] for i, _ in copy.caches.values())
    assert copy.caches == prepared.caches and copy.caches is not prepared.caches
