"""Registry: guarded plugin loading, strict mode, entry points of an out-of-tree plugin, selection order."""
from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import pytest
import torch
from dsv4.backend import Backend, Capabilities, OpRequest
from dsv4.hookspecs import hookimpl
from dsv4.registry import PluginLoadError, Registry
from dsv4.specs.errors import NoBackendError

sys.path.insert(0, str(Path(__file__).parents[1] / "fixtures"))
import plugin_env


def _backend(name: str, **caps) -> Backend:
    cls = type(f"B_{name}", (Backend,), {"name": name, "capabilities": Capabilities(**caps)})
    return cls()


def test_capabilities_name_every_refusal():
    caps = Capabilities(ops=frozenset({"sparse_attention"}), device_types=frozenset({"cuda"}), arch_range=(100, 103),
                        kv_formats=frozenset({"bf16"}), q_head_counts=frozenset({64, 128}), topk_alignment=64,
                        supports_sink=False, profiles=frozenset({"vllm"}))
    request = OpRequest("sparse_attention", device_type="cuda", arch="sm_90", dtype=torch.bfloat16,
                        kv_format="fp8_ds_mla", heads=8, topk=96, profile="deepseek", has_sink=True)
    text = " | ".join(caps.reasons(request))
    for fragment in ("sm_100..sm_103, found sm_90", "kv_format bf16, found fp8_ds_mla", "q heads in 128, 64",
                     "multiple of 64, found 96", "attention sink", "profile vllm, found deepseek"):
        assert fragment in text
    assert caps.reasons(OpRequest("sparse_attention", device_type="cuda", arch="sm_100", kv_format="bf16",
                                  heads=64, topk=128, profile="vllm")) == []
    assert "does not implement op indexer_q" in caps.reasons(OpRequest("indexer_q", device_type="cuda"))[0]


def test_selection_explicit_then_env_then_priority(monkeypatch):
    registry = Registry()
    registry.register_backend(_backend("reference"))
    registry.register_backend(_backend("triton", device_types=frozenset({"cuda"})))
    registry.register_backend(_backend("zz-third-party"))
    request = OpRequest("output_projection", device_type="cpu")
    monkeypatch.delenv("DSV4_BACKEND", raising=False)
    assert registry.select(request).name == "reference"  # CPU priority: reference first
    assert registry.select(request, "zz-third-party").name == "zz-third-party"
    monkeypatch.setenv("DSV4_BACKEND", "zz-third-party")
    assert registry.select(request).name == "zz-third-party"
    assert registry.select(request, "reference").name == "reference"  # the argument beats the env
    monkeypatch.setenv("DSV4_BACKEND", "triton")  # forced and unfit: an error, never a fallback
    with pytest.raises(NoBackendError, match="DSV4_BACKEND: backend triton cannot run .*needs device type cuda"):
        registry.select(request)
    with pytest.raises(NoBackendError, match="expected one of reference, triton, zz-third-party"):
        registry.select(request, "nope")


def test_no_backend_error_lists_every_candidate(monkeypatch):
    monkeypatch.delenv("DSV4_BACKEND", raising=False)
    registry = Registry()
    registry.register_backend(_backend("reference", kv_formats=frozenset({"bf16"})))
    registry.register_backend(_backend("flashmla", device_types=frozenset({"cuda"})))
    broken = _backend("aiter")
    broken.probe = lambda: ["aiter not importable: ModuleNotFoundError"]
    registry.register_backend(broken)
    with pytest.raises(NoBackendError) as info:
        registry.select(OpRequest("sparse_attention", kv_format="fp8_ds_mla"))
    message = str(info.value)
    assert "reference: needs kv_format bf16, found fp8_ds_mla" in message
    assert "flashmla: needs device type cuda, found cpu" in message
    assert "aiter: aiter not importable" in message


def test_hook_that_raises_is_recorded_and_rolled_back():
    registry = Registry()

    plugin = types.ModuleType("half_plugin")

    @hookimpl
    def dsv4_register_backends(register):
        register(_backend("half-a"))
        raise RuntimeError("boom after one backend")

    plugin.dsv4_register_backends = dsv4_register_backends
    status = registry.load_plugin(plugin, "half", strict=False)
    assert status.state == "failed" and "RuntimeError: boom after one backend" in status.error
    assert "half-a" not in registry.backend_names()  # partial registration rolled back
    with pytest.raises(PluginLoadError, match="plugin half"):
        Registry().load_plugin(plugin, "half", strict=True)


