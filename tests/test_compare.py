"""results/compare/: builds paired item by item with the reference, judged against the pass mark."""
import json
from pathlib import Path

import pytest

from moeshrink.compare import paired
from moeshrink.core import stats
from moeshrink.core.ioutil import atomic_write_json, atomic_write_jsonl


def _write_eval(folder: Path, build: str, eval_id: str, correct: list[bool], hashes: list[str] | None = None,
                choices: int | None = None) -> dict:
    records = [{"id": f"q-{i}", "doc_hash": (hashes or [f"h{j}" for j in range(len(correct))])[i], "correct": c,
                **({"loglikelihoods": [-1.0] * choices} if choices else {})} for i, c in enumerate(correct)]
    atomic_write_jsonl(folder / f"{build}/{eval_id}.jsonl", records)
    metric = "accuracy" if eval_id == "mmlu" else "exact_match"
    atomic_write_json(folder / f"{build}/{eval_id}.json", {"build": build, "eval": eval_id, "items": len(records),
                                                         "metrics": {metric: stats.rate_with_ci(sum(correct),
                                                                                                len(correct))}})
    return {f"{eval_id}": folder / f"{build}/{eval_id}.json", f"{eval_id}_records": folder / f"{build}/{eval_id}.jsonl"}


def _write_counts(folder: Path, build: str, made_up: int, facts: int, right: dict[str, int], calls: int) -> dict:
    atomic_write_json(folder / f"{build}/facts.json", {"build": build, "eval": "facts", "items": 10, "metrics": {
        "made_up": stats.rate_with_ci(made_up, facts)}})
    atomic_write_json(folder / f"{build}/toolcalls.json", {"build": build, "eval": "toolcalls", "items": calls, "metrics": {
        "by_effort": {effort: {"right": stats.rate_with_ci(count, calls)} for effort, count in right.items()}}})
    return {"facts": folder / f"{build}/facts.json", "toolcalls": folder / f"{build}/toolcalls.json"}


def _inputs(tmp_path: Path, ref_correct, build_correct, build_hashes=None, choices=None) -> dict[str, Path]:
    inputs = {}
    for side, build, correct, hashes in (("a", "original", ref_correct, None), ("b", "twx3", build_correct, build_hashes)):
        files = _write_eval(tmp_path, build, "mmlu", correct, hashes, choices)
        files.update(_write_counts(tmp_path, build, 2 if side == "a" else 9, 100, {"low": 50, "high": 55}, 60))
        inputs.update({f"{side}_{key}": path for key, path in files.items()})
    return inputs


def test_paired_counts_statistics_and_the_pass_mark(tmp_path):
    reference = [True] * 60 + [False] * 40
    build = [True] * 52 + [False] * 8 + [True] * 3 + [False] * 37   # 8 right only for the reference, 3 only for the build
    out = tmp_path / "compare/twx3.json"
    result = paired.run(_inputs(tmp_path, reference, build), "original", "twx3",
                         {"pass_mark_points": 1.0, "pass_on": "drop"}, out, against_reference=True)
    mmlu = result["evals"]["mmlu"]
    assert (mmlu["items"], mmlu["both_right"], mmlu["only_a"], mmlu["only_b"], mmlu["neither"]) == (100, 52, 8, 3, 37)
    assert mmlu["drop_points"] == pytest.approx(5.0) and mmlu["verdict"] == "cannot tell"
    assert "could only detect a loss of 8.4 points" in mmlu["verdict_reason"]  # 100 items, p = 0.23: noise
    assert mmlu["minimum_detectable_drop_points"] == stats.min_detectable_drop(100, 8, 3)
    assert mmlu["p_value"] == stats.mcnemar_exact(8, 3)
    assert mmlu["accuracy_a"]["value"] == 0.6 and mmlu["accuracy_b"]["value"] == 0.55
    facts = result["evals"]["facts"]
    assert facts["p_value"] == stats.fisher_exact(2, 100, 9, 100) and facts["difference_points"] == pytest.approx(7.0)
    low = result["evals"]["toolcalls"]["by_effort"]["low"]
    assert low["difference_points"] == 0 and low["p_value"] == pytest.approx(1.0)
    written = json.loads(out.read_text())
    assert written["evals"] == json.loads(json.dumps(result["evals"]))
    assert written["provenance"]["config"] == {"pass_mark_points": 1.0, "pass_on": "drop"}


