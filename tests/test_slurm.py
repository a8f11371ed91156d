"""The workflow through a real Slurm scheduler (profiles/slurm, Snakemake's Slurm executor plugin) to
one build's memory.json and eval JSONs, on a tiny organism. CI starts a one-node cluster on loopback
first (.ci/slurm-cluster.sh); elsewhere the test is skipped unless MOESHRINK_REQUIRE_SLURM=1."""
import copy
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml
from conftest import copy_workflow

ROOT = Path(__file__).resolve().parent.parent
BUILD = "original"
EVAL_IDS = ["mmlu", "gsm8k", "facts", "toolcalls", "agreement"]
pytestmark = pytest.mark.slow


def _cluster_problem() -> str | None:
    if importlib.util.find_spec("snakemake_executor_plugin_slurm") is None:
        return "the Slurm executor plugin is not installed"
    if shutil.which("sbatch") is None or shutil.which("sacct") is None:
        return "no Slurm client (sbatch, sacct) on this machine"
    ping = subprocess.run(["sinfo", "-h", "-o", "%a"], capture_output=True, text=True, timeout=30)
    if ping.returncode or "up" not in ping.stdout:
        return f"no Slurm cluster answers (sinfo: {ping.stderr.strip() or ping.stdout.strip()})"
    return None


@pytest.fixture(scope="module")
def cluster() -> None:
    problem = _cluster_problem()
    if problem:
        if os.environ.get("MOESHRINK_REQUIRE_SLURM") == "1":
            pytest.fail(f"MOESHRINK_REQUIRE_SLURM=1 but {problem} (.ci/slurm-cluster.sh starts one)")
        pytest.skip(problem)


def slurm_config() -> dict:
    """tests/configs/tiny.yaml with eval counts its tiny sets hold."""
    config = yaml.safe_load((ROOT / "tests/configs/tiny.yaml").read_text())
    evals = copy.deepcopy(config["evals"])
    evals["facts"]["passages"] = config["upstream"]["organism"]["data"]["sets"]["passages_test"]
    evals["toolcalls"].update(trials_per_case=config["upstream"]["organism"]["data"]["sets"]["toolcall_trials_per_case"],
                              runs=1, efforts=["low"], max_tokens=64)
    evals["agreement"].update(passages=20, max_tokens=64, exact_check_passages=4)
    evals["gsm8k"]["builds"] = None
    config["evals"] = evals
    return config


def test_one_build_served_and_evaluated_through_sbatch(cluster, tmp_path):
    work = copy_workflow(tmp_path / "workflow", "profiles")
    (work / "slurm.yaml").write_text(yaml.safe_dump(slurm_config(), sort_keys=False))
    targets = [f"results/organism/serve/{BUILD}/memory.json",
               *[f"results/organism/evals/{BUILD}/{e}.json" for e in EVAL_IDS]]
    started = datetime.now().strftime("%Y-%m-%dT%H:%M:%S")
    t0 = time.time()
    # the profile as a cluster user runs it; a one-node test cluster has 2 CPUs and ~20 GB, so no job
    # asks for more than 2 CPUs and the server group's memory stays under the node's
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", "--profile", "profiles/slurm", *targets, "--configfile", "slurm.yaml",
         "--replace-workflow-config",
         # the profile waits 20 s before it first asks sacct, then 10 s longer each time nothing finished:
         # on a one-node test cluster, where most jobs take seconds, each would wait that long to be seen done
         "--slurm-init-seconds-before-status-checks", "2",
         "--max-threads", "2", "--set-threads", "serve_prediction=2", "serve_memory=0", "eval=0", "eval_agreement=0",
         "eval_agreement_reference=0", "--set-resources", "serve_memory:mem_mb=6000", "eval:mem_mb=1500",
         "eval_agreement_reference:mem_mb=1500", "organism_train:mem_mb=4000", "organism_card:mem_mb=4000",
         "upstream:mem_mb=4000", "build_plan:mem_mb=4000", "build_shard:mem_mb=4000"],
        cwd=work, capture_output=True, text=True, timeout=2400)
    seconds = time.time() - t0
    slurm_logs = "\n".join(f"--- {p}\n{p.read_text()[-2000:]}" for p in sorted(work.glob(".snakemake/slurm_logs/**/*.log")))
    assert result.returncode == 0, f"{result.stderr[-5000:]}\n{slurm_logs[-8000:]}"

    memory = json.loads((work / f"results/organism/serve/{BUILD}/memory.json").read_text())
    assert memory["kv_cache_tokens"] == memory["ours"]["kv_cache_tokens"] > 0
    for eval_id in EVAL_IDS:
        record = json.loads((work / f"results/organism/evals/{BUILD}/{eval_id}.json").read_text())
        assert record["build"] == BUILD and record["record_count"] > 0

    # every job went through sbatch: sacct has one COMPLETED allocation per submitted job, and the
    # plugin's job comments name the rules, the server's group among them
    accounting = subprocess.run(["sacct", "-X", "-n", "-P", "-S", started, "-o", "JobID,State,Comment%200,AllocCPUS"],
                                capture_output=True, text=True, timeout=60, check=True).stdout
    rows = [line.split("|") for line in accounting.splitlines() if line.strip()]
    ours = [row for row in rows if "rule_" in row[2] or "group_" in row[2]]
    assert len(ours) >= 6, accounting
    assert all(row[1] == "COMPLETED" for row in ours), accounting
    comments = " ".join(row[2] for row in ours)
    for rule in ("organism_train", "upstream", "build_shard"):
        assert f"rule_{rule}" in comments, comments
    # the build's server, its memory job and its five evals: one allocation on one node
    [service_group] = [row for row in ours if "serve_memory" in row[2]]
    assert all(rule in service_group[2] for rule in ("_eval_", "eval_agreement_reference", "_serve_"))
    print(f"\nslurm: {len(ours)} sbatch jobs in {seconds:.0f} s\n{accounting}")
