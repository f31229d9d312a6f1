"""What happened to one plugin (an entry point of ``dsv4.backends``, or a plugin loaded directly): the record
``dsv4.registry`` keeps of it, and the one line that says why a plugin registered nothing."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["PluginState", "PluginStatus"]

PluginState = Literal["loaded", "failed", "blocked"]


@dataclass
class PluginStatus:
    """What happened to one entry point (or directly loaded plugin)."""

    name: str
    value: str = ""
    distribution: str | None = None
    version: str | None = None
    state: PluginState = "loaded"
    error: str | None = None
    traceback: str | None = None
    backends: list[str] = field(default_factory=list)
    builtin: bool = False  # an entry point of dsv4.registry.BUILTIN_DISTRIBUTION
    seconds: float | None = None  # import and registration (None: not loaded, e.g. blocked)

    def label(self) -> str:
        """``"acme (acme-dsv4 0.1.0)"``: the plugin and where it comes from."""
        where = self._distribution()
        return f"{self.name} ({where})" if where else self.name

    def problem(self) -> str:
        """Why a plugin that is not ``loaded`` registered nothing, the one line that errors, hints and
        ``dsv4-conformance`` print: ``"plugin acme (acme_dsv4:hooks from acme-dsv4 0.1.0) failed to load:
        ImportError: no libacme"`` (the entry point's value, then its distribution), or ``"plugin acme (...)
        is blocked: not listed in DSV4_PLUGINS"``."""
        origin = " from ".join(x for x in (self.value, self._distribution()) if x)
        verb = "is blocked" if self.state == "blocked" else "failed to load"
        return f"plugin {self.name}{f' ({origin})' if origin else ''} {verb}: {self.error or self.state}"

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value, "distribution": self.distribution,
                "version": self.version, "state": self.state, "error": self.error,
                "backends": list(self.backends), "builtin": self.builtin,
                "load_seconds": None if self.seconds is None else round(self.seconds, 4)}

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> PluginStatus:
        """The status ``as_dict`` wrote (a report's ``plugins`` entry): ``load_seconds`` back to ``seconds``, a
        key it lacks at its default (the traceback is never written)."""
        return cls(record["name"], record.get("value", ""), record.get("distribution"), record.get("version"),
                   record.get("state", "loaded"), record.get("error"), None, list(record.get("backends", ())),
                   bool(record.get("builtin", False)), record.get("load_seconds"))

    def _distribution(self) -> str:
        """``"acme-dsv4 0.1.0"``, what of it is known, or ""."""
        return " ".join(str(x) for x in (self.distribution, self.version) if x)
