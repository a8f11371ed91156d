"""Changing one config key reruns exactly its dependants: dry runs against the finished workflow of
the end-to-end test (the same session fixture), one key at a time; and one real rerun."""
import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import copy_finished_workflow

pytestmark = pytest.mark.slow


def dry_run_jobs(work: Path, config: dict | None = None, target: str = "report/organism/r013.html",
                 env: dict | None = None) -> list[tuple[str, dict]]:
    """(rule, wildcards) of every job a dry run schedules, for config (or config.yaml as it is)."""
    args = [sys.executable, "-m", "snakemake", "-n", target]
    if config is not None:
        changed = work / "changed.yaml"
        changed.write_text(yaml.safe_dump(config, sort_keys=False))
        args += ["--configfile", str(changed), "--replace-workflow-config"]  # a whole config, not a preset
    result = subprocess.run(args, cwd=work, capture_output=True, text=True, timeout=600, env=env)
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


def job_keys(jobs: list[tuple[str, dict]]) -> list[str]:
    """One key per job: its rule and the wildcards that say which build and eval (shards counted)."""
    keys = []
    for rule, wildcards in jobs:
        parts = [f"{name}={wildcards[name]}" for name in ("build", "eval", "a", "b") if name in wildcards]
        keys.append(":".join([rule, *parts]))
    return sorted(keys)


class Study:
    """What the finished workflow holds: builds, evals, shards; the jobs a change should schedule."""

    def __init__(self, work: Path, config: dict):
        self.config = config
        self.builds = list(config["builds"])
        self.reference = config["reference_build"]
        self.others = [b for b in self.builds if b != self.reference]
        self.shards = len(list((work / "results/organism/builds" / self.reference).glob("model-*.safetensors")))
        self.evals = [e for e in ("mmlu", "gsm8k", "facts", "toolcalls", "agreement") if e in config["evals"]]

    def eval_builds(self, eval_id: str) -> list[str]:
        return self.config["evals"][eval_id].get("builds") or self.builds

    def eval(self, build: str, eval_id: str) -> list[str]:
        if build not in self.eval_builds(eval_id):
            return []
        if eval_id != "agreement":
            return [f"eval:build={build}:eval={eval_id}"]
        rule = "eval_agreement_reference" if build == self.reference else "eval_agreement"
        return [f"{rule}:build={build}:eval=agreement"]

    def compares(self) -> list[str]:
        return [f"compare:build={b}" for b in self.others] + \
            [f"compare_pair:a={a}:b={b}" for a, b in self.config["compare"]["pairs"]] + ["compare_summary"]

    def served(self, build: str, evals: list[str] | None = None) -> list[str]:
        """A build's prediction, server, memory and evals (all of them unless named)."""
        return [f"serve_prediction:build={build}", f"serve_memory:build={build}",
                *[key for e in (evals if evals is not None else self.evals) for key in self.eval(build, e)]]

    def made(self, build: str, evals: list[str] | None = None) -> list[str]:
        return [f"build_plan:build={build}", *[f"build_shard:build={build}"] * self.shards,
                f"build_gather:build={build}", *self.served(build, evals)]

    def pairs_with(self, build: str) -> list[str]:
        return [f"compare_pair:a={a}:b={b}" for a, b in self.config["compare"]["pairs"] if build in (a, b)]


def _set(config: dict, dotted: str, value) -> None:
    *path, last = dotted.split(".")
    for key in path:
        config = config[key]
    config[last] = value


def _reversed(value):
    if isinstance(value, dict):
        return {key: _reversed(value[key]) for key in reversed(list(value))}
    return value


def _reorder(config: dict, builds_too: bool = False) -> None:
    """Every mapping's keys in reverse order, at every level; the builds themselves only if asked (their
    order is the order of the report's rows)."""
    builds = list(config["builds"])
    reordered = _reversed(config)
    if not builds_too:
        reordered["builds"] = {build: reordered["builds"][build] for build in builds}
    config.clear()
    config.update(reordered)


