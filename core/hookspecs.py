"""The one pluggy hook of dsv4, and the markers plugins use.

A backend plugin is a module named by an entry point in the ``dsv4.backends`` group::

    # pyproject.toml of the plugin's distribution
    [project.entry-points."dsv4.backends"]
    mybackend = "my_package.dsv4_plugin"

    # my_package/dsv4_plugin.py
    from dsv4.hookspecs import hookimpl

    @hookimpl
    def dsv4_register_backends(register):
        register(MyBackend())          # a dsv4.backend.Backend instance

The built-in backends register through the same entry points. Loading is per entry point and
guarded (see :mod:`dsv4.registry`): one broken plugin is recorded as failed, never fatal,
unless ``DSV4_STRICT_PLUGINS=1``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from dsv4.backend import Backend

__all__ = ["ENTRY_POINT_GROUP", "PROJECT_NAME", "dsv4_register_backends", "hookimpl", "hookspec"]

PROJECT_NAME = "dsv4"
ENTRY_POINT_GROUP = "dsv4.backends"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def dsv4_register_backends(register: Callable[[Backend], None]) -> None:
    """Call ``register(backend)`` once per :class:`dsv4.backend.Backend` instance this plugin provides.

    Register even when the backend cannot run here: its ``probe()`` explains why, and
    ``dsv4-conformance list`` shows that reason. Never import vendor packages in this hook.
    """
