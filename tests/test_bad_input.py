"""Bad input to a build fails early and clearly, naming the problem, and never leaves a file that
looks complete."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moeshrink.compress import builder
from moeshrink.compress.builder import make_plan, rewrite_shard
from moeshrink.core.arch import UnsupportedArchitecture
from moeshrink.core.checkpoint import CheckpointError
from moeshrink.core.ioutil import sha256_file

ROOT = Path(__file__).resolve().parent.parent
TWX3 = {"label": "x", "quantize": {"format": "twx3"}}


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeshrink", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture
def damaged(published, tmp_path):
    """A private copy of the published organism that a test may damage."""
    folder, manifest = published
    copy = tmp_path / "upstream"
    shutil.copytree(folder, copy)
    return copy, manifest


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_altered_shard_fails_its_job_naming_the_file(damaged, tmp_path):
    folder, manifest = damaged
    plan = make_plan("x", TWX3, folder, manifest)
    shard = manifest["shards"][1]["file"]
    data = bytearray((folder / shard).read_bytes())
    data[-3] ^= 0x5A
    (folder / shard).write_bytes(bytes(data))
    out = tmp_path / "build"
    with pytest.raises(CheckpointError, match=f"{shard}: sha256 .* does not match"):
        rewrite_shard(folder, manifest, shard, plan, out / shard)
    (folder / shard).write_bytes(bytes(data[:-100]))
    with pytest.raises(CheckpointError, match=f"{shard}: .* bytes, manifest says"):
        rewrite_shard(folder, manifest, shard, plan, out / shard)
    assert leftovers(out) == []


def test_bad_header_fails_naming_the_file(damaged, tmp_path):
    folder, manifest = damaged
    plan = make_plan("x", TWX3, folder, manifest)
    shard = manifest["shards"][0]["file"]
    (folder / shard).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    rebuilt = {**manifest, "shards": [  # a manifest that agrees with the bad bytes
        {**s, "bytes": (folder / shard).stat().st_size, "sha256": sha256_file(folder / shard)} if s["file"] == shard else s
        for s in manifest["shards"]]}
    with pytest.raises(CheckpointError, match=f"{shard}: not a readable safetensors file"):
        rewrite_shard(folder, rebuilt, shard, plan, tmp_path / "build" / shard)
    assert leftovers(tmp_path / "build") == []


def test_an_interrupted_shard_job_leaves_nothing(published, tmp_path, monkeypatch):
    folder, manifest = published
    plan = make_plan("x", TWX3, folder, manifest)

    def killed(*args, **kwargs):
        Path(args[1]).write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(builder, "save_shard", killed)
    shard = manifest["shards"][0]["file"]
    with pytest.raises(KeyboardInterrupt):
        rewrite_shard(folder, manifest, shard, plan, tmp_path / "build" / shard)
    assert leftovers(tmp_path / "build") == []


@pytest.mark.parametrize("fraction", ["0", "1.5", "-0.25"])
def test_keep_fraction_outside_the_range_fails_before_work(published, tmp_path, fraction):
    folder, _ = published
    result = cli("prune", "--input", str(folder), "--output", str(tmp_path / "out"), "--keep-fraction", fraction)
    assert result.returncode == 2
    assert f"keep_fraction: {float(fraction)} is outside (0, 1]" in result.stderr
    assert not (tmp_path / "out").exists()


def test_unknown_format_is_refused_by_the_cli(published, tmp_path):
    result = cli("quantize", "--input", str(published[0]), "--output", str(tmp_path / "out"), "--format", "twx1")
    assert result.returncode == 2 and "invalid choice: 'twx1'" in result.stderr


def test_models_without_moe_layers_fail_clearly(published, tmp_path):
    folder, manifest = published
    dense = tmp_path / "dense"
    shutil.copytree(folder, dense)
    config = json.loads((folder / "config.json").read_text())
    (dense / "config.json").write_text(json.dumps({**config, "first_k_dense_replace": config["num_hidden_layers"]}))
    with pytest.raises(UnsupportedArchitecture, match="no MoE layers"):
        make_plan("x", TWX3, dense, manifest)
    (dense / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(UnsupportedArchitecture, match=r"\['LlamaForCausalLM'\] is not supported; supported: .*"
                                                       r"DeepseekV3ForCausalLM.*Qwen3MoeForCausalLM"):
        make_plan("x", TWX3, dense, manifest)


@pytest.mark.parametrize("command", [["prune", "--keep-fraction", "0.25"], ["quantize", "--format", "twx3"], ["twin"]])
def test_a_truncated_shard_is_named_before_any_read_and_nothing_is_left(damaged, tmp_path, command):
    """The fault a user met: one shard cut short, then `prune` (router_sum reads every router first) gave
    safetensors' own traceback naming no file, and left plan.json and shard 1 in the output folder."""
    folder, manifest = damaged
    shard = manifest["shards"][-1]["file"]
    with open(folder / shard, "r+b") as f:
        f.truncate((folder / shard).stat().st_size // 2)
    out = tmp_path / "out"
    result = cli(command[0], "--input", str(folder), "--output", str(out), *command[1:])
    assert result.returncode == 2, result.stderr
    assert f"{shard}: " in result.stderr and "manifest says" in result.stderr
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["upstream"]  # no output, no temporary folder


def test_a_failed_build_keeps_the_folder_that_was_there(published, tmp_path):
    """A CLI build writes beside its target and renames on success: a failure leaves an earlier result whole."""
    folder, _ = published
    out = tmp_path / "out"
    assert cli("prune", "--input", str(folder), "--output", str(out), "--keep-fraction", "0.5").returncode == 0
    before = {p.name: sha256_file(p) for p in out.iterdir() if p.is_file()}
    result = cli("prune", "--input", str(folder), "--output", str(out), "--method", "reap", "--keep-fraction", "0.5",
                 "--calibration", str(tmp_path / "missing.jsonl"))
    assert result.returncode != 0
    assert {p.name: sha256_file(p) for p in out.iterdir() if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_damaged_shard_stops_a_server_before_vllm_starts(damaged, tmp_path, monkeypatch, default_config):
    """The server's supervisor checks the build against its manifest first: the lessee's error names the
    shard, and vLLM is never started on bytes that are not the build's."""
    from moeshrink.serve import supervisor

    folder, manifest = damaged
    shard = manifest["shards"][0]["file"]
    data = bytearray((folder / shard).read_bytes())
    data[-1] ^= 0x01
    (folder / shard).write_bytes(bytes(data))
    monkeypatch.setattr(supervisor.VLLMServer, "start", lambda *a, **k: pytest.fail("vLLM started"))
    endpoint = tmp_path / "serve/endpoint.json"
    code = supervisor._serve("x", folder, default_config["serve"], tmp_path / "missing.json", endpoint.parent,
                             tmp_path / "server.log", 0, supervisor._Idle(endpoint.parent, 60))
    record = json.loads(endpoint.read_text())
    assert code == 1 and record["state"] == "failed"
    assert f"{shard}: sha256" in record["error"] and "does not match the manifest" in record["error"]


def test_an_eval_record_file_cut_mid_line_is_named_by_compare(tmp_path):
    from moeshrink.compare.paired import read_records
    from moeshrink.core.ioutil import UnreadableFile

    records = tmp_path / "mmlu.jsonl"
    records.write_text('{"id": "q1", "correct": true}\n{"id": "q2", "corr')
    with pytest.raises(UnreadableFile, match=r"mmlu.jsonl, line 2: not JSON .* rerunning the job"):
        read_records(records)
    (tmp_path / "mmlu.json").write_text('{"metrics": {"accur')
    with pytest.raises(UnreadableFile, match=r"mmlu.json: not JSON"):
        from moeshrink.core.ioutil import read_json
        read_json(tmp_path / "mmlu.json")


def test_a_full_disk_names_the_file_and_leaves_nothing_under_its_name(tmp_path, monkeypatch):
    """Simulated at the write call: the error names the file, and neither it nor a temporary name stays."""
    import errno

    from moeshrink.core.ioutil import UnwritableFile, atomic_write_json

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    target = tmp_path / "results/memory.json"
    with pytest.raises(UnwritableFile, match=r"memory.json: not written \(No space left on device\)"):
        atomic_write_json(target, {"weights_gib": 1.0})
    assert list(target.parent.iterdir()) == []
