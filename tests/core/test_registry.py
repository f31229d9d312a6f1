"""Registry: guarded plugin loading, strict mode, entry points of an out-of-tree plugin, selection order, the names
and ops a foreign plugin may not claim, plugin load times."""
from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import pytest
import torch
from dsv4 import registry as registry_module
from dsv4.backend import OP_NAMES, Backend, Capabilities, OpRequest
from dsv4.hookspecs import hookimpl
from dsv4.registry import PluginLoadError, Registry
from dsv4.specs.errors import BackendUnavailableError, NoBackendError

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
    registry.register_backend(_backend("zz-third-party", device_types=frozenset({"hpu"})))
    request = OpRequest("output_projection", device_type="cpu")
    monkeypatch.delenv("DSV4_BACKEND", raising=False)
    assert registry.select(request).name == "reference"  # the out-of-tree backend cannot run on CPU
    assert registry.select(request, "reference").name == "reference"
    monkeypatch.setenv("DSV4_BACKEND", "reference")
    assert registry.select(request).name == "reference"
    with pytest.raises(NoBackendError, match="argument backend: backend zz-third-party cannot run"):
        registry.select(request, "zz-third-party")  # the argument beats the env, and is never a fallback
    monkeypatch.setenv("DSV4_BACKEND", "triton")  # forced and unfit: an error, never a fallback
    with pytest.raises(NoBackendError, match="DSV4_BACKEND: backend triton cannot run .*needs device type cuda"):
        registry.select(request)
    with pytest.raises(NoBackendError, match="expected one of reference, triton, zz-third-party"):
        registry.select(request, "nope")


def test_out_of_tree_backends_come_before_the_reference_after_the_built_in_priority(monkeypatch):
    """The reference is the last resort: a fitting out-of-tree backend is chosen before it (on a platform only
    the vendor knows too), after the platform's built-in list; one that does not fit falls through."""
    monkeypatch.delenv("DSV4_BACKEND", raising=False)
    registry = Registry()
    for name in ("reference", "flashmla", "aiter"):
        registry.register_backend(_backend(name, device_types=frozenset({"cpu"} if name == "reference" else {"x"})))
    registry.register_backend(_backend("vendor-b", device_types=frozenset({"cpu", "hpu"})))
    registry.register_backend(_backend("vendor-a", device_types=frozenset({"cuda"})))
    assert registry.priority("cuda") == ["flashmla", "vendor-a", "vendor-b", "reference", "aiter"]
    assert registry.priority("cpu") == ["vendor-a", "vendor-b", "reference", "aiter", "flashmla"]
    assert registry.priority("hpu") == ["vendor-a", "vendor-b", "reference", "aiter", "flashmla"]
    assert registry.select(OpRequest("indexer_q", device_type="cpu")).name == "vendor-b"
    assert registry.select(OpRequest("indexer_q", device_type="hpu")).name == "vendor-b"
    registry.unregister_backend("vendor-b")
    assert registry.select(OpRequest("indexer_q", device_type="cpu")).name == "reference"


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
        register(_backend("half-a", ops=frozenset()))
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
    assert registry.failed_plugins_hint() == "plugins that failed to load: vendorx (ImportError: no vendor lib)"
    with pytest.raises(NoBackendError, match=r"got vendorx; plugins that failed to load: vendorx \(ImportError"):
        registry.get("vendorx")
    monkeypatch.setattr(dsv4.layer_checks, "get_registry", lambda: registry)
    with pytest.raises(DSV4ValueError, match=r"backends\['sparse_attention'\].*plugins that failed to load: vendorx"):
        Attention(ModelConfig.preset("tiny"), 0, backends={"sparse_attention": "vendorx"})
    assert Registry().failed_plugins_hint() == ""


def _plugin(*backends: Backend) -> types.ModuleType:
    plugin = types.ModuleType("a_plugin")
    plugin.dsv4_register_backends = hookimpl(lambda register: [register(b) for b in backends])
    return plugin


def test_duplicate_name_fails_the_second_plugin():
    registry = Registry()
    registry.register_backend(_backend("vendor", ops=frozenset()))
    status = registry.load_plugin(_plugin(_backend("vendor", ops=frozenset())), "dup", strict=False)
    assert status.state == "failed" and status.backends == []
    assert "backend name vendor is already registered by plugin <direct>; plugin dup may not" in status.error


class _CountingDict(dict):
    """A dict that counts membership tests (the registry's name checks)."""

    contains = 0

    def __contains__(self, key):
        type(self).contains += 1
        return super().__contains__(key)


def test_each_backend_is_checked_once_per_registration(monkeypatch):
    """A plugin's backend and a direct one each pass ``_check_instance`` and the name check once (the plugin
    path ran both twice)."""
    checked = []
    original = registry_module._check_instance
    monkeypatch.setattr(registry_module, "_check_instance", lambda b: (checked.append(b.name), original(b)))
    registry = Registry()
    registry._backends = _CountingDict()
    monkeypatch.setattr(_CountingDict, "contains", 0)
    status = registry.load_plugin(_plugin(_backend("one", ops=frozenset()), _backend("two", ops=frozenset())),
                                  "acme", strict=False)
    assert status.state == "loaded" and status.backends == ["one", "two"]
    assert checked == ["one", "two"] and _CountingDict.contains == 2
    registry.register_backend(_backend("three", ops=frozenset()))
    assert checked == ["one", "two", "three"] and _CountingDict.contains == 3


