"""What the machine that computes a figure can do: its CPU's model and instruction-set extensions, and
the facts vLLM's CPU build branches on. Recorded in every result's provenance (a figure from one CPU
must never pass for another's) and read by the memory model and the plugin."""
from __future__ import annotations

import importlib.util
import os
import platform
from dataclasses import dataclass
from pathlib import Path

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


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)


@dataclass(frozen=True)
class CpuFacts:
    """What vLLM's CPU build branches on, as torch reports it on the machine that serves."""
    x86: bool
    amx_tile: bool      # torch.cpu._is_amx_tile_supported()
    avx512: bool        # torch.cpu._is_avx512_supported() (oneDNN's avx512_core)
    avx512_bf16: bool   # torch.cpu._is_avx512_bf16_supported() (vLLM loads its full _C library)
    avx512_fp16: bool   # get_capabilities()["avx512_fp16"]
    avx2_vnni_2: bool   # avx_vnni_int8 + avx_ne_convert: oneDNN's bf16/fp16 on AVX2 parts
    zentorch: bool      # AMD's zentorch installed: vLLM's Zen platform

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def cpu_facts() -> CpuFacts | None:
    """This machine's facts, or None where torch is not installed."""
    try:
        import torch
    except ImportError:
        return None
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return CpuFacts(x86=platform.machine().lower() in ("x86_64", "amd64"),
                    amx_tile=bool(torch.cpu._is_amx_tile_supported()),
                    avx512=bool(torch.cpu._is_avx512_supported()),
                    avx512_bf16=bool(torch.cpu._is_avx512_bf16_supported()),
                    avx512_fp16=bool(caps.get("avx512_fp16", False)),
                    avx2_vnni_2=bool(caps.get("avx_vnni_int8", False) and caps.get("avx_ne_convert", False)),
                    zentorch=importlib.util.find_spec("zentorch") is not None)


def compute_dtype(requested: str, own: str, facts: CpuFacts | None) -> str:
    """The dtype to compute a model in: `requested`, or for `auto` the checkpoint's own (`own`), except on
    an x86 CPU (`facts`; None: a GPU) without native arithmetic for it, where float32: an AVX2-only CPU
    emulates every bfloat16 operation (an organism forward took 5.4x as long in bfloat16 as in float32)."""
    if requested != "auto":
        return requested
    if facts is None or not facts.x86:
        return own
    native = {"bfloat16": facts.avx512_bf16 or facts.amx_tile or facts.avx2_vnni_2,
              "float16": facts.avx512_fp16 or facts.avx2_vnni_2}
    return own if native.get(own, True) else "float32"
