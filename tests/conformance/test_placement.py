"""Far placement (conformance/placement.py): every paged case again with its pages past 16 GiB."""
from __future__ import annotations

import pytest
import torch
from _wrong_backends import registry_of
from dsv4.backends.reference import ReferenceBackend
from dsv4.conformance.cases import default_cases, execute, inputs_sha256, prepare, select_cases
from dsv4.conformance.golden import GoldenStore
from dsv4.conformance.placement import FAR_MIN_BYTES, CachePages, far_pad_blocks, place_far
from dsv4.conformance.runner import run_case, run_suite

PAGED_OPS = ("qnorm_rope_insert", "compress_insert", "indexer_topk", "sparse_attention")


def _csa_decode():
    """The suite's CSA vllm fp8_ds_mla decode case of sparse attention."""
    return select_cases(default_cases(), ["sparse_attention"], "csa and vllm and fp8_ds_mla and decode")[0]


def _one_case_each() -> list:
    seen, out = set(), []
    for case in default_cases():
        key = (case.op, case.cache_format, case.kind)
        if key not in seen:
            seen.add(key)
            out.append(case)
    return out


def test_every_paged_op_names_its_pages_and_only_those():
    for case in default_cases():
        prepared = prepare(case)
        assert bool(prepared.pages) == (case.op in PAGED_OPS), case.id
        args = prepared.steps[0][0]
        for index, pages in prepared.pages.items():
            assert isinstance(args[index], torch.Tensor) and args[index].dim() >= 2, case.id
            for step_args, _ in prepared.steps:  # every index argument addresses within the cache
                for t in pages.tables:
                    assert int(step_args[t].max()) < args[index].shape[0], case.id
                for s in pages.slots:
                    assert int(step_args[s].max()) < args[index].shape[0] * pages.block_size, case.id
        for index, _fmt in prepared.caches.values():  # every written cache is paged
            assert index in prepared.pages, case.id


