"""dsv4.backend.OptionalImport: one import attempt, its one-line reason, and probe reasons; the op signatures
ARCHITECTURE §3 documents are Backend's."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
from dsv4.backend import OP_NAMES, REASON_CHARS, Backend, OptionalImport, missing_parameters
from dsv4.specs.errors import BackendUnavailableError


def test_optional_import_absent_module_gives_one_line_reason_once() -> None:
    calls = []

    def loader():
        calls.append(1)
        import dsv4_no_such_vendor_package  # noqa: F401

    opt = OptionalImport("vendorlib", loader)
    reasons = opt.reasons()
    assert len(reasons) == 1 and reasons[0].startswith("vendorlib not importable: ModuleNotFoundError")
    assert "\n" not in reasons[0]
    assert opt.reasons(injected=object()) == []  # a module passed in stands in for the import
    with pytest.raises(BackendUnavailableError, match="vendorlib not importable"):
        opt.get()
    assert len(calls) == 1  # the failed import is not retried on every probe


def test_optional_import_present_or_unusable() -> None:
    module = object()
    assert OptionalImport("ok", lambda: module).reasons() == []
    assert OptionalImport("ok", lambda: module).get() is module

    def unusable():
        raise BackendUnavailableError("vendorlib 1.0 lacks the sm_90 kernels")

    assert OptionalImport("vendorlib", unusable).reasons() == ["vendorlib 1.0 lacks the sm_90 kernels"]


def test_a_broken_vendor_package_is_absent_with_a_one_line_reason() -> None:
    """Broken packages raise more than ImportError (IPEX-style AttributeError, ValueError from a version
    check): each is recorded once as a one-line reason, never raised from a probe."""
    calls = []

    def loader():
        calls.append(1)
        raise AttributeError("module 'torch' has no attribute 'xpu_bogus'\n  while importing\n\tvendorlib")

    opt = OptionalImport("vendorlib", loader)
    assert opt.reasons() == [("vendorlib not importable: AttributeError: module 'torch' has no attribute "
                             "'xpu_bogus' while importing vendorlib")]
    with pytest.raises(BackendUnavailableError, match="AttributeError"):
        opt.get()
    assert len(calls) == 1

    long = OptionalImport("vendorlib", lambda: (_ for _ in ()).throw(ValueError("x" * 1000))).reasons()[0]
    assert len(long) == REASON_CHARS and long.endswith("...")


def test_missing_parameters_names_what_an_old_entry_point_lacks() -> None:
    def old(q, kv, *, out=None):
        return None

    def new(q, kv, *, out=None, attn_sink=None):
        return None

    def anything(q, **kwargs):
        return None

    assert missing_parameters(old, ("out", "attn_sink")) == ["attn_sink"]
    assert missing_parameters(new, ("out", "attn_sink")) == []
    assert missing_parameters(anything, ("attn_sink",)) == []
    assert missing_parameters(object(), ("attn_sink",)) == ["attn_sink"]  # no signature: nothing is known


def _documented_signature(text: str, op: str) -> tuple[list[str], list[str]]:
    """(positional, keyword-only) parameter names of ``op(...)`` as ARCHITECTURE §3 writes it."""
    start = text.index(f"`{op}(") + len(op) + 2
    depth, params, current = 0, [], ""
    for ch in text[start:]:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            if depth == 0:
                break
            depth -= 1
        if ch == "," and depth == 0:
            params.append(current)
            current = ""
        else:
            current += ch
    params.append(current)
    names = [re.match(r"\s*(\*|\w+)", p).group(1) for p in params]
    star = names.index("*") if "*" in names else len(names)
    return names[:star], names[star + 1:]


def test_architecture_section_3_gives_every_op_its_backend_signature() -> None:
    """docs/ARCHITECTURE.md §3 is what a vendor writes a backend from: each op's parameters, in order, and its
    keyword-only ones are exactly Backend's (it once left out qnorm_rope_insert's ``profile``)."""
    text = (Path(__file__).parents[2] / "docs" / "ARCHITECTURE.md").read_text()
    section = text[text.index("## 3. Ops"):text.index("## 4.")]
    for op in OP_NAMES:
        params = list(inspect.signature(getattr(Backend, op)).parameters.values())[1:]
        positional = [p.name for p in params if p.kind is not inspect.Parameter.KEYWORD_ONLY]
        keyword = [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
        assert _documented_signature(section, op) == (positional, keyword), op
