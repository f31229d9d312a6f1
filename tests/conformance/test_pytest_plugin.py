"""The pytest plugin (registered by the ``pytest11`` entry point ``dsv4``): the documented invocation
works, a backend named twice runs once, a bad device or a backend whose plugin failed is a usage error, Triton
interprets without a GPU."""
from __future__ import annotations

import os

import pytest
import torch
from dsv4.conformance import pytest_plugin
from dsv4.conformance.cases import default_cases

pytest_plugins = ["pytester"]


def _collected(pytester, *args: str) -> list[str]:
    recorder = pytester.inline_run("--collect-only", *args)
    (call,) = recorder.getcalls("pytest_collection_finish")
    return [item.nodeid for item in call.session.items]


def test_docstring_shows_an_invocation_that_works(pytester):
    doc = pytest_plugin.__doc__
    assert "pytest --dsv4-backend NAME" in doc and "``pytest -p dsv4.conformance.pytest_plugin" not in doc
    assert len(_collected(pytester, "-p", "dsv4", "--dsv4-backend", "reference")) == len(default_cases())


def test_a_backend_named_twice_runs_once(pytester):
    ids = _collected(pytester, "--dsv4-backend", "reference", "--dsv4-backend", "reference")
    assert len(ids) == len(set(ids)) == len(default_cases())


@pytest.mark.parametrize("device", ["bogus", "cuda:99", *(["cuda"] if not torch.cuda.is_available() else [])])
def test_a_bad_device_is_a_usage_error(device, pytester):
    result = pytester.runpytest("--dsv4-backend", "reference", "--dsv4-device", device)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--dsv4-device: expected*got '{device}'*"])


def test_a_backend_whose_plugin_failed_is_a_usage_error_with_the_reason(pytester, monkeypatch):
    """``--dsv4-backend vendorx`` after vendorx's import raised: exit 4, and the message says why it is missing."""
    import types

    import dsv4.registry
    from _wrong_backends import registry_of
    from dsv4.hookspecs import hookimpl

    registry = registry_of()
    plugin = types.ModuleType("vendorx_plugin")
    plugin.dsv4_register_backends = hookimpl(lambda register: (_ for _ in ()).throw(ImportError("no libvendorx")))
    registry.load_plugin(plugin, "vendorx", strict=False)
    monkeypatch.setattr(dsv4.registry, "get_registry", lambda: registry)
    result = pytester.runpytest_inprocess("--dsv4-backend", "vendorx")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    expected = "*--dsv4-backend: expected one of reference, got vendorx; plugins that failed to load: vendorx " \
        "(ImportError: no libvendorx)*"
    result.stderr.fnmatch_lines([expected])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU: Triton compiles")
def test_triton_is_interpreted_without_a_gpu(pytester, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pytester.runpytest("--dsv4-backend", "triton", "--collect-only")
    assert os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.parametrize("near_only", [False, True])
def test_near_only_drops_the_far_run(pytester, near_only):
    """Each item's report row (user property ``dsv4_row``) has ``@far`` metrics unless --dsv4-near-only."""
    import json

    args = ["--dsv4-backend", "reference", "-k", "indexer_topk and vllm"] + (["--dsv4-near-only"] if near_only else [])
    recorder = pytester.inline_run(*args)
    reports = [r for r in recorder.getreports("pytest_runtest_logreport") if r.when == "call"]
    assert reports and all(r.passed for r in reports)
    for r in reports:
        row = json.loads(dict(r.user_properties)["dsv4_row"])
        assert ("topk@far" in row["metrics"]) is not near_only


def test_a_far_run_that_could_not_run_warns(pytester, monkeypatch):
    from dsv4.conformance import placement

    def no_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")

    monkeypatch.setattr(placement, "place_far", no_memory)
    result = pytester.runpytest_inprocess("--dsv4-backend", "reference", "-k", "indexer_topk and vllm and mixed")
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(["*far run not possible here (no memory for the far caches)*"])
