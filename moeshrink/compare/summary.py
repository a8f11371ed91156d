"""Which build, derived from the comparisons: `results/<run>/compare/summary.json`, which the report
shows and never recomputes.

A build qualifies when it passes the pass mark on every paired eval it ran ("cannot tell" is not a
pass). For fidelity, the qualifying build with the highest next-word agreement with the reference
where the reference decides (then the lowest drift; the smallest drop on the first paired eval where
agreement did not run): at positions where the reference hardly prefers its top token, top-1 agreement
is a coin toss for every build and only blurs the ranking. For
room, the qualifying build whose KV cache holds the most tokens per card. For size, the qualifying build
with the least weights per card, and the most faithful qualifying build within each size config names
(compare.size_limits_gib). The frontier: the builds (the reference included) that no other build beats on
both size and fidelity, and on both KV-cache room and fidelity. Ties go to the build listed first in config.
"""
from __future__ import annotations

from collections.abc import Sequence
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
    "smallest": "the qualifying build with the least weights per card (measured)",
    "within_size": "the qualifying build of the highest fidelity (as above) whose weights per card fit the size",
    "frontier": "the builds, the reference included (agreement 1, drift 0, no drop), that no other build beats on "
                "both figures: weights per card (less is better) against next-word agreement where the reference "
                "decides (all positions where none decided), mean KL and the MMLU drop; and KV-cache tokens per card "
                "(more is better) against that agreement",
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
        "drops": {e: evals[e]["drop_points"] for e in eval_kinds.paired_ids() if "drop_points" in evals.get(e, {})},
        "kv_cache_tokens": memory["kv_cache_tokens"],
        "weights_gib": memory["weights_gib"],
    }


def reference_summary(memory: dict) -> dict:
    """The reference as a point of the frontier: it agrees with itself everywhere and does not drift."""
    return {"top1_agreement": 1.0, "decided_top1_agreement": 1.0, "mean_kl": 0.0, "drops": {"mmlu": 0.0},
            "kv_cache_tokens": memory["kv_cache_tokens"], "weights_gib": memory["weights_gib"]}


def agreement_figure(figures: dict) -> float | None:
    """Next-word agreement where the reference decides; over all positions where none decided (None: agreement
    did not run)."""
    decided = figures.get("decided_top1_agreement")
    return decided if decided is not None else figures.get("top1_agreement")


def fidelity_key(figures: dict) -> tuple[float, float]:
    """Larger is more faithful: agreement where the reference decides (all positions where none did), then
    less drift; without agreement, the smaller drop on the first paired eval."""
    agreement = agreement_figure(figures)
    if agreement is not None:
        return (agreement, -figures["mean_kl"])
    return (-figures["drop_points"] if figures.get("drop_points") is not None else float("-inf"), 0.0)


def pareto(points: dict[str, tuple]) -> list[str]:
    """The ids whose point no other point beats: at least as good on every coordinate and better on one
    (every coordinate: larger is better), in the order given."""
    def beats(a: tuple, b: tuple) -> bool:
        return all(x >= y for x, y in zip(a, b)) and a != b

    return [i for i, point in points.items() if not any(beats(other, point) for other in points.values())]


FRONTIERS = {  # name -> (size or room: larger is better, fidelity: larger is better), from a build's figures
    "size_agreement": (lambda f: -f["weights_gib"], agreement_figure),
    "size_kl": (lambda f: -f["weights_gib"], lambda f: None if f.get("mean_kl") is None else -f["mean_kl"]),
    "size_mmlu": (lambda f: -f["weights_gib"], lambda f: None if f["drops"].get("mmlu") is None else -f["drops"]["mmlu"]),
    "kv_agreement": (lambda f: f["kv_cache_tokens"], agreement_figure),
}


def frontier(builds: dict[str, dict], reference: str, reference_figures: dict) -> dict[str, list[str]]:
    """Each frontier's Pareto set, the reference included, over the builds that measured its fidelity figure."""
    everyone = {reference: reference_figures, **builds}
    sets = {}
    for name, (room, fidelity) in FRONTIERS.items():
        sets[name] = pareto({b: (room(f), fidelity(f)) for b, f in everyone.items() if fidelity(f) is not None})
    return sets


def choose(builds: dict[str, dict], size_limits_gib: Sequence[float] = ()) -> dict:
    """The choice among `builds` (config order) by RULES."""
    qualifying = [b for b, figures in builds.items() if figures["passes"]]

    def most_faithful(candidates: list[str]) -> str | None:
        return max(candidates, key=lambda b: fidelity_key(builds[b])) if candidates else None

    return {
        "qualifying": qualifying,
        "failing": [b for b, figures in builds.items() if figures["passes"] is False],
        "undecided": [b for b, figures in builds.items()
                      if figures["passes"] is None and any(v["verdict"] == "cannot tell"
                                                           for v in figures["verdicts"].values())],
        "fidelity": most_faithful(qualifying),
        "room": max(qualifying, key=lambda b: builds[b]["kv_cache_tokens"]) if qualifying else None,
        "smallest": min(qualifying, key=lambda b: builds[b]["weights_gib"]) if qualifying else None,
        "within_size": [{"size_gib": limit,
                         "build": most_faithful([b for b in qualifying if builds[b]["weights_gib"] <= limit])}
                        for limit in size_limits_gib],
    }


def run(compare_files: dict[str, Path], memory_files: dict[str, Path], reference: str, out_file: Path,
        size_limits_gib: Sequence[float] = ()) -> dict:
    """`compare_files` by build, every build but the reference, in config order; `memory_files` by build, the
    reference's too."""
    prov = Provenance("compare_summary", {"reference": reference, "builds": list(compare_files),
                                          "size_limits_gib": list(size_limits_gib)},
                      inputs=[str(p) for p in [*compare_files.values(), *memory_files.values()]])
    builds = {}
    for build_id, path in compare_files.items():
        compared = read_json(path)
        if (compared["a"], compared["b"]) != (reference, build_id):
            raise SummaryError(f"{path}: compares {compared['b']!r} with {compared['a']!r}, not {build_id!r} with "
                               f"the reference {reference!r}")
        builds[build_id] = build_summary(compared, read_json(memory_files[build_id]))
    reference_figures = reference_summary(read_json(memory_files[reference]))
    summary = {"reference": reference, "builds": builds, "reference_figures": reference_figures,
               **choose(builds, size_limits_gib), "frontier": frontier(builds, reference, reference_figures),
               "rules": RULES, "provenance": prov.record()}
    atomic_write_json(out_file, summary)
    return summary