@pytest.mark.parametrize("case", _one_case_each(), ids=lambda c: c.id)
def test_place_far_moves_pages_past_the_32_bit_range_and_keeps_the_input(case):
    prepared = prepare(case)
    if not prepared.pages:
        with pytest.raises(ValueError, match="no paged cache"):
            place_far(prepared)
        return
    before = inputs_sha256(prepared)
    far = place_far(prepared)
    assert inputs_sha256(prepared) == before  # the near inputs are untouched
    for index, pages in prepared.pages.items():
        near_cache, far_cache = prepared.steps[0][0][index], far.steps[0][0][index]
        pad = far.leading[index]
        assert pad == far_pad_blocks(near_cache)
        page_bytes = near_cache[0].numel() * near_cache.element_size()
        assert pad * page_bytes >= FAR_MIN_BYTES
        for unit in (1, 2, 4):  # a 32-bit offset in bytes, 2-byte or 4-byte units wraps onto the poison
            wrapped = (pad * page_bytes // unit) % 2**32 * unit
            assert 0 <= wrapped < 2**21 and bool(far_cache.view(torch.uint8).flatten()[wrapped] == 0xFF), unit
        assert torch.equal(far_cache[pad:].view(torch.uint8), near_cache.view(torch.uint8))
        assert bool((far_cache[0].view(torch.uint8) == 0xFF).all())  # wrapped offsets land on poison
        assert bool((far_cache[pad - 1].view(torch.uint8) == 0xFF).all())
        for (near_args, _), (far_args, _) in zip(prepared.steps, far.steps):
            assert far_args[index] is far_cache  # one cache object in every step, as in the near case
            for t in pages.tables:
                n, f = near_args[t], far_args[t]
                assert f.dtype == n.dtype and torch.equal(f, torch.where(n >= 0, n + pad, n))
            for s in pages.slots:
                n, f = near_args[s], far_args[s]
                assert f.dtype == n.dtype and torch.equal(f, torch.where(n >= 0, n + pad * pages.block_size, n))
                assert bool((n < 0).any()) == bool((f < 0).any())


def test_far_outputs_equal_near_outputs_on_the_reference():
    backend = ReferenceBackend()
    for case in _one_case_each():
        prepared = prepare(case)
        if not prepared.pages:
            continue
        from dsv4.conformance.cases import private_copy

        near = execute(private_copy(prepared), getattr(backend, case.op))
        far = execute(place_far(prepared), getattr(backend, case.op))
        assert near.keys() == far.keys()
        for name in near:  # caches come back without the pad
            assert torch.equal(near[name].view(torch.uint8), far[name].view(torch.uint8)), (case.id, name)


class HighBitsLost(ReferenceBackend):
    """Addresses its caches with 20-bit slot numbers: right on small caches, wrong past them, the way a
    32-bit page offset is right below 2 GiB."""

    name = "high-bits-lost"

    def sparse_attention(self, q, swa_cache, swa_indices, *args, **kwargs):
        lost = torch.where(swa_indices >= 0, swa_indices & 0xFFFFF, swa_indices)
        return super().sparse_attention(q, swa_cache, lost, *args, **kwargs)

    def qnorm_rope_insert(self, q, kv, positions, cos_sin, swa_cache, slots, **kwargs):
        lost = torch.where(slots >= 0, slots & 0xFFFFF, slots)
        return super().qnorm_rope_insert(q, kv, positions, cos_sin, swa_cache, lost, **kwargs)


def test_the_far_run_fails_a_backend_that_drops_high_address_bits():
    registry = registry_of(HighBitsLost(), reference=False)
    cases = select_cases(default_cases(), ["sparse_attention", "qnorm_rope_insert"], "vllm and fp8_ds_mla")
    result = run_suite(["high-bits-lost"], cases, registry=registry)
    for row in result.rows:
        assert row.outcome == "failed", row.case
        assert "pages past 16 GiB" in row.summary(), row.summary()
        near = [name for name in row.metrics if not name.endswith("@far")]
        assert near and all(row.metrics[name]["passed"] is not False for name in near), row.case
        assert any(row.metrics[name]["passed"] is False for name in row.metrics if name.endswith("@far")), row.case
    # without the far run the same backend passes: the near cases cannot see it
    assert run_suite(["high-bits-lost"], cases, registry=registry, far=False).passed


def test_run_case_far_flag_and_metric_names():
    case = select_cases(default_cases(), ["compress_insert"], "vllm and indexer")[0]
    store = GoldenStore()
    with_far = run_case(ReferenceBackend(), case, torch.device("cpu"), store)
    assert with_far.outcome == "passed"
    assert set(with_far.metrics) == {"state_cache", "out_cache", "state_cache@far", "out_cache@far"}
    near_only = run_case(ReferenceBackend(), case, torch.device("cpu"), store, far=False)
    assert set(near_only.metrics) == {"state_cache", "out_cache"}
    unpaged = run_case(ReferenceBackend(), select_cases(default_cases(), ["indexer_q"])[0], torch.device("cpu"), store)
    assert not any(name.endswith("@far") for name in unpaged.metrics)


def test_a_far_int32_table_that_would_overflow_is_refused():
    from dsv4.conformance.placement import _shift

    with pytest.raises(OverflowError, match="int32"):
        _shift(torch.tensor([2**31 - 10], dtype=torch.int32), 100)
    assert CachePages(16).tables == () and CachePages(16).slots == ()


class _SmallCopiesOnly(torch.Tensor):
    """A tensor whose ``.cpu()`` refuses more than 1 MiB: a GPU far-placed cache copied whole is gigabytes."""

    def cpu(self, *args, **kwargs):
        assert self.numel() * self.element_size() <= 2**20, f"{self.numel() * self.element_size()} bytes copied"
        return super().cpu(*args, **kwargs)


def test_the_topk_check_reads_the_rows_it_scores_not_the_cache():
    from dsv4.conformance.runner import compare_outputs

    case = select_cases(default_cases(), ["indexer_topk"], "vllm")[0]
    far = place_far(prepare(case))
    args, kwargs = far.steps[0]
    out = ReferenceBackend().indexer_topk(*args, **kwargs)
    guarded = args[4].as_subclass(_SmallCopiesOnly)
    with pytest.raises(AssertionError, match="bytes copied"):
        guarded.cpu()
    far.steps[0] = ((*args[:4], guarded, *args[5:]), kwargs)
    far.check = {k: v for k, v in far.check.items() if k != "scores"}  # score from the arguments, as a caller
    metrics = compare_outputs(far, {"topk": out}, {})
    assert metrics["topk"]["passed"] is True


@pytest.mark.parametrize("near_only", [False, True])
def test_cli_near_only(near_only, tmp_path, monkeypatch):
    import json

    from _cli_helpers import cli_registry
    from dsv4.conformance.cli import main

    cli_registry(monkeypatch)
    report = tmp_path / "r.json"
    argv = ["run", "--backend", "reference", "--op", "indexer_topk", "-k", "vllm", "--json", str(report)]
    assert main(argv + (["--near-only"] if near_only else [])) == 0
    rows = json.loads(report.read_text())["results"]
    assert rows and all(("topk@far" in row["metrics"]) is not near_only for row in rows)


def test_one_index_tensor_for_two_caches_is_refused():
    case = select_cases(default_cases(), ["compress_insert"], "csa and vllm and indexer")[0]
    prepared = prepare(case)
    args = list(prepared.steps[0][0])
    args[10] = args[5]  # the state slots also address the compressed cache, whose pad differs
    prepared.steps[0] = (tuple(args), prepared.steps[0][1])
    with pytest.raises(ValueError, match="two paged caches"):
        place_far(prepared)


def test_differential_mode_places_b_far():
    from dsv4.conformance.runner import run_differential

    registry = registry_of(HighBitsLost())
    cases = select_cases(default_cases(), ["sparse_attention"], "vllm and fp8_ds_mla and decode")
    result = run_differential("reference", "high-bits-lost", cases, seed=3, registry=registry)
    for row in result.rows:
        assert row.outcome == "failed", row.case
        assert all(m["passed"] is not False for k, m in row.metrics.items() if not k.endswith("@far")), row.case
        assert any(m["passed"] is False for k, m in row.metrics.items() if k.endswith("@far")), row.case
    assert run_differential("reference", "high-bits-lost", cases, seed=3, registry=registry, far=False).passed


class FarRaises(ReferenceBackend):
    """Raises ``error`` (a RuntimeError's text, or an exception) on caches of more than 1 GiB."""

    name = "far-raises"

    def __init__(self, error: str | Exception = "CUDA error: an illegal memory access was encountered") -> None:
        self.error = error

    def sparse_attention(self, q, swa_cache, *args, **kwargs):
        if swa_cache.numel() * swa_cache.element_size() > 2**30:
            raise RuntimeError(self.error) if isinstance(self.error, str) else self.error
        return super().sparse_attention(q, swa_cache, *args, **kwargs)


def test_a_far_run_that_raises_is_an_error_that_keeps_the_near_metrics():
    case = _csa_decode()
    row = run_case(FarRaises(), case, torch.device("cpu"), GoldenStore())
    assert row.outcome == "error"  # an exception of the backend; the near run's metrics are there
    assert row.metrics["out"]["passed"] is True and row.metrics["lse"]["passed"] is True
    reason = "with the pages past 16 GiB: RuntimeError: CUDA error: an illegal memory access was encountered"
    assert row.metrics["run@far"] == {"passed": False, "raised": True, "reason": reason}
    assert row.reasons == [reason] and row.summary() == reason


@pytest.mark.parametrize("error", [RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                   torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                   MemoryError()])
def test_out_of_memory_inside_the_backend_call_is_an_error_not_a_far_run_not_run(error):
    """Only the far caches' own allocation may find no memory; the backend's call beside them may not."""
    from dsv4.conformance.runner import far_not_run

    row = run_case(FarRaises(error), _csa_decode(), torch.device("cpu"), GoldenStore())
    assert row.outcome == "error" and row.counts_as_failure and not far_not_run(row.metrics)
    assert row.metrics["run@far"]["passed"] is False and type(error).__name__ in row.reasons[0]


class OutDoubled(ReferenceBackend):
    name = "out-doubled"

    def sparse_attention(self, *args, **kwargs):
        out, lse = super().sparse_attention(*args, **kwargs)
        return out * 2, lse


def test_a_far_metric_blames_the_placement_only_where_the_near_one_passed():
    case = _csa_decode()
    row = run_case(OutDoubled(), case, torch.device("cpu"), GoldenStore())
    assert row.metrics["out"]["passed"] is False and row.metrics["out@far"]["passed"] is False
    assert "pages past" not in row.metrics["out@far"]["reason"]
    assert row.metrics["lse@far"]["passed"] is True


@pytest.mark.parametrize("error,not_run", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB"), True),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate memory"), True),
    (MemoryError(), True),
    (RuntimeError("shape '[2, 2]' is invalid for input of size 3"), False),  # a placement bug is a failure
    (ValueError("one index tensor addresses two paged caches"), False),
])
def test_only_a_missing_allocation_makes_the_far_run_not_run(error, not_run, monkeypatch):
    from dsv4.conformance import placement
    from dsv4.conformance.runner import far_not_run

    def place_far(*args):
        raise error

    monkeypatch.setattr(placement, "place_far", place_far)
    case = _csa_decode()
    row = run_case(ReferenceBackend(), case, torch.device("cpu"), GoldenStore())
    assert row.metrics["out"]["passed"] is True  # the near run's verdict stays either way
    assert row.metrics["run@far"]["passed"] is (None if not_run else False)
    assert row.outcome == ("passed" if not_run else "failed")
    assert bool(far_not_run(row.metrics)) is not_run
    if not_run:
        assert row.metrics["run@far"]["reason"].startswith("far run not possible here (no memory for the far caches)")


