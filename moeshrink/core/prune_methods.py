"""The prune methods a build may rank its routed experts by, one registry entry each: all that the
config check, the rules (a method's calibration text), the builder and the CLI know of a method. A
method is one module that calls `register` when imported, plus its scorer: the built-in router_sum
and reap are registered by `moeshrink.compress.prune` (light: the planner imports it without torch),
others are found as `core.plugins` says (the `moeshrink.prune_methods` entry-point group,
MOESHRINK_PLUGINS).

A scorer (`module:function`) takes (upstream folder, the build's `prune` config, its calibration
file or None, the config key to name in errors) and returns each MoE layer's expert scores (higher
is kept; `compress.prune.choose_experts` keeps the same number from every routing group).
"""
from __future__ import annotations

from dataclasses import dataclass

from moeshrink.core import plugins
from moeshrink.core.errors import MoeshrinkError


class PruneMethodError(MoeshrinkError, ValueError):
    pass


@dataclass(frozen=True)
class PruneMethod:
    name: str                # builds.<id>.prune.method
    scorer: str              # `module:function`, see above
    calibrated: bool = False  # reads calibration text (builds.<id>.prune.calibration: file, sequences, seq_len)


REGISTRY: plugins.Registry[PruneMethod] = plugins.Registry(
    "prune method", ("moeshrink.compress.prune",), "moeshrink.prune_methods", name=lambda method: method.name,
    origin=lambda method: method.scorer, error=PruneMethodError)


def methods() -> dict[str, PruneMethod]:
    return REGISTRY.entries()


def get(name: str, where: str) -> PruneMethod:
    return REGISTRY.get(name, where)