# (what changes, how, the jobs it should schedule)
ROWS = [
    ("builds.twx3.label", lambda c: _set(c, "builds.twx3.label", "TWX3 relabelled"), lambda s: ["report"]),
    ("title", lambda c: _set(c, "title", "R-013, re-titled"), lambda s: ["report"]),
    ("serve.stop_timeout_s", lambda c: _set(c, "serve.stop_timeout_s", 45), lambda s: []),
    ("serve.startup_timeout_s", lambda c: _set(c, "serve.startup_timeout_s", 900), lambda s: []),
    ("evals.client.concurrency", lambda c: _set(c, "evals.client.concurrency", 4), lambda s: []),
    ("evals.client.retries", lambda c: _set(c, "evals.client.retries", 5), lambda s: []),
    ("evals.client.lm_eval_batch_size", lambda c: _set(c, "evals.client.lm_eval_batch_size", 3), lambda s: []),
    ("cluster.partition", lambda c: _set(c, "cluster.partition", "cpu"), lambda s: []),
    ("upstream.organism.train.threads", lambda c: _set(c, "upstream.organism.train.threads", 1), lambda s: []),
    ("upstream.organism.card.threads", lambda c: _set(c, "upstream.organism.card.threads", 2), lambda s: []),
    ("key order", lambda c: _reorder(c), lambda s: []),
    ("the builds' order", lambda c: _reorder(c, builds_too=True), lambda s: ["compare_summary", "report"]),  # ties
    ("plan.reserve_gib", lambda c: _set(c, "plan.reserve_gib", 12), lambda s: ["report"]),
    ("compare.pass_mark_points", lambda c: _set(c, "compare.pass_mark_points", 3.0),
     lambda s: [*[f"compare:build={b}" for b in s.others], "compare_summary", "report"]),  # pairs carry no verdict
    ("upstream.organism.card.passages", lambda c: _set(c, "upstream.organism.card.passages", 30),
     lambda s: ["organism_card", "report"]),
    ("builds.pruned75.prune.keep_fraction", lambda c: _set(c, "builds.pruned75.prune.keep_fraction", 0.5),
     lambda s: [*s.made("pruned75"), "compare:build=pruned75", *s.pairs_with("pruned75"), "compare_summary", "report"]),
    ("builds.twx2_5.quantize.max_bits_per_weight",
     lambda c: _set(c, "builds.twx2_5.quantize.max_bits_per_weight", 2.6),
     lambda s: [*s.made("twx2_5"), "compare:build=twx2_5", *s.pairs_with("twx2_5"), "compare_summary", "report"]),
    ("serve.max_model_len", lambda c: _set(c, "serve.max_model_len", 1024),
     lambda s: [*[key for b in s.builds for key in s.served(b)], *s.compares(), "report"]),
    ("serve.kv_cache_dtype", lambda c: _set(c, "serve.kv_cache_dtype", "bfloat16"),
     lambda s: [*[key for b in s.builds for key in s.served(b)], *s.compares(), "report"]),
    ("evals.gsm8k.items", lambda c: _set(c, "evals.gsm8k.items", c["evals"]["gsm8k"]["items"] // 2),
     lambda s: [*[key for b in s.builds for key in s.eval(b, "gsm8k")], *s.compares(), "report"]),
    ("evals.mmlu.shots", lambda c: _set(c, "evals.mmlu.shots", 3),
     lambda s: [*[key for b in s.builds for key in s.eval(b, "mmlu")], *s.compares(), "report"]),
    ("evals.mmlu.form", lambda c: _set(c, "evals.mmlu.form", "letter"),
     lambda s: [*[key for b in s.builds for key in s.eval(b, "mmlu")], *s.compares(), "report"]),
    ("serve.dtype", lambda c: _set(c, "serve.dtype", "float32"),
     lambda s: [*[key for b in s.builds for key in s.served(b)], *s.compares(), "report"]),
    ("evals.facts.max_tokens", lambda c: _set(c, "evals.facts.max_tokens", 120),
     lambda s: [*[key for b in s.builds for key in s.eval(b, "facts")], *s.compares(), "report"]),
    ("serve.idle_grace_s", lambda c: _set(c, "serve.idle_grace_s", 60), lambda s: []),
    # a sweep's grid point is an ordinary build: adding one makes, serves and evaluates it (the sweep's evals)
    # and re-renders the report; removing a build reruns only the summary and the report
    ("sweeps: a grid point added",
     lambda c: _set(c, "sweeps", {"bits": {"base": "twx2_5", "grid": {"quantize.max_bits_per_weight": [2.5]}}}),
     lambda s: [*s.made("bits_2_5", []), "eval:build=bits_2_5:eval=mmlu", "eval_agreement:build=bits_2_5:eval=agreement",
                "compare:build=bits_2_5", "compare_summary", "report"]),
    ("builds.twx2_5 removed", lambda c: (c["builds"].pop("twx2_5"), _set(c, "compare.pairs", [])),
     lambda s: ["compare_summary", "report"]),
    ("compare.size_limits_gib", lambda c: _set(c, "compare.size_limits_gib", [0.003]),
     lambda s: ["compare_summary", "report"]),

    ("serve.servers_per_machine", lambda c: _set(c, "serve.servers_per_machine", 2), lambda s: []),
]


def test_a_noop_rerun_schedules_nothing(workdir):
    assert dry_run_jobs(workdir) == []
    assert dry_run_jobs(workdir, target="report/r013.html") == []  # the main command's copy of it


@pytest.mark.parametrize("what, change, expected", [pytest.param(*row, id=row[0]) for row in ROWS])
def test_one_changed_key_reruns_exactly_what_reads_it(workdir, what, change, expected):
    config = copy.deepcopy(_config(workdir))
    change(config)
    assert config != _config(workdir) or "order" in what  # dicts compare equal in any order
    study = Study(workdir, _config(workdir))
    assert job_keys(dry_run_jobs(workdir, config)) == sorted(expected(study))


def test_another_run_name_is_a_study_of_its_own(workdir):
    """A config with another `run` name finds none of the finished study's files: the main command's
    dry run schedules the whole workflow again, every output under its own folders, and the copy at
    report/r013.html (its `run` param changed); its rules cannot even name the first study's report."""
    config = copy.deepcopy(_config(workdir))
    config["run"] = "second"
    jobs = dry_run_jobs(workdir, config, target="report/r013.html")
    rules = {rule for rule, _ in jobs}
    assert {"organism_data", "upstream", "build_plan", "serve_memory", "eval", "compare", "report",
            "report_latest"} <= rules, rules
    assert all(wildcards.get("run", "second") == "second" for _, wildcards in jobs)
    (workdir / "changed.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    foreign = subprocess.run([sys.executable, "-m", "snakemake", "-n", "report/organism/r013.html", "--configfile",
                              "changed.yaml", "--replace-workflow-config"], cwd=workdir, capture_output=True, text=True,
                             timeout=600)
    said = foreign.stdout + foreign.stderr
    assert foreign.returncode != 0 and "No rule to produce report/organism/r013.html" in said, said[-2000:]
    assert dry_run_jobs(workdir) == []  # the first study is still complete


