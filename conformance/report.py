"""Conformance reports: the JSON document is primary; JUnit XML is derived from it.

JSON (schema: ``report_schema.json``, ``"schema": "dsv4-conformance-report/1"``): top-level
``environment`` (versions, device, env switches), ``backends`` (name -> status, reasons, package
versions, plugin, capabilities; plugins that failed to load appear with status ``failed``),
``plugins`` (from the CLI: every entry point's state, error or refusal, load time),
``results`` (rows: ``backend``, ``op``, ``case``, ``outcome``, ``metrics`` per output,
``seconds``, ``reasons``, ``expected_failure``, ``expected_source``, ``params``, and
``unexpected_pass``: a row listed as an expected failure that passed, XPASS), ``summary``
(counts per outcome, ``passed_all``, ``expected_failures``: rows that failed as expected (never an
error: ``conformance.expectations``), ``unexpected_passes``, ``far_not_run``: rows whose far run found no memory here).

JUnit: a plugin that failed to load or was refused is a skipped testcase of the testsuite
``dsv4.plugins``, with its reason; a failure listed as expected (within its entry) is ``<skipped message="expected failure: ...">``
(pytest's xfail), not a failure; an unexpected pass is a passing testcase whose ``system-out``
says so, as does one whose far run could not run. Characters XML 1.0 cannot hold (ANSI escapes, other control characters) are removed
from every attribute and text.
"""
from __future__ import annotations

import json
import os
import platform
import re
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from dsv4.conformance.runner import SuiteResult, expectation, far_not_run, first_failure
from dsv4.plugin_status import PluginStatus

__all__ = [
    "REPORT_SCHEMA",
    "SCHEMA_PATH",
    "build_report",
    "environment",
    "expectation_counts",
    "junit_xml",
    "validate_report",
    "write_json",
    "write_junit",
    "xml_safe",
]

REPORT_SCHEMA = "dsv4-conformance-report/1"
SCHEMA_PATH = Path(__file__).parent / "report_schema.json"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment(device: str = "cpu") -> dict[str, Any]:
    """Versions, device and the DSV4_* switches (every probe guarded: a report must always come out)."""
    env: dict[str, Any] = {
        "python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
        "dsv4": _version("dsv4-attention"), "triton": _version("triton"), "device": device,
        "device_name": None, "cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("DSV4_")},
    }
    try:
        if device.startswith("cuda") and torch.cuda.is_available():
            env["device_name"] = torch.cuda.get_device_name(torch.device(device))
        else:
            env["device_name"] = platform.processor() or platform.machine()
    except Exception as exc:  # noqa: BLE001
        env["device_name"] = f"unknown ({type(exc).__name__})"
    try:
        from dsv4.conformance.golden import GoldenStore

        store = GoldenStore()
        env["golden"] = None if store.manifest is None else {
            "generator_version": store.manifest.get("generator_version"),
            "files": {k: v["sha256"] for k, v in store.manifest["files"].items()}}
    except Exception as exc:  # noqa: BLE001
        env["golden"] = f"unreadable: {exc}"
    return env


def expectation_counts(rows: Iterable[Any]) -> dict[str, int]:
    """``expected_failures`` (failed within their entry) and ``unexpected_passes`` (XPASS) of result rows."""
    rows = [r if isinstance(r, dict) else r.as_dict() for r in rows]
    return {"expected_failures": sum(1 for r in rows if _is_xfail(r)),
            "unexpected_passes": sum(1 for r in rows if _is_xpass(r))}


def _is_xfail(row: dict[str, Any]) -> bool:
    return expectation(row["outcome"], row.get("expected_failure")) == "xfail"


def _is_xpass(row: dict[str, Any]) -> bool:
    return expectation(row["outcome"], row.get("expected_failure")) == "xpass"


def build_report(result: SuiteResult, plugins: Sequence[Any] | None = None) -> dict[str, Any]:
    """The JSON report of ``result`` (a plain dict, ready for ``json.dumps``); ``plugins``: the registry's
    ``PluginStatus`` list, reported as ``plugins`` (each entry point, failed and refused ones included)."""
    counts = result.counts()
    rows = [row.as_dict() for row in result.rows]
    for row in rows:
        row["unexpected_pass"] = _is_xpass(row)
    report = {
        "schema": REPORT_SCHEMA,
        "environment": environment(result.device),
        "backends": result.backends,
        "results": rows,
        "summary": {**counts, "total": len(result.rows), "passed_all": result.passed, **expectation_counts(rows),
                    "far_not_run": sum(bool(far_not_run(row["metrics"])) for row in rows)},
    }
    if plugins is not None:
        report["plugins"] = [p.as_dict() for p in plugins]
    return report


