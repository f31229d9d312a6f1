"""``dsv4-conformance list``, and the plugin lines ``run`` prints: what loaded, how long it took, what was refused.

``list`` prints two tables: the backends (status, plugin, package versions, reasons) and the plugins
(state, distribution, load time, the backends each registered, or why it failed, was refused or
blocked). ``list --json`` holds the same: ``environment``, ``backends`` and ``plugins`` (each with
``state``, ``error``, ``builtin`` and ``load_seconds``). A plugin that registered no backend (its
import failed, or it was refused: a built-in backend's name, a name taken, ops it does not implement)
is never hidden: ``list`` and ``run`` both show it with its reason.
"""
from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["cmd_list", "plugin_problems", "print_plugin_problems"]


def cmd_list(args: argparse.Namespace) -> int:
    from dsv4.conformance import cli
    from dsv4.conformance.report import environment
    from dsv4.conformance.runner import backend_statuses
    from dsv4.registry import SLOW_PLUGIN_SECONDS
    from rich.table import Table

    registry = cli._registry()
    statuses = backend_statuses(registry)
    plugins = registry.plugin_statuses()
    if args.json:
        print(json.dumps({"environment": environment(), "backends": statuses,
                          "plugins": [s.as_dict() for s in plugins]}, indent=1, default=str))
        return 0
    escape = cli._escape
    console = cli._console()
    env = environment()
    console.print(escape(f"torch {env['torch']}  triton {env['triton']}  device {env['device_name']}  "
                         f"python {env['python']}"))
    table = Table(title="dsv4 backends")
    for column in ("backend", "status", "plugin", "versions", "reasons"):
        table.add_column(column, overflow="fold")
    for name, info in statuses.items():
        color = {"available": "green", "unavailable": "yellow"}.get(info["status"], "red")
        versions = ", ".join(f"{k} {v}" for k, v in info["package_versions"].items()) or "-"
        table.add_row(escape(name), f"[{color}]{escape(info['status'])}[/]", escape(info.get("plugin")),
                      escape(versions), escape("\n".join(info["reasons"]) or "-"))
    console.print(table)
    table = Table(title="dsv4 plugins (entry points of dsv4.backends)")
    for column in ("plugin", "state", "distribution", "load s", "backends / reason"):
        table.add_column(column, overflow="fold")
    for status in plugins:
        color = {"loaded": "green", "blocked": "yellow"}.get(status.state, "red")
        where = " ".join(str(x) for x in (status.distribution, status.version) if x) or "-"
        where += " (built-in)" if status.builtin else ""
        seconds = "-" if status.seconds is None else f"{status.seconds:.3f}"
        if status.seconds is not None and status.seconds > SLOW_PLUGIN_SECONDS:
            seconds = f"[yellow]{seconds} (slow)[/]"
        what = ", ".join(status.backends) if status.state == "loaded" else status.error or status.state
        table.add_row(escape(status.name), f"[{color}]{escape(status.state)}[/]", escape(where), seconds,
                      escape(what or "(none)"))
    console.print(table)
    return 0


def plugin_problems(registry: Any) -> list[str]:
    """One line per plugin that failed to load or was refused (``PluginStatus.problem``)."""
    return [s.problem() for s in registry.plugin_statuses() if s.state == "failed"]


def print_plugin_problems(console: Any, registry: Any) -> None:
    """``run``'s note under its table: the plugins that registered nothing, and why (``list`` shows more)."""
    from dsv4.conformance.cli import _escape

    for line in plugin_problems(registry):
        console.print(f"[yellow]{_escape(line)}[/]")