def with_toy_eval() -> dict:
    """The environment of a run whose config asks for tests/toy_eval.py's eval (a plugin on the path)."""
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "MOESHRINK_PLUGINS": "toy_eval", "PYTHONPATH": path}


def test_a_plugin_eval_is_scheduled_and_run_from_its_registry_entry_alone(workdir, tmp_path):
    """tests/toy_eval.py registers an eval and is edited in nowhere else: a config that asks for it
    schedules that eval for every build, then the compares and the report that read it, and nothing
    else; run for one build, it leases the build's server, reads its set file and writes its records."""
    config = copy.deepcopy(_config(workdir))
    config["evals"]["toy"] = {"items": 6}
    study = Study(workdir, config)
    jobs = dry_run_jobs(workdir, config, env=with_toy_eval())
    assert job_keys(jobs) == sorted([*(f"eval:build={b}:eval=toy" for b in study.builds), *study.compares(),
                                     "report"])
    work = tmp_path / "workflow"
    copy_finished_workflow(workdir, work)
    (work / "toy.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    ran = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", "--configfile", "toy.yaml",
                          "--replace-workflow-config", "results/organism/evals/twx3/toy.json"], cwd=work,
                         capture_output=True, text=True, timeout=900, env=with_toy_eval())
    assert ran.returncode == 0, (ran.stdout + ran.stderr)[-3000:]
    result = json.loads((work / "results/organism/evals/twx3/toy.json").read_text())
    records = _lines(work / "results/organism/evals/twx3/toy.jsonl")
    assert result["items"] == 6 and len(records) == 6 and result["metrics"]["accuracy"]["total"] == 6
    assert all({"id", "correct", "doc_hash", "reply"} <= json.loads(line).keys() for line in records)
    assert result["server"] and result["provenance"]


def test_a_changed_eval_item_count_reruns_only_that_eval_and_starts_each_server_once(workdir, tmp_path):
    """The real rerun behind the table's evals.gsm8k.items row, on a copy of the finished workflow, with
    gsm8k narrowed to two builds (two server starts instead of four in CI): only those gsm8k jobs (and the
    compares and report that read them) run, each of the two builds' servers starts once for them and no
    other server starts, and every other eval's files keep their bytes and mtimes."""
    work = tmp_path / "workflow"
    copy_finished_workflow(workdir, work)
    config = copy.deepcopy(_config(work))
    config["evals"]["gsm8k"]["items"] = 12  # few: which jobs run is the point here, not the figures
    study = Study(work, _config(work))
    gsm8k_builds = [study.reference, study.others[0]]
    config["evals"]["gsm8k"]["builds"] = gsm8k_builds
    untouched = [p for p in (work / "results/organism/evals").glob("*/*") if not p.name.startswith("gsm8k")]
    untouched += list((work / "results/organism/serve").glob("*/memory.json"))
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in untouched}
    starts_before = {b: _lines(work / f"results/organism/serve/{b}/starts.jsonl") for b in study.builds}
    (work / "changed.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    result = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", "report/organism/r013.html", "--configfile",
                             "changed.yaml", "--replace-workflow-config"], cwd=work, capture_output=True, text=True,
                            timeout=1800)
    assert result.returncode == 0, result.stderr[-4000:]
    ran = sorted(re.findall(r"^\s*(?:local)?rule (\w+):", result.stderr + result.stdout, flags=re.M))
    assert ran == sorted(["eval"] * len(gsm8k_builds) + ["compare"] * len(study.others)
                         + ["compare_pair"] * len(config["compare"]["pairs"]) + ["compare_summary", "report"]), ran
    for build in study.builds:
        started = _lines(work / f"results/organism/serve/{build}/starts.jsonl")[len(starts_before[build]):]
        assert len(started) == (1 if build in gsm8k_builds else 0), (build, started)
        if build in gsm8k_builds:
            record = json.loads((work / f"results/organism/evals/{build}/gsm8k.json").read_text())
            assert record["items"] == config["evals"]["gsm8k"]["items"]
    for path, (mtime, data) in before.items():
        assert (path.stat().st_mtime_ns, path.read_bytes()) == (mtime, data), f"{path} was rewritten"


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []
