"""Hugging Face checkpoint folders: sharded safetensors, the weight index, and the manifest.

A manifest records what a folder holds (per shard: bytes, sha256, tensor count; every other file's
bytes and sha256) so later stages can refuse a truncated or altered shard by name.
"""
from __future__ import annotations

import json
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from moeshrink.core.errors import MoeshrinkError
from moeshrink.core.ioutil import atomic_path, atomic_write_json, sha256_file

if TYPE_CHECKING:  # reading headers and manifests needs no torch (the planner, the memory model)
    import torch

VERIFIED_DIR = ".verified"
INDEX_FILE = "model.safetensors.index.json"
MANIFEST_FILE = "manifest.json"


class CheckpointError(MoeshrinkError, ValueError):
    pass


def natural_key(name: str) -> list:
    """Sort `layers.10` after `layers.9`."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def plan_shards(sizes: list[tuple[str, int]], shards: int) -> list[list[str]]:
    """Split tensors, in order, into `shards` contiguous non-empty groups of about equal bytes.

    A tensor is never split; group g closes once the running total passes (g + 1) / shards of the total.
    """
    if shards < 1:
        raise CheckpointError(f"shard count must be at least 1, got {shards}")
    if len(sizes) < shards:
        raise CheckpointError(f"cannot spread {len(sizes)} tensors over {shards} shards")
    total = sum(size for _, size in sizes)
    groups: list[list[str]] = [[]]
    running = 0
    for position, (name, size) in enumerate(sizes):
        groups_to_open = shards - len(groups)
        tensors_left = len(sizes) - position
        if groups[-1] and groups_to_open and (running >= total * len(groups) / shards
                                              or tensors_left <= groups_to_open):
            groups.append([])
        groups[-1].append(name)
        running += size
    return groups


# a packed weight's block scales (MXFP4, as published upstream): `<name>.weight_scale` beside `<name>.weight`
SCALE_COMPANION = "_scale"


def is_weight_companion(name: str, names) -> bool:
    """`x.weight_scale` next to `x.weight`: stored, read and copied with it, never on its own."""
    return name.endswith(SCALE_COMPANION) and name[: -len(SCALE_COMPANION)] in names


def storage_units(tensors: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """Tensors that must share a shard, in natural order: a packed weight and its block scales."""
    units: dict[str, list[str]] = {}
    for name in sorted(tensors, key=natural_key):
        base = name[: -len(SCALE_COMPANION)] if is_weight_companion(name, tensors) else name
        units.setdefault(base, []).append(name)
    return units


def write_sharded(tensors: dict[str, torch.Tensor], out_dir: Path, shards: int,
                  metadata: dict[str, str] | None = None) -> dict:
    """Write shards and the index atomically; returns the index."""
    from moeshrink.core.shardio import save_shard

    units = storage_units(tensors)
    unit_groups = plan_shards([(key, sum(tensors[n].numel() * tensors[n].element_size() for n in members))
                               for key, members in units.items()], shards)
    groups = [[n for key in keys for n in units[key]] for keys in unit_groups]
    weight_map: dict[str, str] = {}
    for i, group in enumerate(groups):
        file_name = shard_name(i, len(groups))
        with atomic_path(out_dir / file_name) as tmp:
            save_shard({n: tensors[n].contiguous() for n in group}, tmp, {"format": "pt", **(metadata or {})})
        weight_map.update({n: file_name for n in group})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    atomic_write_json(out_dir / INDEX_FILE, index)
    return index


def read_header(path: Path, with_data: bool = True) -> dict:
    """A safetensors header, checked: a bad or truncated file raises naming the file. `with_data=False`
    takes a header-only file (as `huggingface_hub.get_safetensors_metadata` sees a remote checkpoint)."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100 << 20:
                raise CheckpointError(f"{path}: safetensors header length {length} is implausible")
            raw = f.read(length)
            if len(raw) < length:
                raise CheckpointError(f"{path}: truncated inside its header ({8 + len(raw)} bytes)")
            header = json.loads(raw)
            f.seek(0, 2)
            size = f.tell()
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from exc
    if not with_data:
        return header
    data_end = 8 + length + max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if size < data_end:
        raise CheckpointError(f"{path}: truncated ({size} bytes, header describes {data_end})")
    return header


def index_of(folder: Path) -> dict:
    """The weight index; a single-file checkpoint gets one synthesised from its header."""
    if (folder / INDEX_FILE).exists():
        with open(folder / INDEX_FILE) as f:
            return json.load(f)
    single = folder / "model.safetensors"
    if single.exists():
        header = read_header(single)
        return {"metadata": {}, "weight_map": {k: single.name for k in header if k != "__metadata__"}}
    raise CheckpointError(f"{folder}: no {INDEX_FILE} and no model.safetensors")


