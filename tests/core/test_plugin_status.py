"""PluginStatus (dsv4.plugin_status): the one line that says why a plugin registered nothing, the same in a
strict load's error, the no-backend error and the CLI (tests/conformance/test_cli_list.py)."""
from __future__ import annotations

import types

import pytest
from dsv4.backend import OpRequest
from dsv4.hookspecs import hookimpl
from dsv4.plugin_status import PluginStatus
from dsv4.registry import PluginLoadError, Registry
from dsv4.specs.errors import NoBackendError


def test_the_line_names_the_plugin_its_entry_point_its_distribution_and_why():
    failed = PluginStatus("acme", "acme_dsv4:hooks", "acme-dsv4", "0.1.0", "failed", "ImportError: no libacme")
    assert failed.problem() == ("plugin acme (acme_dsv4:hooks from acme-dsv4 0.1.0) failed to load: "
                                "ImportError: no libacme")
    blocked = PluginStatus("acme", "acme_dsv4:hooks", state="blocked", error="not listed in DSV4_PLUGINS")
    assert blocked.problem() == "plugin acme (acme_dsv4:hooks) is blocked: not listed in DSV4_PLUGINS"
    assert PluginStatus("bare", state="failed").problem() == "plugin bare failed to load: failed"


def test_from_dict_reads_back_what_as_dict_wrote():
    """A report's ``plugins`` entry (``as_dict``) turns back into the status (JUnit prints its ``problem()``)."""
    status = PluginStatus("acme", "acme_dsv4:hooks", "acme-dsv4", "0.1.0", "failed", "ImportError: no libacme",
                          backends=["acme"], builtin=True, seconds=0.125)
    record = status.as_dict()
    assert PluginStatus.from_dict(record) == status
    assert PluginStatus.from_dict(record).problem() == status.problem()
    assert PluginStatus.from_dict({"name": "bare"}) == PluginStatus("bare")


def test_a_strict_load_and_the_no_backend_error_give_the_same_line(monkeypatch):
    monkeypatch.delenv("DSV4_BACKEND", raising=False)
    plugin = types.ModuleType("vendorx_plugin")
    plugin.dsv4_register_backends = hookimpl(lambda register: (_ for _ in ()).throw(ImportError("no libvendorx")))
    line = "plugin vendorx (vendorx_plugin) failed to load: ImportError: no libvendorx"
    with pytest.raises(PluginLoadError) as strict:
        Registry().load_plugin(plugin, "vendorx", strict=True)
    assert line in str(strict.value)
    registry = Registry()
    assert registry.load_plugin(plugin, "vendorx", strict=False).problem() == line
    with pytest.raises(NoBackendError) as none_fits:
        registry.select(OpRequest("sparse_attention"))
    assert f"\n  {line}" in str(none_fits.value)  # the candidates' list said "plugin vendorx failed to load"
