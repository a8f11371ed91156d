"""The evals a study may run, one registry entry each: all that the config check, the rules (an eval's
set files), the eval job (its runner), the compare stage and the report know of an eval. An eval is
one module that calls `register` when imported, plus its task files: the built-in five are
registered by `moeshrink.evals.kinds`, others are found as `core.plugins` says (the `moeshrink.evals`
entry-point group, MOESHRINK_PLUGINS).

How a build is compared with the reference follows from the entry: a `paired` eval writes one record
per item (`id`, `correct`, `doc_hash`) and is compared item by item (McNemar) and judged against the
pass mark; any other eval may name a `comparer` (`module:function`, (reference result, build result)
-> dict) that compares the two results' counts.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from moeshrink.core import plugins
from moeshrink.core.errors import MoeshrinkError


class EvalKindError(MoeshrinkError, ValueError):
    pass


@dataclass(frozen=True)
class EvalKind:
    id: str                     # its key under `evals:` and its files' name
    title: str                  # how the report names it
    runner: str                 # `module:function`, run(job) -> the result JSON (moeshrink.evals.run.EvalJob)
    # (its `evals.<id>` config, the organism data folder) -> the set files its job reads, by input name
    set_files: Callable[[dict, str], dict[str, str]]
    paired: bool = False        # per-item records, compared item by item and judged against the pass mark
    metric: str | None = None   # a paired eval's accuracy in its result's `metrics`
    comparer: str | None = None  # `module:function` comparing two results of an unpaired eval
    schema: dict | None = None  # its `evals.<id>` config section, for an eval the schema file does not list


REGISTRY: plugins.Registry[EvalKind] = plugins.Registry(
    "eval", ("moeshrink.evals.kinds",), "moeshrink.evals", name=lambda kind: kind.id, origin=lambda kind: kind.runner,
    error=EvalKindError)
kinds = REGISTRY.entries


def register(kind: EvalKind) -> EvalKind:
    if kind.paired and not kind.metric:
        raise EvalKindError(f"eval {kind.id!r}: a paired eval names its accuracy metric")
    return REGISTRY.register(kind)


def get(eval_id: str) -> EvalKind:
    return REGISTRY.get(eval_id, "evals")


def paired_ids() -> list[str]:
    return [eval_id for eval_id, kind in kinds().items() if kind.paired]
