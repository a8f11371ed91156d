"""The three upstream sources, all ending in one checkpoint folder plus its manifest:
the organism (published by `moeshrink.organism.publish`), a pinned Hugging Face repo (through
huggingface_hub, offline-capable from a populated cache), or a local folder (linked or copied)."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from moeshrink.core.checkpoint import CheckpointError, check_index
from moeshrink.core.ioutil import atomic_path

SHA256_NAME = re.compile(r"^[0-9a-f]{64}$")


def clear_folder(folder: Path, keep: tuple[str, ...] = ()) -> None:
    """Remove what an earlier run left, so a switch of source never mixes two checkpoints."""
    folder.mkdir(parents=True, exist_ok=True)
    for item in folder.iterdir():
        if item.name in keep:
            continue
        if item.is_dir() and not item.is_symlink():
            shutil.rmtree(item)
        else:
            item.unlink()


def check_checkpoint_folder(folder: Path) -> dict:
    """A usable Hugging Face model folder: config.json, and every shard the index names, readable."""
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a folder")
    if not (folder / "config.json").exists():
        raise CheckpointError(f"{folder}: config.json is missing")
    try:
        config = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{folder}/config.json: not valid JSON ({exc})") from exc
    check_index(folder)
    return config


def place_files(source: Path, out_dir: Path, mode: str) -> list[str]:
    """Link (absolute symlinks to the resolved files) or copy the top-level files of `source`."""
    placed = []
    for item in sorted(source.iterdir()):
        if not item.is_file() or item.name.startswith("."):
            continue
        target = out_dir / item.name
        if mode == "link":
            if target.exists() or target.is_symlink():
                target.unlink()
            os.symlink(item.resolve(), target)
        else:
            with atomic_path(target) as tmp:
                shutil.copyfile(item, tmp)
        placed.append(item.name)
    return placed


def from_path(folder: Path, out_dir: Path, mode: str) -> dict:
    folder = folder.expanduser().resolve()
    check_checkpoint_folder(folder)
    files = place_files(folder, out_dir, mode)
    return {"source": {"kind": "path", "dir": str(folder), "mode": mode}, "revision": None, "files": files,
            "known_sha256": {}}


def from_hf(repo_id: str, revision: str, allow_patterns: list[str], out_dir: Path) -> dict:
    """Resolve the pinned snapshot (from the local cache when HF_HUB_OFFLINE=1) and link its files.

    Hub cache blobs of large files are named by their sha256, which the manifest reuses.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot = Path(snapshot_download(repo_id=repo_id, revision=revision, allow_patterns=allow_patterns))
    except LocalEntryNotFoundError as exc:
        raise CheckpointError(f"upstream.hf: {repo_id}@{revision} is not in the local Hugging Face cache "
                              f"and the hub cannot be reached ({exc})") from exc
    check_checkpoint_folder(snapshot)
    files = place_files(snapshot, out_dir, "link")
    known = {}
    for name in files:
        blob = (snapshot / name).resolve().name
        if SHA256_NAME.match(blob):
            known[name] = blob
    return {"source": {"kind": "hf", "repo_id": repo_id, "allow_patterns": allow_patterns,
                       "snapshot": str(snapshot)},
            "revision": revision, "files": files, "known_sha256": known}
