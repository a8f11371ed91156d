"""Sweeps: a grid over a base build's keys (`sweeps:` in the config), each grid point an ordinary build
added to `builds` (its own plan, shards, server, evals, comparison and memory). A point's id is the
sweep's id and its values (`v2_bits` at 2.25 bits: `v2_bits_2_25`), its label the sweep's label and
what the point sets; the build carries `sweep: <sweep id>`, which only the report reads."""
from __future__ import annotations

import copy
import itertools
import re
from typing import Any

SWEEP_KEY = "sweep"  # the sweep a generated build belongs to
RESERVED_GRID_KEYS = ("label", "evals", SWEEP_KEY)  # not what a build is made of
DEFAULT_EVALS = ("agreement", "mmlu")  # what a point runs when the sweep does not say (where configured)
VALUE_LABELS = {  # how a point's label shows a value of these keys
    "quantize.max_bits_per_weight": "{:g} bits",
    "prune.keep_fraction": "keeps {:.0%}",
}


def slug(value: Any) -> str:
    """A grid value as part of a build id: 2.25 -> 2_25, 'twx2.5-v2' -> twx2_5_v2, True -> true."""
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return re.sub(r"[^a-z0-9]+", "_", text.lower().replace("-", "_")).strip("_") or "none"


def point_id(sweep_id: str, values: tuple) -> str:
    return "_".join([sweep_id, *(slug(value) for value in values)])


def point_label(sweep_label: str, keys: list[str], values: tuple) -> str:
    parts = [VALUE_LABELS[key].format(value) if key in VALUE_LABELS and isinstance(value, (int, float))
             else f"{key.rsplit('.', 1)[-1]} {value}" for key, value in zip(keys, values)]
    return f"{sweep_label} ({', '.join(parts)})"


def _settable(spec: dict, dotted: str) -> bool:
    """Whether every part of `dotted` but the last is a mapping of `spec` or absent."""
    node: Any = spec
    for key in dotted.split(".")[:-1]:
        node = node.get(key, {}) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            return False
    return True


def _set(spec: dict, dotted: str, value: Any) -> None:
    *path, last = dotted.split(".")
    for key in path:
        spec = spec.setdefault(key, {})
    spec[last] = copy.deepcopy(value)


def _base(config: dict, sweep_id: str, sweep: dict) -> tuple[dict | None, str, list[str]]:
    """The base build's spec (without label, evals or sweep), the sweep's label, and any problem."""
    base = sweep["base"]
    if isinstance(base, str):
        named = config["builds"].get(base)
        if named is None or SWEEP_KEY in named:
            return None, "", [f"sweeps.{sweep_id}.base: {base!r} is not a build of builds "
                              f"(builds: {', '.join(b for b, s in config['builds'].items() if SWEEP_KEY not in s)})"]
        spec = named
    else:
        spec = base
    spec = {key: copy.deepcopy(value) for key, value in spec.items() if key not in RESERVED_GRID_KEYS}
    return spec, sweep.get("label") or method_label(spec) or sweep_id, []


def method_label(spec: dict) -> str:
    """What a build spec is made by, in a few words: 'reap + twx2.5-v2'."""
    return " + ".join(str(part) for part in ((spec.get("prune") or {}).get("method"),
                                             (spec.get("quantize") or {}).get("format")) if part)


def sweep_evals(config: dict, sweep_id: str, sweep: dict) -> tuple[list[str], list[str]]:
    """The evals the sweep's points run (configured ones only), and any problem."""
    configured = [e for e in config["evals"] if e != "client"]
    asked = sweep.get("evals")
    if asked is None:
        return [e for e in DEFAULT_EVALS if e in configured], []
    unknown = [e for e in asked if e not in configured]
    if unknown:
        return [], [f"sweeps.{sweep_id}.evals: {', '.join(map(repr, unknown))} not configured under evals "
                    f"(configured: {', '.join(configured)})"]
    return list(asked), []


def points(config: dict, sweep_id: str, sweep: dict) -> tuple[dict[str, dict], list[str]]:
    """{point id: build spec} of one sweep, in grid order, and the problems found making them."""
    spec, label, problems = _base(config, sweep_id, sweep)
    evals, eval_problems = sweep_evals(config, sweep_id, sweep)
    problems += eval_problems
    grid = sweep["grid"]
    for key in grid:
        if key.split(".")[0] in RESERVED_GRID_KEYS:
            problems.append(f"sweeps.{sweep_id}.grid.{key}: not a key a build is made by")
        elif spec is not None and not _settable(spec, key):
            problems.append(f"sweeps.{sweep_id}.grid.{key}: the base build's {key.rsplit('.', 1)[0]} is not a mapping")
    if problems or spec is None:
        return {}, problems
    keys = list(grid)
    made: dict[str, dict] = {}
    for values in itertools.product(*(grid[key] for key in keys)):
        build = copy.deepcopy(spec)
        for key, value in zip(keys, values):
            _set(build, key, value)
        build_id = point_id(sweep_id, values)
        if build_id in made:
            problems.append(f"sweeps.{sweep_id}.grid: two points are both named {build_id!r}")
            continue
        made[build_id] = {"label": point_label(label, keys, values), **build, "evals": evals, SWEEP_KEY: sweep_id}
    return made, problems


def where(sweep_id: str, build_id: str) -> str:
    """How an error about one grid point names it (config key and point)."""
    return f"sweeps.{sweep_id}.grid[{build_id}]"


def expand(config: dict) -> list[str]:
    """Add every sweep's points to config["builds"] (in place, after the named builds); return the problems
    (a point named like a build it is not, a base that is not a build, an eval not configured). Expanding
    an expanded config changes nothing."""
    problems: list[str] = []
    for sweep_id, sweep in (config.get("sweeps") or {}).items():
        made, found = points(config, sweep_id, sweep)
        problems += found
        for build_id, build in made.items():
            existing = config["builds"].get(build_id)
            if existing is None:
                config["builds"][build_id] = build
            elif existing != build:
                owner = f"sweeps.{existing[SWEEP_KEY]}" if SWEEP_KEY in existing else f"builds.{build_id}"
                problems.append(f"sweeps.{sweep_id}.grid: the point {build_id!r} collides with {owner}; rename the sweep")
    return problems
