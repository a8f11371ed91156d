"""The hf source (offline, from a populated Hugging Face cache) and the path source."""
import hashlib
import json
import os
import shutil

import pytest

from moeshrink.core.checkpoint import CheckpointError
from moeshrink.stages import upstream

REPO = "acme/tiny-moe"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def populate_hf_cache(cache, source_dir) -> None:
    """The hub cache layout: blobs named by sha256 (large files), snapshots of symlinks, refs."""
    repo = cache / ("models--" + REPO.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for item in sorted(source_dir.iterdir()):
        digest = hashlib.sha256(item.read_bytes()).hexdigest()
        shutil.copyfile(item, repo / "blobs" / digest)
        os.symlink(os.path.relpath(repo / "blobs" / digest, snapshot), snapshot / item.name)


@pytest.fixture()
def offline_cache(tmp_path, tiny_trained, monkeypatch):
    cache = tmp_path / "hub"
    populate_hf_cache(cache, tiny_trained)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def hf_cfg(revision=COMMIT, repo=REPO):
    return {"source": "hf", "hf": {"repo_id": repo, "revision": revision, "allow_patterns": ["*.json", "*.safetensors"]}}


def test_hf_source_offline_from_the_cache(offline_cache, tiny_trained, tmp_path):
    out = tmp_path / "upstream"
    manifest = upstream(hf_cfg(), out)
    assert manifest["source"]["kind"] == "hf" and manifest["revision"] == COMMIT
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DeepseekV3ForCausalLM"]
    for shard in manifest["shards"]:
        assert (out / shard["file"]).is_symlink()
        assert shard["sha256"] == hashlib.sha256((tiny_trained / shard["file"]).read_bytes()).hexdigest()
    assert manifest["total_bytes"] == (tiny_trained / "model.safetensors").stat().st_size
    assert json.loads((out / "manifest.json").read_text())["revision"] == COMMIT


def test_hf_source_names_a_missing_revision(offline_cache, tmp_path):
    with pytest.raises(CheckpointError, match=f"upstream.hf: {REPO}@f+ is not in the local Hugging Face cache"):
        upstream(hf_cfg(revision="f" * 40), tmp_path / "upstream")


@pytest.mark.parametrize("mode", ["link", "copy"])
def test_path_source(tiny_trained, tmp_path, mode):
    out = tmp_path / "upstream"
    manifest = upstream({"source": "path", "path": {"dir": str(tiny_trained), "mode": mode}}, out)
    assert (out / "model.safetensors").is_symlink() == (mode == "link")
    assert manifest["source"] == {"kind": "path", "dir": str(tiny_trained.resolve()), "mode": mode}
    assert manifest["shard_count"] == 1


def test_path_source_refuses_broken_folders(tiny_trained, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_trained, broken)
    (broken / "model.safetensors").write_bytes((broken / "model.safetensors").read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="model.safetensors: truncated"):
        upstream({"source": "path", "path": {"dir": str(broken), "mode": "link"}}, tmp_path / "up")
    (broken / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        upstream({"source": "path", "path": {"dir": str(broken), "mode": "link"}}, tmp_path / "up")


def test_a_new_source_replaces_what_the_old_one_left(tiny_trained, tmp_path):
    out = tmp_path / "upstream"
    out.mkdir()
    (out / "model-00001-of-00009.safetensors").write_text("stale")
    upstream({"source": "path", "path": {"dir": str(tiny_trained), "mode": "link"}}, out)
    assert not (out / "model-00001-of-00009.safetensors").exists()
