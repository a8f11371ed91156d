"""What a vLLM server says about its memory: log lines (GPU and CPU builds of vLLM) and the
`vllm:cache_config_info` metric. Each parser returns only what it found; absent lines are absent
keys, never zeros."""
from __future__ import annotations

import json
import re

from moeshrink_kernels import DECODED_LAYERS_LINE, WEIGHTS_LINE

GIB = 2**30

# vLLM 0.3x log lines (v1/worker/gpu_model_runner.py, gpu_worker.py, cpu_worker.py, core/kv_cache_utils.py)
_MODEL_LOADING = re.compile(r"Model loading took ([\d.]+) GiB memory and ([\d.]+) seconds")
_AVAILABLE_KV = re.compile(r"Available KV cache memory: ([\d.]+) GiB")
_CPU_KV_SET = re.compile(r"(?:Explicitly|Auto) set \(([\d.]+)/([\d.]+)\) GiB for KV cache")
_KV_SIZE = re.compile(r"(GPU|CPU|XPU|TPU)[^:\n]* KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) "
                      r"tokens per request: ([\d.]+)x")
_CHECKPOINT = re.compile(r"Checkpoint size: ([\d.]+) GiB")
_METRIC_LINE = re.compile(r'^vllm:cache_config_info\{(?P<labels>.*)\}\s+(?P<value>\S+)$', re.M)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_log(text: str) -> dict:
    """Memory facts from a server log: `model_loading_gib` (GPU), `available_kv_cache_gib` (GPU),
    `cpu_kv_cache_gib` (CPU), `kv_cache_tokens`, `max_concurrency`, `max_model_len`, `device`,
    `checkpoint_gib`, `loaded_weights` (the plugin's line: bytes of the parameters and buffers),
    `decoded_layers` (the CPU expert path's last line: layers it keeps decoded, their bytes)."""
    found: dict = {}
    if match := _MODEL_LOADING.search(text):
        found["model_loading_gib"], found["model_loading_seconds"] = float(match[1]), float(match[2])
    if match := _AVAILABLE_KV.search(text):
        found["available_kv_cache_gib"] = float(match[1])
    if match := _CPU_KV_SET.search(text):
        found["cpu_kv_cache_gib"] = float(match[1])
    if match := _KV_SIZE.search(text):
        found["device"] = match[1]
        found["kv_cache_tokens"] = int(match[2].replace(",", ""))
        found["max_model_len"] = int(match[3].replace(",", ""))
        found["max_concurrency"] = float(match[4])
    if match := _CHECKPOINT.search(text):
        found["checkpoint_gib"] = float(match[1])
    if match := re.search(re.escape(WEIGHTS_LINE) + r" (\{.*\})", text):
        found["loaded_weights"] = json.loads(match[1])
    if kept := re.findall(re.escape(DECODED_LAYERS_LINE) + r" (\{.*\})", text):
        found["decoded_layers"] = json.loads(kept[-1])
    return found


def parse_cache_config_info(metrics_text: str) -> dict:
    """The labels of `vllm:cache_config_info` (engine 0), numbers converted where they are numbers."""
    for match in _METRIC_LINE.finditer(metrics_text):
        labels = dict(_LABEL.findall(match["labels"]))
        if labels.get("engine", "0") != "0":
            continue
        return {key: _number(value) for key, value in labels.items()}
    return {}


def _number(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            continue
    return {"None": None, "True": True, "False": False}.get(text, text)


# ------------------------------------------------------------------------------ why a start failed
_CAUSES = [
    (re.compile(r"out of memory|OutOfMemoryError|Cannot allocate memory|not enough (GPU )?memory|"
                r"less than requested memory for kv", re.I),
     "out of memory: the build does not fit (lower max_model_len or the KV cache room, raise tensor parallelism)"),
    (re.compile(r"PackedExpertsError: (.+)"), "the moeshrink plugin refused the build: {0}"),
    (re.compile(r"Unknown quantization method|quantization method .* is not supported|Unsupported quantization", re.I),
     "unsupported format: vLLM does not know this quantization method (is the moeshrink plugin installed?)"),
    (re.compile(r"(KeyError|ValueError|TypeError): (.+)"), "bad config or checkpoint: {1}"),
    (re.compile(r"Address already in use"), "the port was taken"),
]


def likely_cause(log_text: str) -> str:
    for pattern, message in _CAUSES:
        if match := pattern.search(log_text):
            return message.format(*match.groups()) if match.groups() else message
    return "unknown (see the log lines below)"
