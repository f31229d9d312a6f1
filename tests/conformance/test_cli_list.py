"""dsv4-conformance and plugins: ``list`` shows every plugin with its load time and, for one that registered
nothing, why (import error, refusal); ``run`` says the same under its table, in the JSON report and in JUnit;
``--backend`` naming a plugin that failed is a usage error (exit 2) that gives the plugin's reason."""
from __future__ import annotations

import importlib
import json
import sys
import warnings
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from _cli_helpers import one_line_error
from dsv4 import registry as registry_module
from dsv4.conformance import cli
from dsv4.conformance.cli import main
from dsv4.conformance.report import validate_report
from dsv4.registry import Registry

sys.path.insert(0, str(Path(__file__).parents[1] / "fixtures"))
import plugin_env

PACKAGES = ("dsv4_fixture_plugin", "dsv4_broken_plugin", "dsv4_shadow_plugin")
SHADOW_REFUSED = ("PluginRefusedError: backend name triton belongs to the built-in plugin triton (dsv4-attention "
                  "0.1.0); plugin aaa-shadow (dsv4-shadow-plugin 0.1.0) may not register it: give the backend its "
                  "own name")
# PluginStatus.problem: the plugin, its entry point's value and distribution, then the error
SHADOW_LINE = f"plugin aaa-shadow (dsv4_shadow_plugin from dsv4-shadow-plugin 0.1.0) failed to load: {SHADOW_REFUSED}"
BROKEN_LINE = "plugin fixture-broken (dsv4_broken_plugin from dsv4-broken-plugin 0.1.0) failed to load: ImportError: "


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """The installed plugins plus the three fixtures (echo importing 0.3 s, broken, shadow of ``triton``),
    loaded into a registry the CLI uses; SLOW_PLUGIN_SECONDS 0.25, so echo counts as slow."""
    monkeypatch.syspath_prepend(str(plugin_env.install(tmp_path, *PACKAGES)))
    importlib.invalidate_caches()
    for name in ("DSV4_STRICT_PLUGINS", "DSV4_PLUGINS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DSV4_FIXTURE_IMPORT_SLEEP", "0.3")
    monkeypatch.setattr(registry_module, "SLOW_PLUGIN_SECONDS", 0.25)
    registry = Registry()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fixture-echo is slow: tests/core/test_registry.py checks the warning
        registry.load_entry_points()
    monkeypatch.setattr(cli, "_registry", lambda: registry)
    yield registry
    for name in PACKAGES:
        sys.modules.pop(name, None)


def test_list_shows_every_plugin_its_load_time_and_why_one_registered_nothing(plugins, capsys):
    assert main(["list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    by_name = {p["name"]: p for p in listed["plugins"]}
    assert by_name["aaa-shadow"]["state"] == "failed" and by_name["aaa-shadow"]["error"] == SHADOW_REFUSED
    assert "simulated import failure" in by_name["fixture-broken"]["error"]
    assert by_name["fixture-echo"]["load_seconds"] >= 0.3 and not by_name["fixture-echo"]["builtin"]
    assert by_name["triton"]["builtin"] and by_name["triton"]["load_seconds"] < 0.25
    assert listed["backends"]["triton"]["plugin"] == "triton"  # the built-in kept its name
    assert listed["backends"]["aaa-shadow"]["status"] == "failed"
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "dsv4 plugins" in out and "load s" in out
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") > 5}
    assert "PluginRefusedError: backend name triton belongs to" in rows["aaa-shadow"]
    assert "(slow)" in rows["fixture-echo"] and "(slow)" not in rows["reference"]
    assert "dsv4-attention 0.1.0 (built-in)" in rows["triton"]


def test_run_says_which_plugins_failed_under_the_table_and_in_both_reports(plugins, tmp_path, capsys):
    """``run --backend triton`` runs the built-in Triton backend, not the shadow, and says the shadow was refused."""
    report_path, junit_path = tmp_path / "r.json", tmp_path / "r.xml"
    assert main(["run", "--backend", "triton", "--op", "output_projection", "-k", "swa and bf16", "--near-only",
                 "--json", str(report_path), "--junit", str(junit_path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert SHADOW_LINE in out and BROKEN_LINE in out
    report = json.loads(report_path.read_text())
    validate_report(report)
    assert report["backends"]["triton"]["plugin"] == "triton"
    assert {p["name"]: p["error"] for p in report["plugins"]}["aaa-shadow"] == SHADOW_REFUSED
    suite = ET.parse(junit_path).getroot().find("testsuite[@name='dsv4.plugins']")
    skipped = {case.get("name"): case.find("skipped").get("message") for case in suite}
    assert set(skipped) == {"aaa-shadow", "fixture-broken"} and skipped["aaa-shadow"] == SHADOW_LINE
    assert skipped["fixture-broken"].startswith(BROKEN_LINE)


@pytest.mark.parametrize(("name", "reason"), [
    ("fixture-broken", f"{BROKEN_LINE}dsv4_broken_plugin: simulated import failure"),
    ("aaa-shadow", SHADOW_LINE)],
    ids=["import-error", "refused"])
def test_a_backend_whose_plugin_failed_is_a_usage_error_with_the_reason(plugins, capsys, name, reason):
    """Exit 2, like any unknown backend (README), and the plugin's own reason instead of only its name."""
    assert main(["run", "--backend", name, "--op", "output_projection"]) == 2
    one_line_error(capsys, "--backend: expected one of", f"got '{name}'", reason)
    assert main(["run", "--backend", "nope", "--op", "output_projection"]) == 2
    one_line_error(capsys, "got 'nope'; plugins that failed to load: aaa-shadow (PluginRefusedError",
                   "fixture-broken (ImportError: dsv4_broken_plugin: simulated import failure)")
