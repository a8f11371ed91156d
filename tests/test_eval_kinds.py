"""The eval registry is the one place an eval is known: a toy eval, registered by its own module
(tests/toy_eval.py) and edited in nowhere else, is accepted by the config, compared item by item and
judged, and gets its quality table in the report. (The rules schedule it too: test_partial_reruns.)"""
import copy

import pytest
from conftest import import_plugin

from moeshrink.compare.paired import compare
from moeshrink.compare.summary import build_summary, choose
from moeshrink.core import eval_kinds, stats
from moeshrink.core.config import ConfigError, validate
from moeshrink.evals import configured_evals
from moeshrink.report.load import Results
from moeshrink.report.render import Page


@pytest.fixture
def toy(monkeypatch):
    return import_plugin(monkeypatch, eval_kinds.REGISTRY, "toy_eval")


def test_the_builtin_evals_in_the_reports_order():
    assert list(eval_kinds.kinds()) == ["mmlu", "gsm8k", "facts", "toolcalls", "agreement"]
    assert eval_kinds.paired_ids() == ["mmlu", "gsm8k"]
    assert eval_kinds.get("mmlu").set_files({"dataset": "organism"}, "d") == {"test": "d/mc_test.jsonl",
                                                                             "dev": "d/mc_dev.jsonl"}
    assert eval_kinds.get("mmlu").set_files({"dataset": "cais/mmlu"}, "d") == {}
    with pytest.raises(eval_kinds.EvalKindError, match=r"^evals: 'bleu' is unknown; known: mmlu, gsm8k"):
        eval_kinds.get("bleu")


def records(rights: list[bool]) -> dict[str, dict]:
    return {str(i): {"id": str(i), "correct": right, "doc_hash": f"h{i}"} for i, right in enumerate(rights)}


def result(build: str, rights: list[bool]) -> dict:
    return {"build": build, "eval": "toy", "items": len(rights),
            "metrics": {"accuracy": stats.rate_with_ci(sum(rights), len(rights))}}


def test_a_toy_eval_needs_only_its_own_module(toy, default_config):
    config = copy.deepcopy(default_config)
    config["evals"]["toy"] = {"items": 200}
    validate(config)
    assert config["evals"]["toy"] == {"items": 200, "max_tokens": 24}  # its schema's defaults filled in
    assert configured_evals(config)[-1] == "toy"
    config["evals"]["toy"] = {"itemz": 200}
    with pytest.raises(ConfigError, match="evals.toy.itemz: unknown key"):
        validate(config)
    config["evals"]["toy"] = {"items": 200}
    validate(config)

    reference = [True] * 180 + [False] * 20
    build = [True] * 120 + [False] * 80
    compared = compare("original", "twx3", {"toy": result("original", reference)}, {"toy": result("twx3", build)},
                       {"toy": records(reference)}, {"toy": records(build)},
                       {"pass_mark_points": 2.0, "pass_on": "at_worst"})
    toy_compared = compared["evals"]["toy"]
    assert (toy_compared["only_a"], toy_compared["only_b"]) == (60, 0)
    assert toy_compared["verdict"] == "fail" and toy_compared["drop_points"] == pytest.approx(30.0)

    builds = {"twx3": build_summary(compared, {"kv_cache_tokens": 1000, "weights_gib": 1.0})}
    assert builds["twx3"]["verdicts"]["toy"]["verdict"] == "fail" and choose(builds)["failing"] == ["twx3"]
    results = Results(upstream={}, evals={"original": {"toy": result("original", reference)},
                                          "twx3": {"toy": result("twx3", build)}}, compare={"twx3": compared},
                      summary={"builds": builds, **choose(builds)})
    page = Page(results, config)
    table = str(page.quality_table("toy"))
    assert "90.0%" in table and "60.0%" in table and "fail: 30.00 points lost" in table
    assert page.passes("twx3") is False
