"""Paired comparison of two builds from their eval JSONs and per-item records: what
`results/compare/{build}.json` (a build against the reference) and `results/compare/pairs/{a}_vs_{b}.json`
(two builds against each other) hold.

The paired evals (their registry entries say so: mmlu, gsm8k) are compared question by question:
counts right only for each side, exact McNemar, the drop in points and its one-sided 95% upper bound
("at worst"), the smallest drop the comparison could detect, and, against the reference, a verdict on
the pass mark the config fixed before the run: pass, fail, or cannot tell (with the reason) when the
data cannot support either. Made-up facts and tool calls are independent samples: Fisher's exact test
on the counts (the comparers their entries name). Agreement and drift are already measured against
the reference by the agreement eval; they are carried over with their intervals.
"""
from __future__ import annotations

from pathlib import Path

from moeshrink.core import eval_kinds, plugins, stats
from moeshrink.core.errors import MoeshrinkError
from moeshrink.core.ioutil import atomic_write_json, jsonl_lines, read_json
from moeshrink.core.provenance import Provenance


class CompareError(MoeshrinkError, ValueError):
    """Two result files that cannot be compared (different items, missing records)."""


def read_records(path: Path) -> dict[str, dict]:
    records: dict[str, dict] = {}
    for line_number, record in jsonl_lines(path):
        if "id" not in record or "correct" not in record:
            raise CompareError(f"{path}:{line_number}: a paired record needs 'id' and 'correct'")
        records[record["id"]] = record
    return records


def paired_accuracy(eval_id: str, a_id: str, a_records: dict[str, dict], b_id: str,
                    b_records: dict[str, dict], files: tuple[Path, Path] | None = None) -> dict:
    """Question-by-question comparison of two builds on the same items (read from `files`, a's and b's)."""
    if a_records.keys() != b_records.keys():
        only_a, only_b = sorted(a_records.keys() - b_records.keys()), sorted(b_records.keys() - a_records.keys())
        read_from = f" ({files[0]}: {len(a_records)} items, {files[1]}: {len(b_records)})" if files else ""
        raise CompareError(f"{eval_id}: {a_id} and {b_id} did not read the same items "
                           f"(only {a_id}: {only_a[:5]}, only {b_id}: {only_b[:5]}){read_from}; rerun the eval "
                           "whose records are short")
    counts = {"both_right": 0, "only_a": 0, "only_b": 0, "neither": 0}
    for item_id, a_record in a_records.items():
        b_record = b_records[item_id]
        if a_record.get("doc_hash") != b_record.get("doc_hash"):
            raise CompareError(f"{eval_id} item {item_id}: {a_id} and {b_id} read different questions (doc_hash)")
        a_right, b_right = bool(a_record["correct"]), bool(b_record["correct"])
        key = "both_right" if a_right and b_right else "only_a" if a_right else "only_b" if b_right else "neither"
        counts[key] += 1
    n = len(a_records)
    if n == 0:
        raise CompareError(f"{eval_id}: no item to compare")
    return {
        "items": n, **counts,
        "accuracy_a": stats.rate_with_ci(counts["both_right"] + counts["only_a"], n),
        "accuracy_b": stats.rate_with_ci(counts["both_right"] + counts["only_b"], n),
        **stats.paired_drop(n, counts["only_a"], counts["only_b"]),
        "minimum_detectable_drop_points": stats.min_detectable_drop(n, counts["only_a"], counts["only_b"]),
        "minimum_detectable_drop_method": "one-sided 5% level, 80% power; Connor's normal approximation for "
                                          "McNemar's test at the observed discordance",
        "p_value": stats.mcnemar_exact(counts["only_a"], counts["only_b"]),
        "test": "exact McNemar, two-sided (binomial test of the discordant pairs)",
    }


VERDICTS = ("pass", "fail", "cannot tell")
SIGNIFICANCE = 0.05
RESOLUTION_FACTOR = 2  # a comparison judges a mark only if it could detect a loss of twice the mark