def validate_report(report: dict[str, Any]) -> None:
    """Validate against ``report_schema.json`` (raises ``jsonschema.ValidationError``)."""
    import jsonschema

    jsonschema.validate(report, json.loads(SCHEMA_PATH.read_text()))


def write_json(report: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=1, default=str) + "\n")


# XML 1.0 allows tab, newline, carriage return and U+0020 upwards, less surrogates and U+FFFE/U+FFFF.
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")
_NOT_XML = re.compile("[^\t\n\r\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def xml_safe(text: Any) -> str:
    """``text`` with ANSI colour codes removed and other XML-1.0-invalid characters written ``\\xNN``."""
    text = _ANSI_ESCAPE.sub("", str(text))
    return _NOT_XML.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                        else f"\\u{ord(m.group()):04x}", text)


def _element(parent: ET.Element, tag: str, text: str | None = None, **attributes: Any) -> ET.Element:
    element = ET.SubElement(parent, tag, {k: xml_safe(v) for k, v in attributes.items()})
    if text is not None:
        element.text = xml_safe(text)
    return element


def junit_xml(report: dict[str, Any]) -> str:
    """JUnit XML derived from the JSON report: one testsuite per backend, one testcase per row."""
    root = ET.Element("testsuites", name="dsv4-conformance")
    by_backend: dict[str, list[dict[str, Any]]] = {}
    for row in report["results"]:
        by_backend.setdefault(row["backend"], []).append(row)
    for backend, rows in by_backend.items():
        failures = sum(r["outcome"] == "failed" and not _is_xfail(r) for r in rows)
        errors = sum(r["outcome"] == "error" and not _is_xfail(r) for r in rows)
        skipped = sum(r["outcome"] in ("skipped", "unsupported") or _is_xfail(r) for r in rows)
        suite = _element(root, "testsuite", name=backend, tests=len(rows), failures=failures, errors=errors,
                         skipped=skipped, time=f"{sum(r['seconds'] for r in rows):.6f}")
        props = _element(suite, "properties")
        info = report["backends"].get(backend, {})
        _element(props, "property", name="status", value=info.get("status", ""))
        for dist, version in (info.get("package_versions") or {}).items():
            _element(props, "property", name=f"version.{dist}", value=version)
        for row in rows:
            _testcase(suite, backend, row)
    failed = [p for p in report.get("plugins", ()) if p["state"] == "failed"]
    if failed:  # a plugin that registered nothing has no rows: said here, or CI never sees it
        suite = _element(root, "testsuite", name="dsv4.plugins", tests=len(failed), failures=0, errors=0,
                         skipped=len(failed), time="0")
        for plugin in failed:
            case = _element(suite, "testcase", classname="dsv4.plugins", name=plugin["name"], time="0")
            _element(case, "skipped", message=PluginStatus.from_dict(plugin).problem()[:1000])
    return ET.tostring(root, encoding="unicode", xml_declaration=True)


def _testcase(suite: ET.Element, backend: str, row: dict[str, Any]) -> None:
    case = _element(suite, "testcase", classname=f"dsv4.{backend}.{row['op']}", name=row["case"],
                    time=f"{row['seconds']:.6f}")
    message = _message(row)
    if _is_xfail(row):
        _element(case, "skipped", message=f"expected failure: {row['expected_failure']}"
                 + (f"; {row['outcome']}: {message}" if message else ""))
    elif _is_xpass(row):
        _element(case, "system-out", f"unexpected pass (XPASS): listed as an expected failure: "
                                     f"{row['expected_failure']}")
    elif row["outcome"] == "failed":
        _element(case, "failure", json.dumps(row["metrics"], indent=1, default=str), message=message,
                 type="numerics")
    elif row["outcome"] == "error":
        _element(case, "error", "\n".join(row["reasons"]), message=message, type="exception")
    elif row["outcome"] in ("skipped", "unsupported"):
        _element(case, "skipped", message=f"{row['outcome']}: {message}")
    if row["outcome"] == "passed" and far_not_run(row["metrics"]):
        _element(case, "system-out", far_not_run(row["metrics"]))


def _message(row: dict[str, Any]) -> str:
    if row["outcome"] in ("error", "skipped", "unsupported"):
        return "; ".join(row["reasons"][:1])[:500]
    return first_failure(row["op"], row["metrics"])


def write_junit(report: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(junit_xml(report))
