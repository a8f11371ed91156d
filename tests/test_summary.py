"""Which build (results/<run>/compare/summary.json), from comparison and memory JSONs: the rules the
page states, applied in the compare stage and never again in the report."""
import json

import pytest

from moeshrink.compare.summary import SummaryError, run


def compared(build: str, verdicts: dict[str, str], agreement: float | None = None, kl: float = 0.01,
             drop: float = 1.0, decided: float | None = None) -> dict:
    evals = {eval_id: {"verdict": verdict, "verdict_reason": f"{verdict} because", "drop_points": drop}
             for eval_id, verdict in verdicts.items()}
    if agreement is not None:
        evals["agreement"] = {"top1_agreement": {"value": agreement}, "mean_kl": {"value": kl},
                              "decided_top1_agreement": {"value": decided}}
    return {"a": "original", "b": build, "evals": evals}


def summarise(tmp_path, builds: dict[str, tuple], size_limits_gib: list[float] = (),
              reference: tuple[int, float] = (4000, 10.0)) -> dict:
    """builds: build -> (comparison, KV-cache tokens[, weights GiB per card: 1.0]); the reference's (tokens, GiB)."""
    compares, memory = {}, {}
    for build, (comparison, tokens, *weights) in {"original": (None, *reference), **builds}.items():
        if comparison is not None:
            compares[build] = tmp_path / f"{build}.json"
            compares[build].write_text(json.dumps(comparison))
        memory[build] = tmp_path / f"{build}-memory.json"
        memory[build].write_text(json.dumps({"kv_cache_tokens": tokens, "weights_gib": weights[0] if weights else 1.0}))
    run(compares, memory, "original", tmp_path / "summary.json", size_limits_gib)
    return json.loads((tmp_path / "summary.json").read_text())


def test_fidelity_by_agreement_room_by_cache_and_no_cannot_tell_counted_as_a_pass(tmp_path):
    summary = summarise(tmp_path, {
        "pruned75": (compared("pruned75", {"mmlu": "cannot tell", "gsm8k": "fail"}, 0.58), 9000),
        "twx3": (compared("twx3", {"mmlu": "pass", "gsm8k": "pass"}, 0.95, 0.002), 5000),
        "twx2_5": (compared("twx2_5", {"mmlu": "pass", "gsm8k": "pass"}, 0.94, 0.006), 6000),
        "twx2": (compared("twx2", {"mmlu": "cannot tell", "gsm8k": "pass"}, 0.99), 7000),
    })
    assert summary["qualifying"] == ["twx3", "twx2_5"]
    assert summary["failing"] == ["pruned75"] and summary["undecided"] == ["twx2"]
    assert (summary["fidelity"], summary["room"]) == ("twx3", "twx2_5")
    assert summary["builds"]["twx2"]["passes"] is None
    assert summary["builds"]["pruned75"]["verdicts"]["gsm8k"] == {"verdict": "fail", "reason": "fail because"}
    assert summary["rules"]["qualifies"].startswith("passes the pass mark on every paired eval")


def test_without_agreement_the_smallest_drop_and_ties_go_to_the_first_build(tmp_path):
    summary = summarise(tmp_path, {
        "a": (compared("a", {"mmlu": "pass"}, drop=1.5), 100),
        "b": (compared("b", {"mmlu": "pass"}, drop=0.5), 100),
        "c": (compared("c", {"mmlu": "pass"}, drop=0.5), 100),
    })
    assert (summary["fidelity"], summary["room"]) == ("b", "a")


def test_nothing_qualifies_and_nothing_judged(tmp_path):
    summary = summarise(tmp_path, {"a": (compared("a", {}), 100), "b": (compared("b", {"mmlu": "fail"}), 100)})
    assert summary["qualifying"] == [] and summary["fidelity"] is None and summary["room"] is None
    assert summary["builds"]["a"]["passes"] is None and summary["undecided"] == []


def test_a_comparison_of_another_build_is_refused(tmp_path):
    with pytest.raises(SummaryError, match=r"b.json: compares 'a' with 'original', not 'b'"):
        summarise(tmp_path, {"b": (compared("a", {"mmlu": "pass"}), 100)})


def test_fidelity_ranks_by_agreement_where_the_reference_decides(tmp_path):
    """All positions: twx2_5 agrees more (coin tosses where the reference hardly prefers a token);
    where it decides, twx3 does: twx3 is the fidelity pick."""
    summary = summarise(tmp_path, {
        "twx3": (compared("twx3", {"mmlu": "pass"}, 0.947, 0.002, decided=0.995), 5000),
        "twx2_5": (compared("twx2_5", {"mmlu": "pass"}, 0.949, 0.006, decided=0.990), 6000),
    })
    assert summary["fidelity"] == "twx3"
    assert summary["builds"]["twx2_5"]["decided_top1_agreement"] == 0.990


def test_the_smallest_passing_build_the_most_faithful_within_each_size_and_the_frontier(tmp_path):
    """Sizes in GiB per card; agreement where the reference decides. v2_3 is beaten by twx3 (as small, more
    faithful): off the frontier; pruned fails: on the frontier (nothing as small is as faithful) but never chosen."""
    summary = summarise(tmp_path, {
        "twx3": (compared("twx3", {"mmlu": "pass"}, 0.95, 0.002, decided=0.99), 3900, 7.0),
        "v2_3": (compared("v2_3", {"mmlu": "pass"}, 0.95, 0.004, decided=0.98), 3900, 7.0),
        "twx2_5": (compared("twx2_5", {"mmlu": "pass"}, 0.93, 0.006, decided=0.97), 6000, 6.0),
        "v2_2_25": (compared("v2_2_25", {"mmlu": "cannot tell"}, 0.90, 0.02, decided=0.95), 6500, 5.0),
        "pruned": (compared("pruned", {"mmlu": "fail"}, 0.60, 0.9, decided=0.7), 9000, 3.0),
    }, size_limits_gib=[6.5, 8.0, 4.0])
    assert summary["smallest"] == "twx2_5"  # v2_2_25 and pruned are smaller but do not pass
    assert summary["within_size"] == [{"size_gib": 6.5, "build": "twx2_5"}, {"size_gib": 8.0, "build": "twx3"},
                                      {"size_gib": 4.0, "build": None}]
    frontier = summary["frontier"]
    assert frontier["size_agreement"] == ["original", "twx3", "twx2_5", "v2_2_25", "pruned"]
    assert frontier["size_kl"] == ["original", "twx3", "twx2_5", "v2_2_25", "pruned"]
    assert frontier["kv_agreement"] == ["original", "twx2_5", "v2_2_25", "pruned"]  # twx3: less room than the original
    assert frontier["size_mmlu"] == ["original", "pruned"]  # every build drops 1 point: the smallest beats the rest
    assert summary["reference_figures"] == {"top1_agreement": 1.0, "decided_top1_agreement": 1.0, "mean_kl": 0.0,
                                            "drops": {"mmlu": 0.0}, "kv_cache_tokens": 4000, "weights_gib": 10.0}