def chance_rate(records: dict[str, dict]) -> float:
    """What guessing scores: 1 / choices for multiple choice (records with per-choice
    log-likelihoods), 0 for free-form answers."""
    choices = [len(r["loglikelihoods"]) for r in records.values() if r.get("loglikelihoods")]
    return sum(1 / c for c in choices) / len(choices) if choices else 0.0


def judge(paired: dict, pass_mark_points: float, pass_on: str, chance: float) -> dict:
    """pass, fail or cannot tell, with the reason, against the pass mark fixed in config.

    - cannot tell, whatever the rule: the reference's accuracy is not above chance by more than the
      mark (its 95% lower bound <= chance + mark): a build cannot lose what the reference never had;
    - pass_on at_worst: pass when the one-sided 95% upper bound of the drop is within the mark, fail
      when the drop itself is beyond it, cannot tell when the two lie on opposite sides of it;
    - pass_on drop: fail when the drop is beyond the mark, pass when it is within; but cannot tell
      when the comparison could not have detected a loss of twice the mark (minimum detectable
      drop, one-sided 5%, 80% power) and its McNemar test finds no significant difference."""
    drop, at_worst = paired["drop_points"], paired["at_worst_points"]
    detectable = paired["minimum_detectable_drop_points"]
    reference = paired["accuracy_a"]
    floor = 100 * chance + pass_mark_points
    mark = f"the pass mark ({pass_mark_points:g} point{'' if pass_mark_points == 1 else 's'})"
    if 100 * reference["ci95"][0] <= floor:
        verdict, reason = "cannot tell", (
            f"the reference's accuracy ({100 * reference['value']:.1f}%, 95% lower bound "
            f"{100 * reference['ci95'][0]:.1f}%) is not above chance ({100 * chance:.1f}%) by more than {mark}: "
            "a build cannot lose what the reference never had")
    elif pass_on == "at_worst":
        if at_worst <= pass_mark_points:
            verdict, reason = "pass", f"at worst {at_worst:.2f} points lost, within {mark}"
        elif drop > pass_mark_points:
            verdict, reason = "fail", f"{drop:.2f} points lost, beyond {mark}"
        else:
            verdict, reason = "cannot tell", (
                f"the drop ({drop:.2f} points) is within {mark} but its one-sided 95% upper bound "
                f"({at_worst:.2f}) is not: too few items to judge the mark")
    else:
        unresolved = detectable > RESOLUTION_FACTOR * pass_mark_points and paired["p_value"] >= SIGNIFICANCE
        if unresolved:
            verdict, reason = "cannot tell", (
                f"the drop ({drop:.2f} points, McNemar p = {paired['p_value']:.2g}) cannot be told from noise: "
                f"these items could only detect a loss of {detectable:.1f} points (one-sided 5%, 80% power), "
                f"more than {RESOLUTION_FACTOR} x {mark}")
        elif drop > pass_mark_points:
            verdict, reason = "fail", f"{drop:.2f} points lost, beyond {mark}"
        else:
            verdict, reason = "pass", f"{drop:.2f} points lost, within {mark}"
    return {"pass_mark_points": pass_mark_points, "pass_on": pass_on, "chance_rate": chance,
            "verdict": verdict, "verdict_reason": reason}


def count_difference(bad_a: int, total_a: int, bad_b: int, total_b: int) -> dict:
    return {"a": stats.rate_with_ci(bad_a, total_a), "b": stats.rate_with_ci(bad_b, total_b),
            "difference_points": 100 * (bad_b / total_b - bad_a / total_a) if total_a and total_b else None,
            "p_value": stats.fisher_exact(bad_a, total_a, bad_b, total_b),
            "test": "Fisher's exact test, two-sided"}


def made_up_facts(a_result: dict, b_result: dict) -> dict:
    a, b = a_result["metrics"]["made_up"], b_result["metrics"]["made_up"]
    return {"measure": "facts made up (no passage supports them), of all facts written",
            **count_difference(a["count"], a["total"], b["count"], b["total"])}


