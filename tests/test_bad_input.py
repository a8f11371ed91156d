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
