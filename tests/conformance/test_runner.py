"""The runner catches wrong backends and says where; outcomes; differential mode; expected failures."""
from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from _wrong_backends import AfterSwaWrite, registry_of
from dsv4.backend import Capabilities
from dsv4.backends.reference import ReferenceBackend
from dsv4.conformance.cases import default_cases, prepare, select_cases
from dsv4.conformance.runner import run_differential, run_suite, unmatched_expected_failures


class SinkFlipped(ReferenceBackend):
    name = "sink-flipped"

    def sparse_attention(self, q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices, extra_lens, sink,
                         **kwargs):
        return super().sparse_attention(q, swa_cache, swa_indices, swa_lens, extra_cache, extra_indices,
                                        extra_lens, -sink, **kwargs)


class ScaleByteOff(AfterSwaWrite):
    """Writes the SWA cache like the reference, then bumps the first written slot's first scale byte."""

    name = "scale-byte-off"

    def corrupt(self, swa_cache, swa_slot_mapping, kv_format):
        from dsv4.codecs import get_codec
        from dsv4.specs.formats import get_format

        if kv_format == "fp8_ds_mla":
            fmt, block = get_format(kv_format), get_codec(kv_format).block_size_of(swa_cache)
            slot = int(swa_slot_mapping[0])
            swa_cache[slot // block, fmt.scale_offset(block, slot % block)] += 1


class NoLse(ReferenceBackend):
    name = "no-lse"
    capabilities = Capabilities(ops=frozenset({"sparse_attention"}), dtypes=None, returns_lse=False,
                                kv_formats=frozenset({"fp8_ds_mla"}))


@pytest.fixture
def registry():
    return registry_of(SinkFlipped(), ScaleByteOff(), NoLse())


def _cases(op, keyword=None):
    return select_cases(default_cases(), [op], keyword)


def test_flipped_sink_fails_and_names_op_and_where(registry):
    result = run_suite(["sink-flipped"], _cases("sparse_attention", "decode and deepseek"), registry=registry)
    assert result.rows and all(r.outcome == "failed" for r in result.rows)
    row = result.rows[0]
    out = row.metrics["out"]
    assert out["passed"] is False and len(out["max_abs_where"]) == 3 and out["max_abs_err"] > 1e-2
    assert row.summary().startswith("sparse_attention.out:") and "at [" in row.summary()
    assert not result.passed


def test_one_scale_byte_off_fails_with_byte_and_slot(registry):
    result = run_suite(["scale-byte-off"], _cases("qnorm_rope_insert", "fp8_ds_mla and deepseek"),
                       registry=registry)
    assert [r.outcome for r in result.rows] == ["failed", "failed"]
    cache = result.rows[0].metrics["swa_cache"]
    assert cache["byte_exact"] is False and cache["bytes_differing"] == 1
    assert cache["dequantized_within_one_ulp"] is False
    assert result.rows[0].metrics["q_out"]["passed"] is True  # only the cache is wrong
    assert "swa_cache" in result.rows[0].summary()


def test_reference_passes_everything_and_unsupported_is_reported(registry):
    result = run_suite(["reference", "no-lse"], _cases("sparse_attention", "csa and prefill and not ascend"), registry=registry)
    by = {(r.backend, r.case): r for r in result.rows}
    assert all(r.outcome == "passed" for r in result.rows if r.backend == "reference")
    no_lse = [r for r in result.rows if r.backend == "no-lse"]
    assert {r.outcome for r in no_lse} == {"passed", "unsupported"}
    bf16 = by[("no-lse", "sparse_attention/csa/vllm/bf16/prefill")]
    assert bf16.outcome == "unsupported" and "needs kv_format fp8_ds_mla, found bf16" in bf16.reasons[0]
    assert by[("no-lse", "sparse_attention/csa/vllm/fp8_ds_mla/prefill")].metrics["lse"]["passed"] is None


def test_unavailable_backend_is_skipped_with_its_probe(registry):
    gone = ReferenceBackend()
    gone.probe = lambda: ["needs sm_100, found cpu"]
    reg = registry_of(gone, reference=False)
    result = run_suite(["reference"], _cases("indexer_q"), registry=reg)
    assert {r.outcome for r in result.rows} == {"skipped"} and result.rows[0].reasons == ["needs sm_100, found cpu"]


def test_differential_mode(registry):
    same = run_differential("reference", "reference", _cases("output_projection"), seed=7, registry=registry)
    assert same.passed and {r.outcome for r in same.rows} == {"passed"}
    assert same.rows[0].params["seed"] != default_cases()[0].seed
    wrong = run_differential("reference", "sink-flipped", _cases("sparse_attention", "hca and decode"),
                             registry=registry)
    assert {r.outcome for r in wrong.rows} == {"failed"}


def test_an_exception_is_an_error_row(registry):
    class Raises(ReferenceBackend):
        name = "raises"

        def indexer_q(self, *args, **kwargs):
            raise RuntimeError("kernel exploded")

    registry.register_backend(Raises())
    result = run_suite(["raises"], _cases("indexer_q", "vllm"), registry=registry)
    assert result.rows[0].outcome == "error" and "kernel exploded" in result.rows[0].reasons[0]


def test_poisoned_cache_catches_a_missing_write(registry):
    class SkipsLastToken(ReferenceBackend):
        name = "skips-last"

        def qnorm_rope_insert(self, q, kv, positions, cos_sin, swa_cache, swa_slot_mapping, **kwargs):
            slots = swa_slot_mapping.clone()
            slots[-2] = -1  # forgets one real token
            return super().qnorm_rope_insert(q, kv, positions, cos_sin, swa_cache, slots, **kwargs)

    registry.register_backend(SkipsLastToken())
    row = run_suite(["skips-last"], _cases("qnorm_rope_insert", "bf16"), registry=registry).rows[0]
    assert row.outcome == "failed" and row.metrics["swa_cache"]["nan_mismatch"] == 512


def test_expected_failure_entries():
    class Listed(ReferenceBackend):
        name = "listed"
        expected_failures: ClassVar = {"indexer_q/*/vllm/*": "known", "nothing/matches/*": "stale"}

    assert unmatched_expected_failures(Listed(), default_cases()) == ["nothing/matches/*"]
    reg = registry_of(Listed(), reference=False)
    with pytest.warns(UserWarning, match="'nothing/matches/\\*' matches no conformance case"):
        result = run_suite(["listed"], _cases("indexer_q", "vllm"), registry=reg)
    assert result.rows[0].expected_failure == "known"


def test_default_suite_is_small():
    cases = default_cases()
    assert len({c.id for c in cases}) == len(cases) >= 40
    assert {c.op for c in cases} == {"qnorm_rope_insert", "compress_insert", "indexer_q", "indexer_topk",
                                     "sparse_attention", "output_projection"}
    assert torch.tensor([c.seed for c in cases]).unique().numel() == len(cases)


def test_differential_mode_checks_both_sides_dtypes(registry):
    """A differential run compares B with A and holds both to the fake kernel's layout: a backend A that
    widens its outputs fails (``layout_<A>``) even though B matches A's values; no value metric repeats it."""
    class Widens(ReferenceBackend):
        name = "widens"

        def indexer_q(self, *args, **kwargs):
            q, w = super().indexer_q(*args, **kwargs)
            return q.double(), w.double()

    registry.register_backend(Widens())
    result = run_differential("widens", "reference", _cases("indexer_q", "vllm"), registry=registry)
    row = result.rows[0]
    assert row.outcome == "failed", row.metrics
    assert "q: dtype torch.float64, the fake kernel promises torch.bfloat16" in row.metrics["layout_widens"]["reason"]
    assert "w: dtype torch.float64" in row.metrics["layout_widens"]["reason"]
    assert row.metrics["q"]["passed"] is True and "layout" not in row.metrics  # B's layout is right
    assert not any("dtype" in m.get("reason", "") for k, m in row.metrics.items() if k != "layout_widens")


def test_a_wrong_fused_topk_slot_conversion_fails_the_slots_metric():
    """indexer_topk_slots is checked against the backend's own top-k converted by topk_local_to_global:
    one slot off fails (and says where), a miscounted lens too; the reference's composition passes."""
    class SlotOff(ReferenceBackend):
        name = "slot-off"

        def indexer_topk_slots(self, *args, **kwargs):
            slots, lens = super().indexer_topk_slots(*args, **kwargs)
            slots[0, 0] += 1
            return slots, lens

    class LensOff(ReferenceBackend):
        name = "lens-off"

        def indexer_topk_slots(self, *args, **kwargs):
            slots, lens = super().indexer_topk_slots(*args, **kwargs)
            return slots, lens + 1

    reg = registry_of(SlotOff(), LensOff())
    cases = _cases("indexer_topk", "deepseek and mixed")
    result = run_suite(["reference", "slot-off", "lens-off"], cases, registry=reg, far=False)
    by = {r.backend: r for r in result.rows}
    assert by["reference"].outcome == "passed" and by["reference"].metrics["slots"]["passed"] is True
    assert by["slot-off"].outcome == by["lens-off"].outcome == "failed"
    assert by["slot-off"].metrics["topk"]["passed"] is True  # only the conversion is wrong
    assert by["slot-off"].metrics["slots"]["first_fail_where"] == [0, 0]
    topk = prepare(cases[0]).check["topk"]
    assert by["lens-off"].metrics["slots"]["first_fail_where"] == [0, topk]  # [slots | lens]: the lens column


def test_the_slots_metric_runs_on_the_cases_own_holed_table():
    """The table ``indexer_topk_slots`` gets is part of the case (``check["slots_block_table"]``): the key block
    table with pages 1, 4, ... unallocated and cut to half its width, so that -1 slots occur both ways; the
    backend gets it (a copy), and the case's stays as generated."""
    from dsv4.metadata import topk_local_to_global

    seen = []

    class Records(ReferenceBackend):
        name = "records"

        def indexer_topk_slots(self, *args, **kwargs):
            seen.append(args[6].clone())
            args[6].fill_(7)  # a backend scribbling on its table changes nothing for the check
            return super().indexer_topk_slots(*args[:6], seen[-1], **kwargs)

    cases = _cases("indexer_topk", "deepseek and mixed")
    (row,) = run_suite(["records"], cases, registry=registry_of(Records(), reference=False), far=False).rows
    prepared = prepare(cases[0])
    key_table, table = prepared.steps[0][0][5], prepared.check["slots_block_table"]
    assert row.outcome == "passed" and len(seen) == 1 and torch.equal(seen[0], table)
    assert table.dtype == torch.int32 and table.shape == (key_table.shape[0], max(1, key_table.shape[1] // 2))
    assert (table[:, 1::3] == -1).all() and torch.equal(table[:, 0::3], key_table[:, 0: table.shape[1]: 3])
    local = ReferenceBackend().indexer_topk(*prepared.steps[0][0], **prepared.steps[0][1])
    slots, _ = topk_local_to_global(local, prepared.steps[0][0][3], table, prepared.check["block_size"])
    pages = local.long() // prepared.check["block_size"]
    missing = (local >= 0) & (slots == -1)
    assert (missing & (pages < table.shape[1])).any() and (missing & (pages >= table.shape[1])).any()