def tool_calls(a_result: dict, b_result: dict) -> dict:
    """Per effort: calls right on each side; the test runs on the wrong ones."""
    by_effort = {}
    for effort, a_figures in a_result["metrics"]["by_effort"].items():
        b_figures = b_result["metrics"]["by_effort"].get(effort)
        if b_figures is None:
            raise CompareError(f"toolcalls: effort {effort!r} ran for one build only")
        a_right, b_right = a_figures["right"], b_figures["right"]
        wrong = count_difference(a_right["total"] - a_right["count"], a_right["total"],
                                 b_right["total"] - b_right["count"], b_right["total"])
        by_effort[effort] = {"right_a": a_right, "right_b": b_right,
                             "difference_points": 100 * (b_right["value"] - a_right["value"]),
                             "p_value": wrong["p_value"], "test": wrong["test"]}
    return {"measure": "calls right (tool name, number of calls, argument shape)", "by_effort": by_effort}


def agreement(b_result: dict) -> dict:
    metrics = b_result["metrics"]
    return {"against": b_result.get("compared_with") or b_result["build"], "positions": metrics["positions"],
            "passages": metrics["passages"], "top_k": metrics["top_k"],
            "top1_agreement": metrics["top1_agreement"],
            "decided_top1_agreement": metrics["decided_top1_agreement"], "mean_kl": metrics["mean_kl"],
            "kl_percentiles": metrics.get("kl_percentiles"), "method": metrics["method"],
            "reference_read_twice": bool(b_result.get("reference"))}


def compare(a_id: str, b_id: str, a_results: dict[str, dict], b_results: dict[str, dict],
            a_records: dict[str, dict[str, dict]], b_records: dict[str, dict[str, dict]],
            judging: dict | None, record_files: dict[str, tuple[Path, Path]] | None = None) -> dict:
    """Everything both builds measured, side b against side a. `judging` (pass mark and rule) only
    when side a is the reference; `record_files` by eval, a's and b's, to name them."""
    evals: dict[str, dict] = {}
    for eval_id, kind in eval_kinds.kinds().items():
        if kind.paired and eval_id in a_records and eval_id in b_records:
            paired = paired_accuracy(eval_id, a_id, a_records[eval_id], b_id, b_records[eval_id],
                                     (record_files or {}).get(eval_id))
            if judging:
                paired.update(judge(paired, judging["pass_mark_points"], judging["pass_on"],
                                    chance_rate(a_records[eval_id])))
            evals[eval_id] = paired
        elif kind.comparer and eval_id in a_results and eval_id in b_results:
            evals[eval_id] = plugins.resolve(kind.comparer)(a_results[eval_id], b_results[eval_id])
    if judging and "agreement" in b_results:
        evals["agreement"] = agreement(b_results["agreement"])
    return {"a": a_id, "b": b_id, "evals": evals}


def run(inputs: dict[str, Path], a_id: str, b_id: str, compare_config: dict, out_file: Path,
        against_reference: bool) -> dict:
    """`inputs` keys: `{a|b}_{eval}` (the eval JSON) and `{a|b}_{eval}_records` (its JSONL)."""
    prov = Provenance("compare", compare_config, inputs=[str(p) for p in inputs.values()])
    results: dict[str, dict[str, dict]] = {"a": {}, "b": {}}
    records: dict[str, dict[str, dict]] = {"a": {}, "b": {}}
    for key, path in inputs.items():
        side, _, rest = key.partition("_")
        if rest.endswith("_records"):
            records[side][rest[: -len("_records")]] = read_records(path)
        else:
            results[side][rest] = read_json(path)
    for side, build_id in (("a", a_id), ("b", b_id)):
        for eval_id, result in results[side].items():
            if result["build"] != build_id:
                raise CompareError(f"{inputs[f'{side}_{eval_id}']}: holds build {result['build']!r}, not {build_id!r}")
    judging = compare_config if against_reference else None
    record_files = {eval_id: (inputs[f"a_{eval_id}_records"], inputs[f"b_{eval_id}_records"])
                    for eval_id in records["a"].keys() & records["b"].keys()}
    result = compare(a_id, b_id, results["a"], results["b"], records["a"], records["b"], judging, record_files)
    result["side_a_is_reference"] = against_reference
    result["eval_files"] = {key: str(path) for key, path in inputs.items()}
    result["provenance"] = prov.record()
    atomic_write_json(out_file, result)
    return result
