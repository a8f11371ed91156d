"""Sharding, the weight index, manifests, and clear errors for broken shards."""
import json

import pytest
import torch
from safetensors import safe_open

from moeshrink.core.checkpoint import CheckpointError, build_manifest, plan_shards, read_header, verify_shard, write_sharded
from moeshrink.core.ioutil import sha256_file


@pytest.mark.parametrize("sizes,shards", [([5] * 10, 4), ([1, 100, 1, 1, 1], 4), ([7], 1), ([3, 3, 3, 3], 4),
                                          ([100, 1, 1, 1, 1, 1], 3)])
def test_plan_shards_is_contiguous_complete_and_non_empty(sizes, shards):
    named = [(f"t{i}", s) for i, s in enumerate(sizes)]
    groups = plan_shards(named, shards)
    assert len(groups) == shards and all(groups)
    assert [n for g in groups for n in g] == [n for n, _ in named]


def test_plan_shards_refuses_impossible_requests():
    with pytest.raises(CheckpointError, match="cannot spread 2 tensors over 3 shards"):
        plan_shards([("a", 1), ("b", 1)], 3)


def sample_tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {f"model.layers.{i}.w": torch.randn(16, 8) for i in range(12)} | {"lm_head.weight": torch.randn(4, 4)}


def test_write_sharded_index_and_manifest(tmp_path):
    tensors = sample_tensors()
    index = write_sharded(tensors, tmp_path, 4)
    assert json.loads((tmp_path / "model.safetensors.index.json").read_text()) == index
    assert sorted(index["weight_map"]) == sorted(tensors)
    seen = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(tmp_path / shard), "pt") as f:
            for name in f.keys():
                assert name not in seen, "a tensor is stored twice"
                seen[name] = f.get_tensor(name)
    assert all(torch.equal(seen[n], tensors[n]) for n in tensors)
    # layers 2 and 10 sort numerically, not as text
    assert list(index["weight_map"])[:3] == ["lm_head.weight", "model.layers.0.w", "model.layers.1.w"]
    (tmp_path / "config.json").write_text("{}")
    manifest = build_manifest(tmp_path, {"kind": "test"})
    assert manifest["shard_count"] == 4 and manifest["tensor_count"] == len(tensors)
    assert manifest["total_bytes"] == sum((tmp_path / s["file"]).stat().st_size for s in manifest["shards"])
    assert [f["file"] for f in manifest["files"]] == ["config.json", "model.safetensors.index.json"]
    for shard in manifest["shards"]:
        verify_shard(tmp_path, manifest, shard["file"])


def test_truncated_and_altered_shards_are_named(tmp_path):
    index = write_sharded(sample_tensors(), tmp_path, 2)
    manifest = build_manifest(tmp_path, {"kind": "test"})
    first, second = sorted(set(index["weight_map"].values()))
    data = (tmp_path / first).read_bytes()
    (tmp_path / first).write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match=f"{first}: truncated"):
        read_header(tmp_path / first)
    with pytest.raises(CheckpointError, match=f"{first}: .* bytes, manifest says"):
        verify_shard(tmp_path, manifest, first)
    altered = bytearray((tmp_path / second).read_bytes())
    altered[-1] ^= 0xFF
    (tmp_path / second).write_bytes(bytes(altered))
    with pytest.raises(CheckpointError, match=f"{second}: sha256 .* does not match"):
        verify_shard(tmp_path, manifest, second)
    (tmp_path / second).write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match=f"{second}: "):
        read_header(tmp_path / second)


def test_shards_are_byte_deterministic_whatever_the_metadata_order(tmp_path):
    from safetensors import safe_open

    from moeshrink.core.shardio import save_shard

    tensors = sample_tensors()
    digests = set()
    for attempt in range(6):
        metadata = dict(sorted({"format": "pt", "b": "2", "a": "1", "zz": f"{attempt % 1}"}.items(),
                               key=lambda kv: hash((kv[0], attempt))))
        save_shard(tensors, tmp_path / f"{attempt}.safetensors", metadata)
        digests.add(sha256_file(tmp_path / f"{attempt}.safetensors"))
    assert len(digests) == 1
    with safe_open(str(tmp_path / "0.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt", "a": "1", "b": "2", "zz": "0"}
        assert all(torch.equal(f.get_tensor(k), v) for k, v in tensors.items())


def test_an_untouched_shard_is_not_hashed_twice_but_a_touched_one_is(tmp_path, monkeypatch):
    import os

    from moeshrink.core import checkpoint

    index = write_sharded(sample_tensors(), tmp_path, 2)
    manifest = build_manifest(tmp_path, {"kind": "test"})
    first = sorted(set(index["weight_map"].values()))[0]
    hashed = []
    monkeypatch.setattr(checkpoint, "sha256_file", lambda path: hashed.append(path) or sha256_file(path))
    verify_shard(tmp_path, manifest, first)
    assert hashed == []
    data = bytearray((tmp_path / first).read_bytes())
    data[-1] ^= 1
    stat = (tmp_path / first).stat()
    (tmp_path / first).write_bytes(bytes(data))
    os.utime(tmp_path / first, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    with pytest.raises(CheckpointError, match="sha256 .* does not match"):
        verify_shard(tmp_path, manifest, first)
    assert len(hashed) == 1


def test_stored_tensors_are_copied_unchanged_and_the_digest_is_the_files(tmp_path):
    from moeshrink.core.shardio import save_shard, stored_tensor

    tensors = {**sample_tensors(), "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
               "big": torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)}
    first = tmp_path / "first.safetensors"
    assert save_shard(tensors, first, {"format": "pt"}) == sha256_file(first)
    header = read_header(first)
    mixed = {name: (stored_tensor(first, header, name) if i % 2 else tensor)
             for i, (name, tensor) in enumerate(sorted(tensors.items()))}
    second = tmp_path / "second.safetensors"
    assert save_shard(mixed, second, {"format": "pt"}) == sha256_file(first)
    with safe_open(str(second), "pt") as f:
        for name, tensor in tensors.items():
            assert torch.equal(f.get_tensor(name), tensor), name
