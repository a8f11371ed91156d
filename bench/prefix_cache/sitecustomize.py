"""Keep vLLM's prompt-prefix caching on for MLA models on a CPU without AMX, for measurement only
(bench/README.md, "Prompt-prefix caching on the CPU: faster, not yet exact").

vLLM 0.32's CPU platform turns prefix caching off for MLA models unless the CPU has AMX
(`platforms/cpu.py`, "forcing chunked prefill and prefix caching to be disabled"). Put this folder on the
server's PYTHONPATH as an absolute path (`bench/serve_profile.py --env PYTHONPATH=$PWD/bench/prefix_cache`: the
server runs in the run's folder; `bench/prefix_cache/check.py` does it itself): it imports `vllm.platforms.cpu`
and wraps the CPU platform's `check_and_update_config` so that caching stays on where the engine's config
asked for it. Not used by the workflow: a cached prefix changes
the log-probabilities that follow it (check.py)."""
from __future__ import annotations

import sys

from vllm.platforms import cpu  # every process of a vLLM server imports it anyway


def check_and_update_config(cls, vllm_config, check=cpu.CpuPlatform.check_and_update_config.__func__) -> None:
    asked = bool(vllm_config.cache_config.enable_prefix_caching)
    check(cls, vllm_config)
    if asked:
        vllm_config.cache_config.enable_prefix_caching = True
        sys.stderr.write("bench/prefix_cache: prefix caching kept on\n")


cpu.CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