def test_unknown_names_point_at_plugins_that_failed_to_load(monkeypatch):
    """Registry.get and the layer's backend names give the same hint: the plugins that failed to load."""
    import dsv4.layer_checks
    from dsv4 import Attention, ModelConfig
    from dsv4.specs.errors import DSV4ValueError, NoBackendError

    registry = Registry()
    registry.register_backend(_backend("reference"))
    plugin = types.ModuleType("broken_plugin")
    plugin.dsv4_register_backends = hookimpl(lambda register: (_ for _ in ()).throw(ImportError("no vendor lib")))
    assert registry.load_plugin(plugin, "vendorx", strict=False).state == "failed"
    assert registry.failed_plugins_hint() == "plugins that failed to load: vendorx"
    with pytest.raises(NoBackendError, match="got vendorx; plugins that failed to load: vendorx"):
        registry.get("vendorx")
    monkeypatch.setattr(dsv4.layer_checks, "get_registry", lambda: registry)
    with pytest.raises(DSV4ValueError, match=r"backends\['sparse_attention'\].*plugins that failed to load: vendorx"):
        Attention(ModelConfig.preset("tiny"), 0, backends={"sparse_attention": "vendorx"})
    assert Registry().failed_plugins_hint() == ""


def test_duplicate_name_fails_the_second_plugin():
    registry = Registry()
    registry.register_backend(_backend("reference"))
    plugin = types.ModuleType("dup_plugin")
    plugin.dsv4_register_backends = hookimpl(lambda register: register(_backend("reference")))
    status = registry.load_plugin(plugin, "dup", strict=False)
    assert status.state == "failed" and "already registered" in status.error


@pytest.fixture
def fixture_plugins(tmp_path, monkeypatch):
    target = plugin_env.install(tmp_path, "dsv4_fixture_plugin", "dsv4_broken_plugin")
    monkeypatch.syspath_prepend(str(target))
    importlib.invalidate_caches()
    yield target
    for name in ("dsv4_fixture_plugin", "dsv4_broken_plugin"):
        sys.modules.pop(name, None)


def test_out_of_tree_plugin_registers_through_its_entry_point(fixture_plugins, monkeypatch):
    monkeypatch.delenv("DSV4_STRICT_PLUGINS", raising=False)
    registry = Registry()
    statuses = {s.name: s for s in registry.load_entry_points()}
    echo = statuses["fixture-echo"]
    assert echo.state == "loaded" and echo.backends == ["fixture-echo"]
    assert echo.distribution == "dsv4-fixture-plugin" and echo.version == "0.1.0"
    assert registry.get("fixture-echo").capabilities.ops == frozenset({"output_projection"})
    broken = statuses["fixture-broken"]
    assert broken.state == "failed" and "simulated import failure" in broken.error
    assert statuses["reference"].state == "loaded" and "reference" in registry.backend_names()


def test_strict_plugins_env_turns_a_load_failure_into_an_error(fixture_plugins, monkeypatch):
    monkeypatch.setenv("DSV4_STRICT_PLUGINS", "1")
    with pytest.raises(PluginLoadError, match="fixture-broken .*simulated import failure"):
        Registry().load_entry_points()


def test_allow_list_blocks_other_plugins(fixture_plugins, monkeypatch):
    monkeypatch.setenv("DSV4_PLUGINS", "reference")
    registry = Registry()
    statuses = {s.name: s.state for s in registry.load_entry_points()}
    assert statuses["reference"] == "loaded" and statuses["fixture-broken"] == "blocked"
    assert registry.backend_names() == ["reference"]


def test_an_instance_sharing_a_registered_name_is_asked_itself():
    """A tuned copy or subclass that is not the registered object answers for itself: one that refuses the
    request is refused, one that accepts it is returned (not the registered backend of that name)."""
    reg = Registry()
    registered = _backend("x", ops=frozenset({"indexer_q"}))
    reg.register_backend(registered)
    request = OpRequest("indexer_q", device_type="cpu")
    cuda_only = type("CudaOnly", (Backend,), {"name": "x", "capabilities": Capabilities(
        ops=frozenset({"indexer_q"}), device_types=frozenset({"cuda"}))})()
    with pytest.raises(NoBackendError, match="backend x cannot run .*needs device type cuda"):
        reg.select(request, cuda_only)
    twin = type("Twin", (Backend,), {"name": "x", "capabilities": Capabilities(ops=frozenset({"indexer_q"}))})()
    assert reg.select(request, twin) is twin and reg.select(request, registered) is registered


def test_an_unknown_dsv4_backend_is_named(monkeypatch):
    reg = Registry()
    reg.register_backend(_backend("x", ops=frozenset({"indexer_q"})))
    monkeypatch.setenv("DSV4_BACKEND", "bogus")
    with pytest.raises(NoBackendError, match="DSV4_BACKEND: expected auto or one of x, got bogus"):
        reg.select(OpRequest("indexer_q", device_type="cpu"))


def test_record_selections_is_per_thread():
    """Two overlapping blocks in two threads each see their own calls and leave recording off at the end."""
    import threading

    from dsv4.ops.dispatch import record, record_selections, recording

    inside, release, seen = threading.Event(), threading.Event(), {}

    def other():
        with record_selections() as mine:
            inside.set()
            release.wait(5)
            record("indexer_q", _backend("b"))
        seen["other"] = mine

    thread = threading.Thread(target=other)
    with record_selections() as used:
        thread.start()
        inside.wait(5)
        record("indexer_q", _backend("a"))
    release.set()
    thread.join(5)
    assert used == {"indexer_q": {"a"}} and seen["other"] == {"indexer_q": {"b"}}
    assert not recording()