def _paired(n: int, right_both: int, only_ref: int, only_build: int) -> tuple[list[bool], list[bool]]:
    neither = n - right_both - only_ref - only_build
    reference = [True] * right_both + [True] * only_ref + [False] * only_build + [False] * neither
    build = [True] * right_both + [False] * only_ref + [True] * only_build + [False] * neither
    return reference, build


@pytest.mark.parametrize("n, both, only_ref, only_build, rule, verdict, reason", [
    (1000, 600, 20, 20, "drop", "pass", "0.00 points lost, within"),
    (1000, 600, 20, 20, "at_worst", "cannot tell", "within the pass mark (1 point) but its one-sided 95% upper"),
    (4000, 2400, 20, 20, "at_worst", "pass", "at worst"),
    (1000, 500, 80, 10, "drop", "fail", "7.00 points lost, beyond"),
    (1000, 500, 80, 10, "at_worst", "fail", "7.00 points lost, beyond"),
    (100, 50, 2, 1, "drop", "cannot tell", "cannot be told from noise"),
])
def test_verdicts_pass_fail_or_cannot_tell(tmp_path, n, both, only_ref, only_build, rule, verdict, reason):
    reference, build = _paired(n, both, only_ref, only_build)
    result = paired.run(_inputs(tmp_path, reference, build), "original", "twx3",
                         {"pass_mark_points": 1.0, "pass_on": rule}, tmp_path / f"{rule}.json", True)
    mmlu = result["evals"]["mmlu"]
    assert (mmlu["verdict"], mmlu["pass_on"]) == (verdict, rule)
    assert reason in mmlu["verdict_reason"]


def test_a_reference_at_chance_cannot_be_judged(tmp_path):
    """Four choices: 27% right is not above chance (25%) by more than the mark; even a build that
    loses everything cannot fail against it."""
    reference, build = _paired(400, 0, 108, 0)
    result = paired.run(_inputs(tmp_path, reference, build, choices=4), "original", "twx3",
                         {"pass_mark_points": 1.0, "pass_on": "drop"}, tmp_path / "chance.json", True)
    mmlu = result["evals"]["mmlu"]
    assert mmlu["chance_rate"] == 0.25 and mmlu["verdict"] == "cannot tell"
    assert "is not above chance (25.0%)" in mmlu["verdict_reason"] and mmlu["drop_points"] == pytest.approx(27.0)


def test_a_pair_of_builds_is_not_judged(tmp_path):
    result = paired.run(_inputs(tmp_path, [True, False], [False, True]), "original", "twx3", {},
                         tmp_path / "pair.json", against_reference=False)
    assert "verdict" not in result["evals"]["mmlu"] and result["side_a_is_reference"] is False


def test_different_questions_are_refused(tmp_path):
    with pytest.raises(paired.CompareError, match="item q-1: original and twx3 read different questions"):
        paired.run(_inputs(tmp_path, [True, True], [True, False], build_hashes=["h0", "other"]), "original",
                    "twx3", {"pass_mark_points": 1.0, "pass_on": "drop"}, tmp_path / "x.json", True)
    assert not (tmp_path / "x.json").exists()
    with pytest.raises(paired.CompareError, match="did not read the same items"):
        paired.run(_inputs(tmp_path, [True, True, True], [True, False]), "original", "twx3",
                    {"pass_mark_points": 1.0, "pass_on": "drop"}, tmp_path / "x.json", True)


def test_a_file_of_another_build_is_refused(tmp_path):
    inputs = _inputs(tmp_path, [True], [False])
    inputs["b_facts"] = inputs["a_facts"]
    with pytest.raises(paired.CompareError, match="holds build 'original', not 'twx3'"):
        paired.run(inputs, "original", "twx3", {"pass_mark_points": 1.0, "pass_on": "drop"}, tmp_path / "x.json", True)