def test_a_far_run_that_could_not_run_is_visible_everywhere(monkeypatch, tmp_path, capsys, recwarn):
    import json

    from _cli_helpers import cli_registry
    from dsv4.conformance import placement
    from dsv4.conformance.cli import main
    from dsv4.conformance.report import junit_xml

    def no_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")

    monkeypatch.setattr(placement, "place_far", no_memory)
    cli_registry(monkeypatch)
    report_path = tmp_path / "r.json"
    argv = ["run", "--backend", "reference", "--op", "indexer_topk", "-k", "vllm", "--json", str(report_path)]
    assert main(argv) == 0  # the near verdicts pass; the missing far run is said, not failed
    out = capsys.readouterr().out
    assert "could not run with their pages placed far here" in " ".join(out.split())
    report = json.loads(report_path.read_text())
    rows = report["results"]
    assert report["summary"]["far_not_run"] == len(rows) > 0
    assert "far run not possible here" in junit_xml(report)
    from dsv4.conformance.runner import ResultRow

    row = ResultRow(**{k: rows[0][k] for k in ("backend", "op", "case", "outcome", "metrics")})
    assert row.summary().startswith("far run not possible here")


def test_the_far_gib_options_are_placements_choices():
    """The CLI and the pytest plugin spell the choices without importing torch at parse time: held equal."""
    import argparse

    from dsv4.conformance import pytest_plugin
    from dsv4.conformance.cli import _run_arguments
    from dsv4.conformance.placement import FAR_GIB, FAR_GIB_CHOICES

    parser = argparse.ArgumentParser()
    _run_arguments(parser)
    action = next(a for a in parser._actions if a.dest == "far_gib")
    assert tuple(action.choices) == FAR_GIB_CHOICES and action.default == FAR_GIB

    class Group:
        def __init__(self):
            self.options = {}

        def addoption(self, name, **kwargs):
            self.options[name] = kwargs

    class Parser:
        group = Group()

        def getgroup(self, *args):
            return self.group

    parser = Parser()
    pytest_plugin.pytest_addoption(parser)
    option = parser.group.options["--dsv4-far-gib"]
    assert tuple(option["choices"]) == FAR_GIB_CHOICES and option["default"] == FAR_GIB


@pytest.mark.parametrize("gib", [4, 8, 16])
def test_a_smaller_pad_places_pages_past_its_gib_and_catches_byte_offsets(gib):
    case = _csa_decode()
    prepared = prepare(case)
    far = place_far(prepared, gib)
    cache = prepared.steps[0][0][1]
    page_bytes = cache[0].numel() * cache.element_size()
    assert far.leading[1] * page_bytes >= (gib << 30) and far.leading[1] == far_pad_blocks(cache, gib)
    registry = registry_of(HighBitsLost(), reference=False)
    row = run_suite(["high-bits-lost"], [case], registry=registry, far_gib=gib).rows[0]
    assert row.outcome == "failed" and f"pages past {gib} GiB" in row.summary()
    with pytest.raises(ValueError, match="one of"):
        place_far(prepared, 5)
