"""A workflow killed with SIGKILL (during a shard job, during an eval) and run again completes with the
same outputs as the uninterrupted run; a server the killed run left is found and stopped; no partly
written shard or JSON is ever taken as complete. Works on a copy of the end-to-end test's finished
workflow, so the uninterrupted outputs are at hand."""
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import copy_finished_workflow

pytestmark = pytest.mark.slow
BUILD = "twx3"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture()
def copy(workdir, tmp_path) -> Path:
    work = tmp_path / "workflow"
    return copy_finished_workflow(workdir, work)


def start(work: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "snakemake", "--cores", "2", *args], cwd=work,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def kill_when(process: subprocess.Popen, ready, timeout: float = 900) -> None:
    """SIGKILL the workflow's whole process group (Snakemake and its jobs) once `ready()` holds."""
    deadline = time.time() + timeout
    while not ready():
        assert process.poll() is None, "the workflow ended before it could be killed"
        assert time.time() < deadline, "the moment to kill never came"
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def rerun(work: Path, *targets: str) -> str:
    """What a user does after a crash: unlock, then run again (rerunning incomplete jobs)."""
    subprocess.run([sys.executable, "-m", "snakemake", "--unlock", *targets], cwd=work, capture_output=True,
                   timeout=300, check=True)
    result = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", "--rerun-incomplete", *targets],
                            cwd=work, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stderr


def _answers(records: Path) -> list[tuple]:
    return [(r["id"], r["predicted"], r["correct"]) for r in map(json.loads, records.read_text().splitlines())]


def servers_in(work: Path) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
                cwd = os.readlink(proc / "cwd")
            except OSError:
                continue
            if b"vllm.entrypoints" in cmdline and cwd == str(work):
                found.append(int(proc.name))
    return found


def test_killed_during_a_shard_job_reruns_to_the_same_bytes(copy):
    """The build made from scratch (as after a config change), killed while its shard jobs run."""
    build_dir = copy / "results/organism/builds" / BUILD
    shards = sorted(build_dir.glob("model-*.safetensors"))
    expected = {path.name: sha256(path) for path in shards}
    shutil.rmtree(build_dir)
    target = f"results/organism/builds/{BUILD}/manifest.json"
    started = time.time()
    process = start(copy, target)

    def shard_job_running() -> bool:
        # a shard being written under its temporary name, or a shard job a second into its work
        logs = [p for p in (copy / "logs/organism/builds" / BUILD).glob("model-*.log") if p.stat().st_mtime > started]
        return any(build_dir.glob(".model-*.tmp-*")) or any(time.time() - p.stat().st_mtime > 1 for p in logs)

    kill_when(process, shard_job_running)
    for path in build_dir.glob("model-*.safetensors"):  # whatever carries a final name is whole
        assert sha256(path) == expected[path.name], f"{path.name} was taken as complete while partly written"
    log = rerun(copy, target)
    assert {p.name: sha256(p) for p in sorted(build_dir.glob("model-*.safetensors"))} == expected, log
    assert not list(build_dir.glob(".*.tmp-*")), "temporary files left behind"
    manifest = json.loads((build_dir / "manifest.json").read_text())
    assert {shard["file"]: shard["sha256"] for shard in manifest["shards"]} == expected


def test_killed_during_an_eval_stops_the_orphan_server_and_reruns_to_the_same_figures(copy):
    result_file = copy / f"results/organism/evals/{BUILD}/mmlu.json"
    before = json.loads(result_file.read_text())
    answers_before = _answers(copy / f"results/organism/evals/{BUILD}/mmlu.jsonl")
    result_file.unlink()
    target = f"results/organism/evals/{BUILD}/mmlu.json"
    endpoint = copy / f"results/organism/serve/{BUILD}/endpoint.json"
    process = start(copy, target)

    def evaluating() -> bool:
        try:
            return json.loads(endpoint.read_text()).get("state") == "ready" and bool(servers_in(copy))
        except (OSError, ValueError):
            return False

    kill_when(process, evaluating)
    time.sleep(2)
    assert not result_file.exists(), "a killed eval left a result under its final name"
    orphans = servers_in(copy)
    rerun(copy, target)
    after = json.loads(result_file.read_text())
    assert after["metrics"] == before["metrics"] and after["items"] == before["items"]
    assert _answers(copy / f"results/organism/evals/{BUILD}/mmlu.jsonl") == answers_before
    deadline = time.time() + 60
    while time.time() < deadline and (servers_in(copy) or any(Path(f"/proc/{pid}").exists() for pid in orphans)):
        time.sleep(1)
    assert not servers_in(copy), "a server outlived the rerun"
    assert not [pid for pid in orphans if Path(f"/proc/{pid}").exists()], "the killed run's server was never stopped"


def test_a_server_killed_mid_eval_fails_the_workflow_within_a_minute_naming_the_build(copy):
    """The build's vLLM server dies while its evals run: the jobs using it fail at once with a message
    naming the build (never waiting out serve.startup_timeout_s), the workflow ends within a minute,
    nothing is left half-written or running, and the build's finished memory.json stays (no job owns
    the server, so none is removed with a failed one)."""
    memory = copy / f"results/organism/serve/{BUILD}/memory.json"
    evals = [copy / f"results/organism/evals/{BUILD}/{name}.json" for name in ("mmlu", "gsm8k", "toolcalls")]
    for path in [memory, *evals]:
        path.unlink()
    endpoint = copy / f"results/organism/serve/{BUILD}/endpoint.json"
    output = copy / "snakemake.out"
    with open(output, "w") as sink:
        # --prioritize: the memory job first, so that the evals run after it on the same server; at equal
        # priority Snakemake may run them first (it did once a rule was added to the Snakefile)
        process = subprocess.Popen([sys.executable, "-m", "snakemake", "--cores", "2", str(memory.relative_to(copy)),
                                    *[str(p.relative_to(copy)) for p in evals],
                                    "--prioritize", str(memory.relative_to(copy))], cwd=copy, stdout=sink,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 900
        while not memory.exists():
            assert process.poll() is None, output.read_text()[-3000:]
            assert time.time() < deadline, "the build was never served"
            time.sleep(0.5)
        time.sleep(5)  # the evals are sending requests now
        server_pid = json.loads(endpoint.read_text())["server_pid"]
        os.killpg(server_pid, signal.SIGKILL)
        killed = time.time()
        process.wait(timeout=300)
        elapsed = time.time() - killed
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    text = output.read_text()
    assert process.returncode != 0, text[-3000:]
    assert elapsed < 60, f"the workflow took {elapsed:.0f} s to end after the server died"
    logs = "".join(p.read_text() for p in (copy / f"logs/organism/evals/{BUILD}").glob("*.log"))
    assert f"the vLLM server of build {BUILD!r}" in logs or f"build {BUILD!r}" in logs, logs[-3000:]
    assert f"build={BUILD}" in text
    for path in [*(copy / f"results/organism/evals/{BUILD}").glob("*.json"),
                 *(copy / f"results/organism/serve/{BUILD}").glob("*.json")]:
        json.loads(path.read_text())  # whatever carries a final name is whole
    assert not list((copy / f"results/organism/evals/{BUILD}").glob(".*.tmp-*")), "temporary files left behind"
    assert not servers_in(copy), "the build's server outlived its failed jobs"
    assert json.loads(memory.read_text())["build"] == BUILD
