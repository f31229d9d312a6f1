"""dsv4.conformance.metrics and the runner's output contract: what makes an output fail."""
from __future__ import annotations

import pytest
import torch
from dsv4.conformance.cases import Case, execute, prepare, private_copy
from dsv4.conformance.golden import expected_outputs
from dsv4.conformance.metrics import compare_cache, compare_tensor
from dsv4.conformance.runner import compare_outputs
from dsv4.conformance.tolerances import Tolerance


def test_cosine_bound_is_strict() -> None:
    """SPEC §13 says cosine difference < 5e-6: a difference equal to the bound fails."""
    g = torch.Generator().manual_seed(0)
    e = torch.randn(4096, generator=g, dtype=torch.float64)
    a = e + 1e-3 * torch.randn(4096, generator=g, dtype=torch.float64)
    cos = compare_tensor(a, e, Tolerance(abs_tol=1.0))["cos_diff"]
    assert compare_tensor(a, e, Tolerance(abs_tol=1.0, cos_diff=cos))["passed"] is False
    assert compare_tensor(a, e, Tolerance(abs_tol=1.0, cos_diff=cos * 1.01))["passed"] is True


def test_an_unquantized_cache_is_compared_under_the_given_tolerance() -> None:
    """A typed storage without a codec has no e4m3 ULP to allow: its elements are compared under the
    tolerance the suite passes (no second number in metrics.py)."""
    e = torch.ones(2, 8, dtype=torch.float32)
    a = e.clone()
    a[1, 3] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    assert compare_cache(a, e, None, Tolerance(kind="cache"))["passed"] is False
    assert compare_cache(a, e, None, Tolerance(kind="cache", abs_tol=1e-6))["passed"] is True


_WRONG_DTYPE_CASES = [Case("sparse_attention", "csa", "vllm", "fp8_ds_mla", "decode"),
                      Case("indexer_topk", "csa", "deepseek", "indexer_mxfp4", "mixed"),
                      Case("indexer_q", "csa", "deepseek", "-", "mixed")]


class _Widens:
    """The reference's op with every float return widened to fp64 and top-k to int64 (values unchanged)."""

    def __init__(self, op: str) -> None:
        from dsv4.backends.reference import ReferenceBackend

        self.run = getattr(ReferenceBackend(), op)

    def __call__(self, *args, **kwargs):
        result = self.run(*args, **kwargs)
        widen = lambda v: v.to(torch.int64 if v.dtype == torch.int32 else torch.float64)
        return tuple(widen(v) for v in result) if isinstance(result, tuple) else widen(result)


@pytest.mark.parametrize("case", _WRONG_DTYPE_CASES, ids=lambda c: c.id)
def test_a_backend_returning_the_wrong_dtypes_fails_the_layout_metric_once(case: Case) -> None:
    """Widened outputs (values unchanged) fail the ``layout`` metric, naming every output's dtype against the
    fake kernel's; the value metrics compare the values and pass: one failure, reported once. The same
    outputs in the promised dtypes pass both."""
    from dsv4.backends.reference import ReferenceBackend
    from dsv4.conformance.layout import LayoutCheck

    prepared = prepare(case)
    expected = expected_outputs(prepared)
    lse = case.op != "sparse_attention"
    right = LayoutCheck(case.op, prepared.returns, getattr(ReferenceBackend(), case.op))
    actual = execute(private_copy(prepared), right)
    assert right.metrics() == {}
    assert all(m["passed"] is not False for m in compare_outputs(prepared, actual, expected, lse_required=lse)
               .values())
    wrong = LayoutCheck(case.op, prepared.returns, _Widens(case.op))
    widened = execute(private_copy(prepared), wrong)
    layout = wrong.metrics()["layout"]
    assert layout["passed"] is False
    for name in prepared.returns:
        want = "torch.int32" if name == "topk" else "torch.float32" if name in ("w", "lse") else "torch.bfloat16"
        got = "torch.int64" if name == "topk" else "torch.float64"
        assert f"{name}: dtype {got}, the fake kernel promises {want}" in layout["problems"], layout
    assert wrong.uncomparable == {}  # a dtype leaves the values comparable
    metrics = compare_outputs(prepared, widened, expected, lse_required=lse, uncomparable=wrong.uncomparable)
    for name in prepared.returns:
        if name == "lse" and not lse:
            continue
        assert metrics[name]["passed"] is True and "dtype" not in metrics[name].get("reason", ""), (name,
                                                                                                   metrics[name])


def test_an_output_of_another_shape_is_not_compared_and_names_the_layout_problem() -> None:
    """Another shape fails ``layout`` and leaves the value metric uncompared (``passed`` None), naming the
    layout problem instead of reporting a second shape failure."""
    from dsv4.backends.reference import ReferenceBackend
    from dsv4.conformance.layout import LayoutCheck

    prepared = prepare(_WRONG_DTYPE_CASES[2])

    def cut(*args, **kwargs):
        q, w = ReferenceBackend().indexer_q(*args, **kwargs)
        return q[:, :-1], w

    layout = LayoutCheck("indexer_q", prepared.returns, cut)
    actual = execute(private_copy(prepared), layout)
    metrics = compare_outputs(prepared, actual, expected_outputs(prepared), uncomparable=layout.uncomparable)
    assert metrics["q"]["passed"] is None and metrics["q"]["reason"].startswith("not compared: its layout fails (q: "
                                                                                "shape (10, 63, 128)")
    assert metrics["w"]["passed"] is True and layout.metrics()["layout"]["passed"] is False


def test_nan_positions_are_located_and_no_zero_error_is_reported() -> None:
    """A failure made only of NaN positions says where the first one is; the row summary adds no
    "max abs err 0.0 at [0, 0]" (nothing finite is off)."""
    from dsv4.conformance.runner import first_failure

    e = torch.zeros(3, 4, dtype=torch.float64)
    a = e.clone()
    a[2, 1] = float("nan")
    m = compare_tensor(a, e, Tolerance())
    assert m["passed"] is False and "NaN/Inf positions differ (1 NaN, 0 Inf; first at [2, 1])" in m["reason"]
    assert first_failure("op", {"out": m}) == f"op.out: {m['reason']}"
    a[0, 0] = 0.5
    assert first_failure("op", {"out": compare_tensor(a, e, Tolerance())}).endswith("; max abs err 0.5 at [0, 0]")


def test_an_unquantized_cache_failure_says_its_indices_are_page_token_element() -> None:
    e = torch.ones(2, 8, 4, dtype=torch.float32)
    a = e.clone()
    a[1, 3, 2] = float("nan")
    m = compare_cache(a, e, None, Tolerance(kind="cache"))
    assert m["reason"].startswith("[page, token, element] indices: NaN/Inf positions differ") and "[1, 3, 2]" in \
        m["reason"]