def build_manifest(folder: Path, source: dict, workers: int = 2, known_sha256: dict[str, str] | None = None) -> dict:
    """Describe every file of a checkpoint folder (symlinks followed). `known_sha256` lets a caller
    pass digests it already trusts (e.g. from Hugging Face cache blob names) to skip re-hashing."""
    index = index_of(folder)
    shard_files = sorted(set(index["weight_map"].values()))
    for name in shard_files:
        if not (folder / name).exists():
            raise CheckpointError(f"{folder}: shard {name} named by the index is missing")
    others = sorted(p.name for p in folder.iterdir()
                    if p.is_file() and p.name not in shard_files and p.name != MANIFEST_FILE
                    and not p.name.startswith("."))
    everything = shard_files + others
    known = known_sha256 or {}

    def describe(name: str) -> dict:
        path = folder / name
        digest = known.get(name) or remembered_digest(folder, name) or sha256_file(path)
        return {"file": name, "bytes": path.stat().st_size, "sha256": digest}

    with ThreadPoolExecutor(max_workers=workers) as pool:
        described = dict(zip(everything, pool.map(describe, everything)))
    shards = []
    for name in shard_files:
        remember_verified(folder, name, described[name]["sha256"])
        header = read_header(folder / name)
        shards.append({**described[name], "tensors": sum(1 for k in header if k != "__metadata__")})
    return {
        "source": source,
        "shards": shards,
        "files": [described[n] for n in others],
        "shard_count": len(shards),
        "total_bytes": sum(s["bytes"] for s in shards),
        "tensor_count": len(index["weight_map"]),
    }


def write_manifest(folder: Path, manifest: dict) -> None:
    atomic_write_json(folder / MANIFEST_FILE, manifest)


def _verified_marker(folder: Path, name: str) -> Path:
    return folder / VERIFIED_DIR / f"{name}.json"


def _file_identity(path: Path) -> dict:
    stat = path.stat()
    return {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino, "device": stat.st_dev}


def remember_verified(folder: Path, name: str, sha256: str) -> None:
    """Record that the file as it is now (size, mtime, inode) has this digest, like git's index: a
    later check re-hashes only a file that was touched since. A read-only folder keeps no record."""
    try:
        atomic_write_json(_verified_marker(folder, name), {"sha256": sha256, **_file_identity(folder / name)})
    except OSError:
        pass


def remembered_digest(folder: Path, name: str) -> str | None:
    """The digest recorded for this file, if it is untouched since (see remember_verified)."""
    marker = _verified_marker(folder, name)
    try:
        seen = json.loads(marker.read_text())
        return seen["sha256"] if seen == {"sha256": seen["sha256"], **_file_identity(folder / name)} else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def verify_shard(folder: Path, manifest: dict, name: str) -> None:
    """Raise naming the shard if its size or sha256 differs from the manifest. The digest is
    recomputed unless the file is untouched since it was last hashed (see remember_verified)."""
    entry = next((s for s in manifest["shards"] if s["file"] == name), None)
    if entry is None:
        raise CheckpointError(f"{folder / name}: not listed in the manifest")
    path = folder / name
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise CheckpointError(f"{path}: {size} bytes, manifest says {entry['bytes']} (truncated or replaced)")
    if remembered_digest(folder, name) == entry["sha256"]:
        return
    digest = sha256_file(path)
    if digest != entry["sha256"]:
        raise CheckpointError(f"{path}: sha256 {digest} does not match the manifest's {entry['sha256']}")
    remember_verified(folder, name, digest)


def verify_folder(folder: Path, manifest: dict) -> None:
    """Every shard of a checkpoint folder against its manifest (see verify_shard), then the index against the
    shards' headers (see check_index), before any tensor is read: a stage that reads several shards fails on
    the damaged one by name, not on whichever it opens first."""
    for shard in manifest["shards"]:
        verify_shard(folder, manifest, shard["file"])
    check_index(folder)


def check_index(folder: Path) -> dict[str, dict]:
    """Every shard the weight index names exists, is whole (read_header), and holds every tensor the index
    places in it; returns each shard's header. A checkpoint published with a tensor missing passes a check
    of its bytes against its own manifest, and a stage copying shard by shard would drop the tensor."""
    headers: dict[str, dict] = {}
    for name, shard in sorted(index_of(folder)["weight_map"].items(), key=lambda item: (item[1], item[0])):
        if shard not in headers:
            if not (folder / shard).exists():
                raise CheckpointError(f"{folder}: shard {shard} named by the index is missing")
            headers[shard] = read_header(folder / shard)
        if name not in headers[shard]:
            raise CheckpointError(f"{folder / shard}: tensor {name}, which the index places in this shard, is not in it")
    return headers
