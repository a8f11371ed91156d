"""Approximate an AVX2-only x86 CPU on an AVX-512 or AMX machine, for timing only (bench/avx2/env.sh).

torch and vLLM decide their kernels from `torch.cpu._is_*_supported()` and `get_capabilities()`; once
torch is imported, those report no AVX-512, no AVX-512 BF16 and no AMX, so vLLM loads `_C_AVX2`, takes the
reference MLA backend and the `vec` MoE kernel, and moeshrink's machine facts say AVX2. ATen's own kernels
(ATEN_CPU_CAPABILITY=avx2) and oneDNN (ONEDNN_MAX_CPU_ISA=AVX2) are capped by env.sh. What is not covered:
code that reads /proc/cpuinfo or CPUID itself (the compiler Inductor targets; moeshrink's provenance lists
the real flags beside the facts)."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

_HIDDEN = ("avx512", "amx", "avx10", "avx_vnni")  # AVX2-only parts (Zen 2/3, Haswell-Skylake) have none


def _patch(torch_cpu) -> None:
    import types

    c_cpu = sys.modules["torch"]._C._cpu
    for name in ("_is_avx512_supported", "_is_avx512_vnni_supported", "_is_avx512_bf16_supported",
                 "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        if hasattr(torch_cpu, name):
            setattr(torch_cpu, name, lambda: False)
    real = torch_cpu.get_capabilities

    def get_capabilities():
        return types.MappingProxyType({k: (False if any(k.startswith(h) for h in _HIDDEN) else v)
                                       for k, v in real().items()})

    torch_cpu.get_capabilities = get_capabilities
    c_cpu._init_amx = lambda: False


class _AfterTorchCpu(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch.cpu":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _AfterTorchCpu())
