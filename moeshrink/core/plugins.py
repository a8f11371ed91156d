"""Extension modules. The registries (`expert_formats`, `prune_methods`, `eval_kinds`) fill themselves on first use by
importing their built-in modules, the modules another installed package names in the registry's
entry-point group, and the modules named in MOESHRINK_PLUGINS (comma-separated: modules on the
Python path that no package installs). Each such module registers its entries when imported."""
from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Generic, TypeVar

from moeshrink.core.errors import MoeshrinkError

ENV = "MOESHRINK_PLUGINS"
Entry = TypeVar("Entry")


class PluginError(MoeshrinkError, ImportError):
    pass


def load(builtin: tuple[str, ...], group: str) -> None:
    for module in builtin:
        importlib.import_module(module)
    for entry in entry_points(group=group):
        entry.load()
    for module in filter(None, (name.strip() for name in os.environ.get(ENV, "").split(","))):
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise PluginError(f"{ENV}: cannot import {module!r} ({error})") from None


def resolve(target: str):
    """The object a `module:name` string names, imported when first needed."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


class Registry(Generic[Entry]):
    """Entries by name, filled on first use by `load(builtin, group)`. An entry registered again from
    the same origin (its module imported twice) replaces itself; from another origin it is refused."""

    def __init__(self, what: str, builtin: tuple[str, ...], group: str, name: Callable[[Entry], str],
                 origin: Callable[[Entry], str], error: type[MoeshrinkError]):
        self.what, self.builtin, self.group = what, builtin, group
        self.name, self.origin, self.error = name, origin, error
        self.by_name: dict[str, Entry] = {}
        self.loaded = False

    def register(self, entry: Entry) -> Entry:
        name = self.name(entry)
        known = self.by_name.get(name)
        if known is not None and self.origin(known) != self.origin(entry):
            raise self.error(f"{self.what} {name!r} is registered twice ({self.origin(known)}, {self.origin(entry)})")
        self.by_name[name] = entry
        return entry

    def entries(self) -> dict[str, Entry]:
        """Every entry by name: the built-in ones first, then the plugins'."""
        if not self.loaded:
            load(self.builtin, self.group)
            self.loaded = True
        return dict(self.by_name)

    def get(self, name: str, where: str) -> Entry:
        known = self.entries()
        if name not in known:
            raise self.error(f"{where}: {name!r} is unknown; known: {', '.join(known)}")
        return known[name]
