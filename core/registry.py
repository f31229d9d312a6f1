"""Backend registry on pluggy: guarded per-plugin loading and per-op selection.

Loading (``Registry.load_entry_points``): every entry point of the ``dsv4.backends`` group is
loaded separately, the built-in plugins (this distribution's, :data:`BUILTIN_DISTRIBUTION`) first;
its status (``loaded`` with the backends it registered, ``failed`` with the exception or the
reason it was refused, ``blocked`` by ``DSV4_PLUGINS``) and its load time are recorded, so one
broken plugin never takes the host down (pluggy's own ``load_setuptools_entrypoints`` is
unguarded; we do not use it). A plugin that takes more than :data:`SLOW_PLUGIN_SECONDS` to load
is warned about: every process that uses dsv4 pays its import.

A plugin is refused (its status ``failed``, nothing of it registered) when it registers a backend
whose name belongs to a built-in plugin (:data:`BUILTIN_NAMES`, or a name a built-in registered:
the built-in keeps it whatever the load order), a name another plugin registered first, or a
backend whose ``capabilities.ops`` lists an op it does not implement. Direct
``register_backend`` calls (tests, embedding engines) are not checked so.

Environment:
    DSV4_STRICT_PLUGINS=1   a plugin that fails to load or is refused raises :class:`PluginLoadError` (CI).
    DSV4_PLUGINS=a,b        load only these entry points (the others are ``blocked``).
    DSV4_BACKEND=name       force a backend for every op (an unfit forced backend is an error,
                            never a silent fallback).
    DSV4_TRACE_PLUGINS=1    print every plugin's status and load time to stderr when the registry loads.

Every entry point is loaded on the registry's first use, also when the caller names a backend: one
registry per process, so name checks, failed-plugin hints and the strict switch never depend on
what was asked first (``DSV4_PLUGINS`` is the way to load fewer).

Selection (``Registry.select``), per op request: the explicit ``backend`` argument, then
``DSV4_BACKEND``, then the first backend that fits in ``Registry.priority(platform)``: the
platform's built-in list (:data:`PLATFORM_PRIORITIES`) with every out-of-tree backend (one no
built-in plugin registered), in name order, just before ``reference`` (the last resort), then the
built-ins not listed for the platform. When nothing fits, one ``NoBackendError`` lists every
candidate with its reasons.
"""
from __future__ import annotations

import functools
import itertools
import os
import sys
import threading
import time
import traceback
import warnings
from importlib import metadata
from typing import Any

import pluggy
from dsv4 import hookspecs
from dsv4.backend import Backend, OpRequest, one_line
from dsv4.hookspecs import ENTRY_POINT_GROUP, PROJECT_NAME
from dsv4.plugin_status import PluginStatus
from dsv4.specs.errors import BackendUnavailableError, NoBackendError

__all__ = [
    "BUILTIN_DISTRIBUTION",
    "BUILTIN_NAMES",
    "ENTRY_POINT_GROUP",
    "PLATFORM_PRIORITIES",
    "SLOW_PLUGIN_SECONDS",
    "PluginLoadError",
    "PluginRefusedError",
    "PluginStatus",
    "Registry",
    "get_backend",
    "get_registry",
    "reset_registry",
    "select",
]

# Platform -> backend names, best first (SPEC §11). On CPU the reference is the fast path: the
# Triton backend runs there only under the interpreter.
PLATFORM_PRIORITIES: dict[str, tuple[str, ...]] = {
    "cuda": ("flashmla", "flashinfer-sm100", "flashinfer-sm120", "triton", "reference"),
    "rocm": ("aiter", "triton", "reference"),
    "xpu": ("xpu", "triton", "reference"),
    "npu": ("ascend-dsa", "reference"),
    "cpu": ("reference", "triton"),
}

# The distribution whose entry points are the built-in plugins, and the backend names only they may
# register (a built-in plugin that failed to load keeps its names too: nothing foreign takes them).
BUILTIN_DISTRIBUTION = "dsv4-attention"
BUILTIN_NAMES: frozenset[str] = frozenset(name for names in PLATFORM_PRIORITIES.values() for name in names)

SLOW_PLUGIN_SECONDS = 1.0  # a plugin's import and registration; the hook should import no vendor package


class PluginLoadError(BackendUnavailableError):
    """A plugin failed to load while ``DSV4_STRICT_PLUGINS=1``."""


