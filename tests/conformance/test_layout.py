"""Every output is laid out as the op's fake kernel promises torch.compile (ARCHITECTURE §3: contiguous): a
backend whose values are right in another layout fails by name, never as an expected failure."""
from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from _wrong_backends import HeadMajorOut, registry_of
from dsv4.backend import OP_NAMES
from dsv4.backends.reference import ReferenceBackend
from dsv4.conformance.cases import default_cases, prepare, private_copy, select_cases
from dsv4.conformance.layout import layout_problems, promised_outputs
from dsv4.conformance.runner import run_differential, run_suite

_FIRST = {c.op: c for c in reversed(default_cases()) if c.variant != "wide"}


def test_a_head_major_out_fails_the_layout_metric_by_name():
    cases = select_cases(default_cases(), ["sparse_attention"], "csa and vllm and decode and fp8_ds_mla")
    (row,) = run_suite(["head-major-out"], cases[:1], registry=registry_of(HeadMajorOut()), far=False).rows
    assert row.outcome == "failed" and row.metrics["out"]["passed"] is True  # the values are right
    reason = row.metrics["layout"]["reason"]
    assert reason.startswith("out: strides (512, 1536, 1), the fake kernel promises (4096, 512, 1) "
                             "(contiguous (3, 8, 512))"), reason
    assert "lse" not in reason and "torch.compile" in reason
    assert row.summary().startswith("sparse_attention.layout: out: strides")
    diff = run_differential("reference", "head-major-out", cases[:1], seed=3, registry=registry_of(HeadMajorOut()),
                            far=False)
    assert diff.rows[0].outcome == "failed" and diff.rows[0].metrics["layout"]["passed"] is False


def test_a_layout_failure_is_never_an_expected_failure():
    class Listed(HeadMajorOut):
        name = "listed-head-major"
        expected_failures: ClassVar = {"sparse_attention/*": "known"}

    cases = select_cases(default_cases(), ["sparse_attention"], "hca and vllm and decode")
    (row,) = run_suite(["listed-head-major"], cases[:1], registry=registry_of(Listed()), far=False).rows
    assert row.outcome == "failed" and row.expectation is None and row.counts_as_failure
    assert "layout" in row.metrics["expectation"]["reason"]


@pytest.mark.parametrize("op", [op for op in OP_NAMES if op != "compress_insert"])
def test_the_fake_kernels_promise_contiguous_outputs_for_head_major_inputs(op):
    """The fakes allocate contiguous outputs whatever the first input's strides, as the reference and the
    Triton wrappers do (``empty_like`` of a head-major q would promise q's strides instead)."""
    prepared = private_copy(prepare(_FIRST[op]))
    args, kwargs = prepared.steps[0]
    first = args[0]
    args = (first.transpose(0, 1).contiguous().transpose(0, 1), *args[1:]) if first.dim() == 3 else args
    assert all(t.is_contiguous() for t in promised_outputs(op, args, kwargs))
    result = getattr(ReferenceBackend(), op)(*args, **kwargs)
    assert layout_problems(op, prepared.returns, args, kwargs, result) == []


def test_problems_name_shape_dtype_and_count():
    prepared = prepare(_FIRST["indexer_q"])
    args, kwargs = prepared.steps[0]
    q, w = ReferenceBackend().indexer_q(*args, **kwargs)
    names = prepared.returns
    assert layout_problems("indexer_q", names, args, kwargs, (q[:1], w)) == \
        [f"q: shape (1, 64, 128), the fake kernel promises {tuple(q.shape)}"]
    assert layout_problems("indexer_q", names, args, kwargs, (q, w.double())) == \
        ["w: dtype torch.float64, the fake kernel promises torch.float32"]
    assert layout_problems("indexer_q", names, args, kwargs, q) == ["1 return values, the fake kernel promises 2"]
    one = (args[0][:1], args[1][:1], args[2][:1], args[3])
    lone_q = torch.empty(64, 1, 128, dtype=q.dtype).transpose(0, 1)  # [1, 64, 128]: a stride of a size-1 dim
    assert layout_problems("indexer_q", names, one, kwargs, (lone_q, w[:1])) == []


def test_a_wrong_dtype_fails_the_row_once_in_the_layout_metric():
    """A backend returning fp64 ``q`` / ``w`` (values right) fails its row through ``layout`` alone: the value
    metrics compare the values (they pass), and nothing else reports the dtype."""
    class Widens(ReferenceBackend):
        name = "widens"

        def indexer_q(self, *args, **kwargs):
            q, w = super().indexer_q(*args, **kwargs)
            return q.double(), w.double()

    cases = select_cases(default_cases(), ["indexer_q"], "deepseek")
    (row,) = run_suite(["widens"], cases, registry=registry_of(Widens()), far=False).rows
    assert row.outcome == "failed" and row.counts_as_failure
    assert row.metrics["layout"]["problems"] == ["q: dtype torch.float64, the fake kernel promises torch.bfloat16",
                                                 "w: dtype torch.float64, the fake kernel promises torch.float32"]
    assert row.metrics["q"]["passed"] is True and row.metrics["w"]["passed"] is True
    assert [k for k, m in row.metrics.items() if m.get("passed") is False] == ["layout"]
    assert row.summary().startswith("indexer_q.layout: q: dtype torch.float64")


def test_an_output_that_is_not_a_tensor_fails_layout_not_with_an_error():
    class Listed(ReferenceBackend):
        name = "listed"

        def indexer_q(self, *args, **kwargs):
            q, w = super().indexer_q(*args, **kwargs)
            return q, w.tolist()

    cases = select_cases(default_cases(), ["indexer_q"], "deepseek")
    (row,) = run_suite(["listed"], cases, registry=registry_of(Listed()), far=False).rows
    assert row.outcome == "failed", row.reasons
    assert row.metrics["layout"]["problems"] == ["w: a list, the fake kernel promises a tensor"]
    assert row.metrics["w"]["passed"] is None and row.metrics["q"]["passed"] is True
