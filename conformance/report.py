"""Conformance reports: the JSON document is primary; JUnit XML is derived from it.

JSON (schema: ``report_schema.json``, ``"schema": "dsv4-conformance-report/1"``): top-level
``environment`` (versions, device, env switches), ``backends`` (name -> status, reasons, package
versions, plugin, capabilities; plugins that failed to load appear with status ``failed``),
``results`` (rows: ``backend``, ``op``, ``case``, ``outcome``, ``metrics`` per output,
``seconds``, ``reasons``, ``expected_failure``, ``expected_source``, ``params``), ``summary``
(counts per outcome and ``passed``).
"""
from __future__ import annotations

import json
import os
import platform
import sys
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from dsv4.conformance.runner import SuiteResult

__all__ = [
    "REPORT_SCHEMA",
    "SCHEMA_PATH",
    "build_report",
    "environment",
    "junit_xml",
    "validate_report",
    "write_json",
    "write_junit",
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


def build_report(result: SuiteResult) -> dict[str, Any]:
    """The JSON report of ``result`` (a plain dict, ready for ``json.dumps``)."""
    counts = result.counts()
    return {
        "schema": REPORT_SCHEMA,
        "environment": environment(result.device),
        "backends": result.backends,
        "results": [row.as_dict() for row in result.rows],
        "summary": {**counts, "total": len(result.rows), "passed_all": result.passed,
                    "expected_failures": sum(1 for r in result.rows if r.expected_failure)},
    }


def validate_report(report: dict[str, Any]) -> None:
    """Validate against ``report_schema.json`` (raises ``jsonschema.ValidationError``)."""
    import jsonschema

    jsonschema.validate(report, json.loads(SCHEMA_PATH.read_text()))


def write_json(report: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=1, default=str) + "\n")


def junit_xml(report: dict[str, Any]) -> str:
    """JUnit XML derived from the JSON report: one testsuite per backend, one testcase per row."""
    root = ET.Element("testsuites", name="dsv4-conformance")
    by_backend: dict[str, list[dict[str, Any]]] = {}
    for row in report["results"]:
        by_backend.setdefault(row["backend"], []).append(row)
    for backend, rows in by_backend.items():
        failures = sum(r["outcome"] == "failed" for r in rows)
        errors = sum(r["outcome"] == "error" for r in rows)
        skipped = sum(r["outcome"] in ("skipped", "unsupported") for r in rows)
        suite = ET.SubElement(root, "testsuite", name=backend, tests=str(len(rows)), failures=str(failures),
                              errors=str(errors), skipped=str(skipped),
                              time=f"{sum(r['seconds'] for r in rows):.6f}")
        props = ET.SubElement(suite, "properties")
        info = report["backends"].get(backend, {})
        ET.SubElement(props, "property", name="status", value=str(info.get("status", "")))
        for dist, version in (info.get("package_versions") or {}).items():
            ET.SubElement(props, "property", name=f"version.{dist}", value=str(version))
        for row in rows:
            case = ET.SubElement(suite, "testcase", classname=f"dsv4.{backend}.{row['op']}", name=row["case"],
                                 time=f"{row['seconds']:.6f}")
            message = _message(row)
            if row["outcome"] == "failed":
                ET.SubElement(case, "failure", message=message, type="numerics").text = \
                    json.dumps(row["metrics"], indent=1, default=str)
            elif row["outcome"] == "error":
                ET.SubElement(case, "error", message=message, type="exception").text = "\n".join(row["reasons"])
            elif row["outcome"] in ("skipped", "unsupported"):
                ET.SubElement(case, "skipped", message=f"{row['outcome']}: {message}")
    return ET.tostring(root, encoding="unicode", xml_declaration=True)


def _message(row: dict[str, Any]) -> str:
    if row["outcome"] in ("error", "skipped", "unsupported"):
        return "; ".join(row["reasons"][:1])[:500]
    bad = [(k, m) for k, m in row["metrics"].items() if isinstance(m, dict) and m.get("passed") is False]
    if not bad:
        return ""
    name, m = bad[0]
    where = m.get("max_abs_where") or m.get("first_fail_where") or m.get("first_byte_where")
    return f"{row['op']}.{name}: {m.get('reason', 'failed')} (max abs err {m.get('max_abs_err')} at {where})"


def write_junit(report: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(junit_xml(report))