class PluginRefusedError(BackendUnavailableError):
    """A plugin registers what it may not: a built-in's or an already registered backend name, an entry point
    name of another distribution, a backend claiming ops it does not implement (the plugin's ``error``)."""


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _distribution(ep: metadata.EntryPoint) -> tuple[str | None, str | None]:
    dist = getattr(ep, "dist", None)
    return _name_and_version(dist) if dist is not None else (None, None)


# Keyed on the Distribution object (identity): entry_points() makes new ones each call, so this saves the
# repeats within one load (three or four look-ups an entry point); one METADATA parse a look-up
@functools.lru_cache(maxsize=256)
def _name_and_version(dist: metadata.Distribution) -> tuple[str | None, str | None]:
    meta = dist.metadata  # Distribution.version would parse it again
    return meta["Name"], meta["Version"]


def _is_builtin(ep: metadata.EntryPoint) -> bool:
    return _distribution(ep)[0] == BUILTIN_DISTRIBUTION


def _entry_points(group: str) -> tuple[list[metadata.EntryPoint], list[tuple[metadata.EntryPoint, metadata.EntryPoint]]]:
    """The group's entry points, built-in ones first, each part in name order; and ``(refused, kept)``
    pairs: a name two distributions define (the built-in's wins, else the first found)."""
    kept: dict[str, metadata.EntryPoint] = {}
    clashes = []
    for ep in metadata.entry_points(group=group):
        first = kept.get(ep.name)
        if first is None:
            kept[ep.name] = ep
        elif _distribution(first)[0] == _distribution(ep)[0]:
            continue  # a stale egg-info next to the editable install lists the same points twice
        elif _is_builtin(ep):
            kept[ep.name] = ep
            clashes.append((first, ep))
        else:
            clashes.append((ep, first))
    return sorted(kept.values(), key=lambda ep: (not _is_builtin(ep), ep.name)), clashes


def _status(ep: metadata.EntryPoint, name: str | None = None) -> PluginStatus:
    distribution, version = _distribution(ep)
    return PluginStatus(name=name or ep.name, value=ep.value, distribution=distribution, version=version,
                        builtin=distribution == BUILTIN_DISTRIBUTION)


def _check_instance(backend: Backend) -> None:
    if isinstance(backend, type) or not isinstance(backend, Backend):
        raise BackendUnavailableError.of("register(backend)", "a dsv4.backend.Backend instance", repr(backend))
    if not backend.name:
        raise BackendUnavailableError.of("backend.name", "a non-empty name", repr(backend.name))


def _warn_if_slow(status: PluginStatus) -> None:
    if status.seconds is not None and status.seconds > SLOW_PLUGIN_SECONDS:
        warnings.warn(f"dsv4: plugin {status.label()} took {status.seconds:.1f} s to load (more than "
                      f"{SLOW_PLUGIN_SECONDS:g} s), and every process that uses dsv4 pays it: a plugin should "
                      "import vendor packages in probe() or its ops, not at import; DSV4_PLUGINS=name,... "
                      "loads only the plugins it lists", stacklevel=3)


_GENERATIONS = itertools.count()  # Registry.generation: unique across registries (reset_registry)


