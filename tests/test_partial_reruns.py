"""Changing one config key reruns exactly its dependants: dry runs against the finished workflow of
the end-to-end test (the same session fixture), one key at a time."""
import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow


def dry_run_jobs(work: Path, config: dict | None = None) -> list[tuple[str, dict]]:
    """(rule, wildcards) of every job a dry run schedules, for config (or config.yaml as it is)."""
    args = [sys.executable, "-m", "snakemake", "-n", "report/r013.html"]
    if config is not None:
        changed = work / "changed.yaml"
        changed.write_text(yaml.safe_dump(config, sort_keys=False))
        args += ["--configfile", str(changed)]
    result = subprocess.run(args, cwd=work, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    jobs: list[tuple[str, dict]] = []
    for line in result.stdout.splitlines():  # group jobs (a server and its evals) print indented
        if rule := re.match(r"^\s*(?:local)?(?:rule|checkpoint) (\w+):$", line):
            jobs.append((rule.group(1), {}))
        elif (wildcards := re.match(r"^\s*wildcards: (.*)$", line)) and jobs:
            jobs[-1][1].update(item.split("=", 1) for item in wildcards.group(1).split(", "))
    return jobs


def _config(work: Path) -> dict:
    return yaml.safe_load((work / "config.yaml").read_text())


def _touches(job: tuple[str, dict], build: str) -> bool:
    rule, wildcards = job
    return wildcards.get("build") == build or build in (wildcards.get("a"), wildcards.get("b"))


def test_a_noop_rerun_schedules_nothing(workdir):
    assert dry_run_jobs(workdir) == []


def test_the_twx2_5_bit_budget_reruns_only_twx2_5_and_what_reads_it(workdir):
    config = copy.deepcopy(_config(workdir))
    config["builds"]["twx2_5"]["quantize"]["max_bits_per_weight"] = 2.6
    jobs = dry_run_jobs(workdir, config)
    rules = {rule for rule, _ in jobs}
    assert {"build_plan", "build_shard", "build_gather", "serve_prediction", "serve", "serve_memory", "eval",
            "eval_agreement", "compare", "compare_pair", "report"} <= rules, rules
    strays = [job for job in jobs if job[0] != "report" and not _touches(job, "twx2_5")]
    assert strays == [], strays
    shards = [job for job in jobs if job[0] == "build_shard"]
    assert len(shards) == len(list((workdir / "results/builds/twx2_5").glob("model-*.safetensors")))


def test_an_eval_item_count_reruns_only_the_evals_of_each_server_then_compare_and_report(workdir):
    """The changed eval reruns for every build. Its build's server must run for it, and Snakemake reruns
    every consumer of a service job that runs (dag.py: a consumer is spared only when its input is
    ancient and exists, and service outputs are deleted when their group ends), so the build's other
    evals and its memory job come along; nothing upstream of the servers does."""
    config = copy.deepcopy(_config(workdir))
    config["evals"]["gsm8k"]["items"] = config["evals"]["gsm8k"]["items"] // 2
    jobs = dry_run_jobs(workdir, config)
    builds = config["evals"]["gsm8k"]["builds"] or list(config["builds"])
    gsm8k = sorted(w["build"] for rule, w in jobs if rule == "eval" and w["eval"] == "gsm8k")
    assert gsm8k == sorted(builds)
    assert sorted(w["build"] for rule, w in jobs if rule == "serve") == sorted(builds)
    others = sorted(b for b in builds if b != config["reference_build"])
    assert sorted(w["build"] for rule, w in jobs if rule == "compare") == others
    allowed = {"eval", "eval_agreement", "eval_agreement_reference", "serve", "serve_memory", "compare",
               "compare_pair", "report"}
    assert {rule for rule, _ in jobs} <= allowed, jobs


def test_the_report_title_reruns_only_the_report(workdir):
    config = copy.deepcopy(_config(workdir))
    config["title"] = "R-013, re-titled"
    assert dry_run_jobs(workdir, config) == [("report", {})]
