"""The real workflow on a tiny organism (tests/configs/tiny.yaml) through every build's manifest:
Snakemake schedules the plan, shard and gather jobs; the CLI writes the same bytes."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import copy_workflow

from moeshrink.core.ioutil import sha256_file

ROOT = Path(__file__).resolve().parent.parent
BUILDS = ["original", "pruned75", "reap50", "twx3", "twx2_5"]


def snakemake(work: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", *args, "--configfile", "tiny.yaml",
                           "--replace-workflow-config"],
                          cwd=work, capture_output=True, text=True, timeout=1200)


def fresh_run(tmp_path_factory) -> Path:
    work = copy_workflow(tmp_path_factory.mktemp("tiny"))
    shutil.copyfile(ROOT / "tests/configs/tiny.yaml", work / "tiny.yaml")
    result = snakemake(work, *[f"results/organism/builds/{b}/manifest.json" for b in BUILDS])
    if result.returncode:
        logs = "\n".join(f"--- {p}\n" + p.read_text()[-3000:] for p in sorted((work / "logs").rglob("*.log")))
        pytest.fail(f"snakemake failed:\n{result.stderr[-4000:]}\n{logs}")
    return work


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return fresh_run(tmp_path_factory)


def manifest(work: Path, build: str) -> dict:
    return json.loads((work / f"results/organism/builds/{build}/manifest.json").read_text())


def test_every_build_has_its_size_and_bits(work):
    upstream = json.loads((work / "results/organism/upstream/manifest.json").read_text())
    original, pruned, reap, twx3, twx2_5 = (manifest(work, b) for b in BUILDS)
    experts = json.loads((work / "results/organism/upstream/config.json").read_text())["n_routed_experts"]
    assert original["total_bytes"] == upstream["total_bytes"]
    assert original["routed_expert_bits_per_weight"] == 4.25
    assert pruned["num_experts"] == reap["num_experts"] == experts // 2
    assert pruned["bytes_by_class"]["routed_experts"] == original["bytes_by_class"]["routed_experts"] // 2
    assert twx3["routed_expert_bits_per_weight"] <= 3.25
    assert 2.25 < twx2_5["routed_expert_bits_per_weight"] <= 2.75
    for build in (pruned, reap, twx3, twx2_5):
        for cls in ("attention", "embeddings", "shared_experts"):
            assert build["bytes_by_class"][cls] == original["bytes_by_class"][cls]
        assert build["provenance"]["config"], "a manifest says how it was made"
    assert twx2_5["total_bytes"] < twx3["total_bytes"] < original["total_bytes"]


def test_reap_and_router_sum_choose_by_their_own_scores(work):
    reap = json.loads((work / "results/organism/builds/reap50/plan.json").read_text())["prune"]
    router_sum = json.loads((work / "results/organism/builds/pruned75/plan.json").read_text())["prune"]
    assert reap["method"] == "reap" and reap["calibration_sha256"]
    assert reap["layers"].keys() == router_sum["layers"].keys()
    assert any(reap["layers"][k]["scores"] != router_sum["layers"][k]["scores"] for k in reap["layers"])


def test_the_cli_writes_the_same_bytes_as_the_rules(work, tmp_path):
    out = tmp_path / "twx2_5"
    result = subprocess.run([sys.executable, "-m", "moeshrink", "quantize", "--input",
                             str(work / "results/organism/upstream"),
                             "--output", str(out), "--format", "twx2.5"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    built = manifest(work, "twx2_5")
    for shard in built["shards"]:
        assert sha256_file(out / shard["file"]) == shard["sha256"], shard["file"]
    assert json.loads((out / "config.json").read_text()) == \
        json.loads((work / "results/organism/builds/twx2_5/config.json").read_text())


def test_a_second_run_schedules_nothing(work):
    result = snakemake(work, "-n", *[f"results/organism/builds/{b}/manifest.json" for b in BUILDS])
    assert result.returncode == 0, result.stderr
    assert "Nothing to be done" in result.stdout + result.stderr


def checkpoint_digests(work: Path) -> dict[str, str]:
    files = [work / "results/organism/organism/trained/model.safetensors",
             *sorted((work / "results/organism/upstream").glob("*.safetensors")),
             *sorted((work / "results/organism/builds").glob("*/*.safetensors"))]
    return {str(path.relative_to(work)): sha256_file(path) for path in files}


def test_two_clean_runs_make_identical_checkpoints(work, tmp_path_factory):
    """Training (seeded, fixed thread count), publication, pruning (router_sum and reap) and both TWX
    formats are deterministic: a second run from nothing writes the same bytes."""
    first = checkpoint_digests(work)
    assert len(first) == 1 + 4 + 4 * len(BUILDS)
    assert checkpoint_digests(fresh_run(tmp_path_factory)) == first