def test_what_is_not_a_named_backend_instance_or_a_taken_name_is_refused_by_both_paths():
    """The messages of the instance and name checks, through a plugin and directly."""
    named = _backend("", ops=frozenset())
    for bad, expected in ((type(named), "expected a dsv4.backend.Backend instance"), (object(), "Backend instance"),
                          (named, "backend.name: expected a non-empty name")):
        with pytest.raises(BackendUnavailableError, match=expected):
            Registry().register_backend(bad)
        status = Registry().load_plugin(_plugin(bad), "acme", strict=False)
        assert status.state == "failed" and expected in status.error, status.error
    registry = Registry()
    registry.load_plugin(_plugin(_backend("vendor", ops=frozenset())), "acme", strict=False)
    with pytest.raises(BackendUnavailableError, match="expected a name not registered yet, got vendor.*by plugin acme"):
        registry.register_backend(_backend("vendor", ops=frozenset()))


def test_a_foreign_plugin_may_not_take_a_built_in_name_even_before_the_built_in_loads():
    """``reference`` belongs to the built-in plugins whatever the order: the plugin is refused whole, in one line."""
    registry = Registry()
    status = registry.load_plugin(_plugin(_backend("mine", ops=frozenset()), _backend("reference", ops=frozenset())),
                                  "acme", strict=False)
    assert status.state == "failed" and registry.backend_names() == []  # "mine" rolled back too
    assert status.error == ("PluginRefusedError: backend name reference belongs to a built-in backend of "
                            "dsv4-attention; plugin acme may not register it: give the backend its own name")
    with pytest.raises(PluginLoadError, match="plugin acme .*belongs to a built-in backend"):
        Registry().load_plugin(_plugin(_backend("triton", ops=frozenset())), "acme", strict=True)


def test_a_plugin_backend_claiming_ops_it_does_not_implement_is_refused():
    """Capabilities' default ``ops`` is all six: a plugin's backend that overrides two is refused, naming the
    four others and the fix; a typo in ``ops`` is refused too. A consistent backend loads."""

    class TwoOps(Backend):
        name = "two-ops"
        capabilities = Capabilities()  # forgot ops=

        def sparse_attention(self, *args, **kwargs):
            raise NotImplementedError

        def qnorm_rope_insert(self, *args, **kwargs):
            raise NotImplementedError

    status = Registry().load_plugin(_plugin(TwoOps()), "acme", strict=False)
    assert status.state == "failed"
    assert ("backend two-ops of plugin acme lists compress_insert, indexer_q, indexer_topk, output_projection in "
            "capabilities.ops but TwoOps does not implement (override) them: pass Capabilities(ops=frozenset({...}))"
            ) in status.error
    typo = type("Typo", (TwoOps,), {"name": "typo", "capabilities": Capabilities(ops=frozenset({"sparse_atention"}))})
    assert "lists sparse_atention in capabilities.ops" in Registry().load_plugin(_plugin(typo()), "t").error
    fixed = type("Fixed", (TwoOps,), {"name": "fixed", "capabilities": Capabilities(
        ops=frozenset({"sparse_attention", "qnorm_rope_insert"}))})
    assert Registry().load_plugin(_plugin(fixed()), "f").state == "loaded"


def test_calling_a_declared_op_that_is_not_overridden_says_so():
    """A directly registered backend is not checked at registration; its call says what is wrong (the old
    message listed the op it received among the ones it expected)."""
    backend = _backend("direct")  # claims all six, overrides none
    with pytest.raises(BackendUnavailableError) as info:
        backend.compress_insert(*[None] * 11, ratio=4, head_dim=512, out_format="bf16", profile="deepseek", eps=1e-6)
    message = str(info.value)
    assert message == ("op: backend direct declares compress_insert in capabilities.ops but B_direct does not "
                       "override Backend.compress_insert: implement it, or pass Capabilities(ops=...) with only "
                       "the ops it implements (the default is all six)")
    assert backend.unimplemented_ops() == sorted(OP_NAMES)
    with pytest.raises(BackendUnavailableError, match="expected one of none, got indexer_q; backend none does not"):
        _backend("none", ops=frozenset()).indexer_q(None, None, None, None, profile="deepseek")


FIXTURE_PACKAGES = ("dsv4_fixture_plugin", "dsv4_broken_plugin", "dsv4_shadow_plugin")


@pytest.fixture
def fixture_plugins(tmp_path, monkeypatch):
    target = plugin_env.install(tmp_path, "dsv4_fixture_plugin", "dsv4_broken_plugin")
    monkeypatch.syspath_prepend(str(target))
    importlib.invalidate_caches()
    yield target
    for name in FIXTURE_PACKAGES:
        sys.modules.pop(name, None)


