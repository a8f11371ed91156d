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


class PruneConfigError(MoeshrinkError, ValueError):
    pass


def valid_keep_counts(num_experts: int, top_k: int, n_group: int) -> list[int]:
    return [k for k in range(1, num_experts + 1) if k >= top_k and k % n_group == 0]


def kept_count(num_experts: int, keep_fraction: float, top_k: int, n_group: int, where: str = "keep_fraction") -> int:
    if not 0 < keep_fraction <= 1:
        raise PruneConfigError(f"{where}: {keep_fraction} is outside (0, 1]")
    keep = round(num_experts * keep_fraction)
    if keep >= top_k and keep % n_group == 0 and keep >= 1:
        return keep
    options = valid_keep_counts(num_experts, top_k, n_group)
    shown = ", ".join(f"{k} ({k / num_experts:g})" for k in options[:12]) + (" ..." if len(options) > 12 else "")
    raise PruneConfigError(
        f"{where}: {keep_fraction} keeps {keep} of {num_experts} experts, but a layer needs at least top-k = {top_k} "
        f"experts and a multiple of n_group = {n_group}; counts that work (fraction): {shown}")


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
