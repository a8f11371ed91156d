"""The files a comparison reads, for a config: the compare rules' input functions and anything that runs a
comparison outside the workflow read this one list (light: no scipy at workflow start-up)."""
from __future__ import annotations

from moeshrink.core import eval_kinds
from moeshrink.core.layout import results_dir
from moeshrink.evals import configured_evals, eval_builds


def compared_evals(config: dict, build_a: str, build_b: str) -> list[str]:
    """The evals both builds ran (gsm8k may run for some builds only)."""
    return [eval_id for eval_id in configured_evals(config)
            if build_a in eval_builds(config, eval_id) and build_b in eval_builds(config, eval_id)]


def side_inputs(config: dict, side: str, build: str, eval_ids: list[str]) -> dict[str, str]:
    """One side's eval JSONs, and the per-item records of the paired evals."""
    evals = f"{results_dir(config).as_posix()}/evals/{build}"
    inputs = {}
    for eval_id in eval_ids:
        inputs[f"{side}_{eval_id}"] = f"{evals}/{eval_id}.json"
        if eval_kinds.get(eval_id).paired:
            inputs[f"{side}_{eval_id}_records"] = f"{evals}/{eval_id}.jsonl"
    return inputs


def against_reference(config: dict, build: str) -> dict[str, str]:
    """A build against the reference (side a; the agreement eval, made against it, only on side b)."""
    reference = config["reference_build"]
    eval_ids = compared_evals(config, reference, build)
    return {**side_inputs(config, "a", reference, [e for e in eval_ids if e != "agreement"]),
            **side_inputs(config, "b", build, eval_ids)}


def pair(config: dict, build_a: str, build_b: str) -> dict[str, str]:
    eval_ids = [e for e in compared_evals(config, build_a, build_b) if e != "agreement"]
    return {**side_inputs(config, "a", build_a, eval_ids), **side_inputs(config, "b", build_b, eval_ids)}