@pytest.fixture
def install_plugins(tmp_path, monkeypatch):
    """``install_plugins(*packages, entry=...)``: fixture packages on sys.path with their entry points."""

    def install(*names: str, entry: dict[str, str] | None = None) -> None:
        monkeypatch.syspath_prepend(str(plugin_env.install(tmp_path, *names, entry=entry)))
        importlib.invalidate_caches()

    monkeypatch.delenv("DSV4_STRICT_PLUGINS", raising=False)
    monkeypatch.delenv("DSV4_PLUGINS", raising=False)
    yield install
    for name in FIXTURE_PACKAGES:
        sys.modules.pop(name, None)


def test_a_built_in_keeps_its_name_whatever_the_load_order(install_plugins, monkeypatch):
    """Entry point ``aaa-shadow`` sorts before every built-in and registers ``triton``: the built-ins load first,
    the Triton plugin keeps its backend, and the foreign plugin is refused in one line naming both."""
    install_plugins("dsv4_shadow_plugin")
    registry = Registry()
    statuses = {s.name: s for s in registry.load_entry_points()}
    assert registry.origin("triton") == "triton" and type(registry.get("triton")).__name__ == "TritonBackend"
    assert statuses["triton"].state == "loaded" and statuses["triton"].builtin
    shadow = statuses["aaa-shadow"]
    assert shadow.state == "failed" and not shadow.builtin and shadow.backends == []
    assert shadow.error == ("PluginRefusedError: backend name triton belongs to the built-in plugin triton "
                            "(dsv4-attention 0.1.0); plugin aaa-shadow (dsv4-shadow-plugin 0.1.0) may not register "
                            "it: give the backend its own name")
    monkeypatch.setenv("DSV4_PLUGINS", "aaa-shadow")  # the built-in is blocked: its name is still its own
    registry = Registry()
    assert {s.name: s.state for s in registry.load_entry_points()}["aaa-shadow"] == "failed"
    assert "triton" not in registry.backend_names()
    monkeypatch.setenv("DSV4_STRICT_PLUGINS", "1")
    with pytest.raises(PluginLoadError, match="plugin aaa-shadow .*belongs to the built-in plugin triton"):
        Registry().load_entry_points()


def test_an_entry_point_named_like_a_built_in_one_is_refused(install_plugins):
    """A foreign distribution's entry point called ``triton`` (found first on sys.path) does not replace the
    built-in plugin of that name: it is refused, with a status of its own."""
    install_plugins("dsv4_shadow_plugin", entry={"dsv4_shadow_plugin": "triton"})
    registry = Registry()
    statuses = {s.name: s for s in registry.load_entry_points()}
    assert statuses["triton"].builtin and registry.origin("triton") == "triton"
    refused = statuses["dsv4-shadow-plugin:triton"]
    assert refused.state == "failed" and "entry point name triton is also triton (dsv4-attention" in refused.error


def test_a_clashing_entry_point_not_listed_in_dsv4_plugins_is_blocked_not_refused(install_plugins, monkeypatch):
    """DSV4_PLUGINS=reference blocks both ``triton`` entry points: the foreign one is not reported failed with
    "the built-in is loaded instead" (it is not), and strict mode does not raise over it."""
    install_plugins("dsv4_shadow_plugin", entry={"dsv4_shadow_plugin": "triton"})
    monkeypatch.setenv("DSV4_PLUGINS", "reference")
    statuses = {s.name: s for s in Registry().load_entry_points(strict=True)}
    assert statuses["dsv4-shadow-plugin:triton"].state == statuses["triton"].state == "blocked"
    assert statuses["dsv4-shadow-plugin:triton"].error == "not listed in DSV4_PLUGINS"
    monkeypatch.setenv("DSV4_PLUGINS", "reference,triton")
    with pytest.raises(PluginLoadError, match="entry point name triton is also triton"):
        Registry().load_entry_points(strict=True)


def test_each_plugin_load_is_timed_and_a_slow_one_is_warned_about(install_plugins, monkeypatch):
    """A plugin whose import sleeps 0.3 s: its load time is recorded (status, JSON), and past
    SLOW_PLUGIN_SECONDS one warning names it and the way out."""
    install_plugins("dsv4_fixture_plugin")
    monkeypatch.setenv("DSV4_FIXTURE_IMPORT_SLEEP", "0.3")
    monkeypatch.setattr(registry_module, "SLOW_PLUGIN_SECONDS", 0.25)
    with pytest.warns(UserWarning) as caught:
        statuses = {s.name: s for s in Registry().load_entry_points()}
    echo = statuses["fixture-echo"]
    assert 0.3 <= echo.seconds < 5 and echo.as_dict()["load_seconds"] == round(echo.seconds, 4)
    assert all(s.seconds is not None and s.seconds < 0.25 for s in statuses.values() if s.builtin)
    slow = [str(w.message) for w in caught if "to load" in str(w.message)]
    assert len(slow) == 1 and "plugin fixture-echo (dsv4-fixture-plugin 0.1.0) took 0.3 s to load" in slow[0]
    assert "DSV4_PLUGINS" in slow[0]


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
