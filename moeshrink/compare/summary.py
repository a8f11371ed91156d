"""Which build, derived from the comparisons: `results/<run>/compare/summary.json`, which the report
shows and never recomputes.

A build qualifies when it passes the pass mark on every paired eval it ran ("cannot tell" is not a
pass). For fidelity, the qualifying build with the highest next-word agreement with the reference
where the reference decides (then the lowest drift; the smallest drop on the first paired eval where
agreement did not run): at positions where the reference hardly prefers its top token, top-1 agreement
is a coin toss for every build and only blurs the ranking. For
room, the qualifying build whose KV cache holds the most tokens per card. Ties go to the build listed
first in config.
"""
from __future__ import annotations

from pathlib import Path

from moeshrink.core import eval_kinds
from moeshrink.core.errors import MoeshrinkError
from moeshrink.core.ioutil import atomic_write_json, read_json
from moeshrink.core.provenance import Provenance

RULES = {
    "qualifies": "passes the pass mark on every paired eval it ran; a verdict of \"cannot tell\" is not a pass",
    "fidelity": "the qualifying build with the highest next-word agreement with the reference where the reference "
                "decides (its top token leads the runner-up by the decided margin), then the lowest drift (mean KL); "
                "the smallest drop on the first paired eval where agreement did not run",
    "room": "the qualifying build whose KV cache holds the most tokens per card",
    "ties": "the build listed first in config",
}


class SummaryError(MoeshrinkError, ValueError):
    pass


def build_summary(compared: dict, memory: dict) -> dict:
    """One build's figures for the choice: its verdicts, whether it passes, agreement and cache room."""
    evals = compared["evals"]
    verdicts = {eval_id: {"verdict": evals[eval_id]["verdict"], "reason": evals[eval_id]["verdict_reason"]}
                for eval_id in eval_kinds.paired_ids() if "verdict" in evals.get(eval_id, {})}
    said = [v["verdict"] for v in verdicts.values()]
    passes = False if "fail" in said else True if said and all(v == "pass" for v in said) else None
    agreement = evals.get("agreement")
    first_paired = next((evals[e] for e in eval_kinds.paired_ids() if e in evals), None)
    return {
        "verdicts": verdicts, "passes": passes,
        "top1_agreement": agreement["top1_agreement"]["value"] if agreement else None,
        "decided_top1_agreement": agreement["decided_top1_agreement"]["value"] if agreement else None,
        "mean_kl": agreement["mean_kl"]["value"] if agreement else None,
        "drop_points": first_paired["drop_points"] if first_paired else None,
        "kv_cache_tokens": memory["kv_cache_tokens"],
    }


def choose(builds: dict[str, dict]) -> dict:
    """The choice among `builds` (config order) by RULES."""
    qualifying = [b for b, figures in builds.items() if figures["passes"]]

    def fidelity_key(build_id: str) -> tuple[float, float]:
        figures = builds[build_id]
        agreement = figures["decided_top1_agreement"]
        if agreement is None:  # no position decided, or agreement did not run
            agreement = figures["top1_agreement"]
        if agreement is not None:
            return (agreement, -figures["mean_kl"])
        return (-figures["drop_points"] if figures["drop_points"] is not None else float("-inf"), 0.0)

    return {
        "qualifying": qualifying,
        "failing": [b for b, figures in builds.items() if figures["passes"] is False],
        "undecided": [b for b, figures in builds.items()
                      if figures["passes"] is None and any(v["verdict"] == "cannot tell"
                                                           for v in figures["verdicts"].values())],
        "fidelity": max(qualifying, key=fidelity_key) if qualifying else None,
        "room": max(qualifying, key=lambda b: builds[b]["kv_cache_tokens"]) if qualifying else None,
    }


def run(compare_files: dict[str, Path], memory_files: dict[str, Path], reference: str, out_file: Path) -> dict:
    """`compare_files` and `memory_files` by build, every build but the reference, in config order."""
    prov = Provenance("compare_summary", {"reference": reference, "builds": list(compare_files)},
                      inputs=[str(p) for p in [*compare_files.values(), *memory_files.values()]])
    builds = {}
    for build_id, path in compare_files.items():
        compared = read_json(path)
        if (compared["a"], compared["b"]) != (reference, build_id):
            raise SummaryError(f"{path}: compares {compared['b']!r} with {compared['a']!r}, not {build_id!r} with "
                               f"the reference {reference!r}")
        builds[build_id] = build_summary(compared, read_json(memory_files[build_id]))
    summary = {"reference": reference, "builds": builds, **choose(builds), "rules": RULES,
               "provenance": prov.record()}
    atomic_write_json(out_file, summary)
    return summary