class Registry:
    """Holds registered backends, plugin statuses, probe results and cached selections."""

    def __init__(self) -> None:
        self.plugin_manager = pluggy.PluginManager(PROJECT_NAME)
        self.plugin_manager.add_hookspecs(hookspecs)
        self._backends: dict[str, Backend] = {}
        self._origin: dict[str, str] = {}
        self._statuses: dict[str, PluginStatus] = {}
        self._probes: dict[str, list[str]] = {}
        self._selections: dict[tuple[Any, ...], Backend] = {}
        self.generation = next(_GENERATIONS)  # changes whenever a selection could change (callers' memos)

    # -- loading --------------------------------------------------------------------------------
    def load_entry_points(self, group: str = ENTRY_POINT_GROUP, *, strict: bool | None = None) -> list[PluginStatus]:
        """Load every entry point of ``group`` separately; return their statuses."""
        strict = _env_flag("DSV4_STRICT_PLUGINS") if strict is None else strict
        allow = [n.strip() for n in os.environ.get("DSV4_PLUGINS", "").split(",") if n.strip()]
        points, clashes = _entry_points(group)
        unknown = sorted(set(allow) - {ep.name for ep in points})
        if unknown:
            warnings.warn(f"DSV4_PLUGINS names entry points that do not exist: {', '.join(unknown)}",
                          stacklevel=2)
        statuses = []
        for ep, first in clashes:
            status = _status(ep, name=f"{_distribution(ep)[0]}:{ep.name}")
            if allow and ep.name not in allow:  # neither side is loaded: blocked, as any unlisted entry point
                status.state, status.error = "blocked", "not listed in DSV4_PLUGINS"
                self._statuses[status.name] = status
                statuses.append(status)
                continue
            owner = _status(first)
            self._fail(status, PluginRefusedError(
                f"entry point name {ep.name} is also {owner.label()}'s, which is loaded instead; "
                f"{status.distribution}'s entry point is not: give it its own name"), strict)
            statuses.append(status)
        for ep in points:
            status = _status(ep)
            if allow and ep.name not in allow:
                status.state, status.error = "blocked", "not listed in DSV4_PLUGINS"
                self._statuses[ep.name] = status
            else:
                started = time.perf_counter()
                try:
                    plugin = ep.load()
                except Exception as exc:  # noqa: BLE001 - any import error is recorded, not raised
                    status.seconds = time.perf_counter() - started
                    self._fail(status, exc, strict)
                else:
                    self._register_plugin(plugin, status, strict, started)
                _warn_if_slow(status)
            statuses.append(status)
        return statuses

    def load_plugin(self, plugin: object, name: str, *, strict: bool | None = None) -> PluginStatus:
        """Register an already imported plugin (module or object with a ``dsv4_register_backends`` hookimpl),
        checked as a foreign plugin's entry point is."""
        strict = _env_flag("DSV4_STRICT_PLUGINS") if strict is None else strict
        status = PluginStatus(name=name, value=getattr(plugin, "__name__", type(plugin).__name__))
        self._register_plugin(plugin, status, strict, time.perf_counter())
        return status

    def _fail(self, status: PluginStatus, exc: BaseException, strict: bool) -> None:
        status.state = "failed"
        status.error = f"{type(exc).__name__}: {exc}"
        status.traceback = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self._statuses[status.name] = status
        if strict:
            raise PluginLoadError(status.problem(),
                                  argument="plugin", expected="a loadable plugin", received=status.name) from exc

    def _register_plugin(self, plugin: object, status: PluginStatus, strict: bool, started: float) -> None:
        added: list[str] = []

        def register(backend: Backend) -> None:
            self._add(backend, origin=status.name, foreign=None if status.builtin else status)
            added.append(backend.name)

        try:
            self.plugin_manager.register(plugin, name=status.name)
            others = [p for p in self.plugin_manager.get_plugins() if p is not plugin]
            caller = self.plugin_manager.subset_hook_caller("dsv4_register_backends", remove_plugins=others)
            caller(register=register)
        except Exception as exc:  # noqa: BLE001 - roll back a partial registration, record it
            for name in added:
                self._remove(name)
            if self.plugin_manager.is_registered(plugin):
                self.plugin_manager.unregister(plugin)
            status.seconds = time.perf_counter() - started
            self._fail(status, exc, strict)
            return
        status.state, status.backends = "loaded", added
        status.seconds = time.perf_counter() - started
        self._statuses[status.name] = status

    def _refuse_foreign(self, backend: Backend, status: PluginStatus) -> None:
        """Raise ``PluginRefusedError`` (one line naming both sides) when a foreign plugin may not register
        ``backend``: a built-in's name, a name already registered, ops declared but not implemented."""
        name = backend.name
        owner = self._builtin_owner(name)
        if owner is not None:
            raise PluginRefusedError(f"backend name {name} belongs to {owner}; plugin {status.label()} may not "
                                     "register it: give the backend its own name")
        if name in self._backends:
            raise PluginRefusedError(f"backend name {name} is already registered by plugin {self._origin[name]}; "
                                     f"plugin {status.label()} may not register it: give the backend its own name")
        missing = backend.unimplemented_ops()
        if missing:
            raise PluginRefusedError(
                f"backend {name} of plugin {status.label()} lists {', '.join(missing)} in capabilities.ops but "
                f"{type(backend).__name__} does not implement (override) them: pass Capabilities(ops=frozenset({{...}})) "
                "with only the ops it implements (the default is all six)")

    def _builtin_owner(self, name: str) -> str | None:
        """Who owns backend name ``name`` when a built-in does: the built-in plugin that registered it (or
        whose entry point has that name), else dsv4's built-in names; None: a free name."""
        for status in self._statuses.values():
            if status.builtin and (name in status.backends or status.name == name):
                state = "" if status.state == "loaded" else f", {status.state}"
                return f"the built-in plugin {status.label()}{state}"
        if name in BUILTIN_NAMES:
            return f"a built-in backend of {BUILTIN_DISTRIBUTION}"
        return None

    def register_backend(self, backend: Backend, *, origin: str = "<direct>") -> None:
        """Add one backend without a plugin (tests, embedding engines)."""
        self._add(backend, origin=origin)

    def _add(self, backend: Backend, *, origin: str, foreign: PluginStatus | None = None) -> None:
        """Check ``backend`` once (an instance with a name; a foreign plugin's refusals, else a free name) and
        add it."""
        _check_instance(backend)
        if foreign is not None:
            self._refuse_foreign(backend, foreign)
        elif backend.name in self._backends:
            raise BackendUnavailableError.of(
                "backend.name", "a name not registered yet", backend.name,
                hint=f"already registered by plugin {self._origin[backend.name]}")
        self._backends[backend.name] = backend
        self._origin[backend.name] = origin
        self._changed()

    def _remove(self, name: str) -> None:
        self._backends.pop(name, None)
        self._origin.pop(name, None)
        self._probes.pop(name, None)
        self._changed()

    def _changed(self) -> None:
        self._selections.clear()
        self.generation = next(_GENERATIONS)

    def unregister_backend(self, name: str) -> None:
        """Remove a backend (tests)."""
        self._remove(name)

    # -- queries --------------------------------------------------------------------------------
    def plugin_statuses(self) -> list[PluginStatus]:
        return [self._statuses[name] for name in sorted(self._statuses)]

    def backend_names(self) -> list[str]:
        return sorted(self._backends)

    def origin(self, name: str) -> str:
        return self._origin[name]

    def is_builtin(self, name: str) -> bool:
        """Backend ``name`` was registered by a built-in plugin (or is a built-in name registered directly)."""
        status = self._statuses.get(self._origin.get(name, ""))
        return name in BUILTIN_NAMES or (status is not None and status.builtin)

    def failed_plugins_hint(self) -> str:
        """``"plugins that failed to load: a (ImportError: ...), b (...)"``, or "" when none failed (the hint
        of unknown-name errors)."""
        failed = [f"{s.name} ({one_line(s.error or 'failed')})" for s in self.plugin_statuses() if s.state == "failed"]
        return f"plugins that failed to load: {', '.join(failed)}" if failed else ""

    def get(self, name: str, argument: str = "backend") -> Backend:
        """The backend called ``name``; ``NoBackendError`` names ``argument`` and every registered one
        otherwise."""
        try:
            return self._backends[name]
        except KeyError:
            expected = f"one of {', '.join(self.backend_names()) or '(none)'}"
            raise NoBackendError.of(argument, expected if argument == "backend" else f"auto or {expected}",
                                    name, hint=self.failed_plugins_hint()) from None

    def probe(self, name: str) -> list[str]:
        """Cached ``probe()`` of one backend; a probe that raises becomes a reason."""
        if name not in self._probes:
            backend = self.get(name)
            try:
                reasons = list(backend.probe())
            except Exception as exc:  # noqa: BLE001 - a broken probe means "unavailable, because ..."
                reasons = [one_line(f"probe raised {type(exc).__name__}: {exc}")]
            self._probes[name] = reasons
        return self._probes[name]

    def is_available(self, name: str) -> bool:
        return not self.probe(name)

    def available_backends(self) -> list[str]:
        return [name for name in self.backend_names() if self.is_available(name)]

    def reasons(self, request: OpRequest, name: str) -> list[str]:
        """Why backend ``name`` cannot run ``request`` here (probe reasons first); empty: it can."""
        reasons = list(self.probe(name))
        if reasons:
            return reasons
        try:
            return list(self.get(name).not_supported_reasons(request))
        except Exception as exc:  # noqa: BLE001
            return [one_line(f"not_supported_reasons raised {type(exc).__name__}: {exc}")]

    def priority(self, platform: str) -> list[str]:
        """Backend names in selection order for ``platform``: its built-in list (unknown platform:
        ``reference``) with the out-of-tree backends, by name, just before ``reference`` (the last
        resort), then the other built-ins by name."""
        listed = [n for n in PLATFORM_PRIORITIES.get(platform, ("reference",)) if n in self._backends]
        foreign = [n for n in self.backend_names() if not self.is_builtin(n)]
        at = listed.index("reference") if "reference" in listed else len(listed)
        order = listed[:at] + foreign + listed[at:]
        return order + [n for n in self.backend_names() if n not in order]

    def candidates(self, request: OpRequest) -> list[tuple[str, list[str]]]:
        """Every registered backend in priority order with its reasons for ``request``."""
        return [(name, self.reasons(request, name)) for name in self.priority(request.platform)]

    # -- selection ------------------------------------------------------------------------------
    def select(self, request: OpRequest, backend: str | Backend | None = None) -> Backend:
        """Pick the backend for ``request``: explicit argument, then ``DSV4_BACKEND``, then priority."""
        if isinstance(backend, Backend):
            return self._forced(request, backend, "argument backend")
        explicit = None if backend in (None, "", "auto") else backend
        env = os.environ.get("DSV4_BACKEND", "").strip() or None
        key = (request, explicit, env)
        cached = self._selections.get(key)
        if cached is not None:
            return cached
        generation = self.generation
        if explicit is not None:
            chosen = self._forced(request, self.get(explicit), "argument backend")
        elif env is not None and env != "auto":
            chosen = self._forced(request, self.get(env, "DSV4_BACKEND"), "DSV4_BACKEND")
        else:
            chosen = self._first_fit(request)
        if self.generation == generation:  # a backend registered or removed meanwhile (another thread)
            self._selections[key] = chosen
        return chosen

    def _forced(self, request: OpRequest, backend: Backend, source: str) -> Backend:
        # a registered backend's answers are cached by name; any other instance (also one that shares a
        # registered backend's name: a subclass, a tuned copy) is asked itself
        reasons = self.reasons(request, backend.name) if self._backends.get(backend.name) is backend \
            else list(backend.probe()) or list(backend.not_supported_reasons(request))
        if reasons:
            raise NoBackendError(
                f"{source}: backend {backend.name} cannot run {request.describe()}: " + "; ".join(reasons),
                argument=source, expected="a backend that supports the request", received=backend.name)
        return backend

    def _first_fit(self, request: OpRequest) -> Backend:
        candidates = self.candidates(request)
        for name, reasons in candidates:
            if not reasons:
                return self._backends[name]
        lines = [f"  {name}: {'; '.join(reasons)}" for name, reasons in candidates]
        lines += [f"  {s.problem()}" for s in self.plugin_statuses() if s.state == "failed"]
        raise NoBackendError(
            f"no backend can run {request.describe()} on platform {request.platform}; candidates:\n"
            + ("\n".join(lines) if lines else "  (no backend registered)"),
            argument="backend", expected="a backend that supports the request", received="auto")


_REGISTRY: Registry | None = None
_REGISTRY_LOCK = threading.Lock()


def get_registry() -> Registry:
    """The process-wide registry, loading the ``dsv4.backends`` entry points on first use."""
    global _REGISTRY
    if _REGISTRY is None:
        with _REGISTRY_LOCK:  # two threads' first calls load the plugins once
            if _REGISTRY is None:
                registry = Registry()
                registry.load_entry_points()
                _REGISTRY = registry
                if _env_flag("DSV4_TRACE_PLUGINS"):
                    for status in registry.plugin_statuses():
                        seconds = "-" if status.seconds is None else f"{status.seconds:.3f} s"
                        print(f"dsv4: plugin {status.name}: {status.state} ({seconds}) "
                              f"{status.error or status.backends}", file=sys.stderr)
    return _REGISTRY


def reset_registry() -> None:
    """Forget the process-wide registry (tests; the next ``get_registry()`` reloads)."""
    global _REGISTRY
    _REGISTRY = None


def select(request: OpRequest, backend: str | Backend | None = None) -> Backend:
    """``get_registry().select(request, backend)``."""
    return get_registry().select(request, backend)


def get_backend(name: str) -> Backend:
    """``get_registry().get(name)``."""
    return get_registry().get(name)
