"""results/serve/{build}/prediction.json before the server starts, memory.json once it serves.

memory.json gives, per card: `weights_gib`, `kv_cache_gib` (the room for the cache), `kv_cache_tokens`,
`kv_bytes_per_token`, `max_concurrency` at the configured length, each with its source (a log
line, /metrics, or a computation), our own computation beside vLLM's, and the prediction beside
both. On GPUs vLLM's log gives the weights ("Model loading took X GiB") and the room ("Available
KV cache memory"); the CPU build prints no weight line, so there the weights are the bytes of the
parameters and buffers vLLM loaded, which the moeshrink load format logs.
"""
from __future__ import annotations

import json
from pathlib import Path

from moeshrink import memory
from moeshrink.memory import GIB
from moeshrink.serverlog import parse_cache_config_info, parse_log

TOLERANCE = 0.02  # measured within 2% of predicted


class MemoryCheckError(RuntimeError):
    pass


def predict_for_serving(build_dir: Path, serve: dict) -> dict:
    config = json.loads((build_dir / "config.json").read_text())
    card = serve["memory"]
    figures = memory.predict(memory.checkpoint_tensors(build_dir), config, card["card_gib"] * GIB,
                             serve["gpu_memory_utilization"], card["reserve_gib"] * GIB, serve["tensor_parallel_size"],
                             serve["kv_cache_dtype"], serve.get("block_size") or 16, serve["max_model_len"])
    return {"card": card["card"], "card_gib": card["card_gib"], "reserve_gib": card["reserve_gib"],
            "utilisation": serve["gpu_memory_utilization"], **figures}


def _within(measured: float, predicted: float) -> bool:
    return abs(measured - predicted) <= TOLERANCE * abs(predicted)


def measure(log_text: str, metrics_text: str, config: dict, serve: dict, prediction: dict, platform: str) -> dict:
    facts = parse_log(log_text)
    cache_info = parse_cache_config_info(metrics_text)
    tp = serve["tensor_parallel_size"]
    if "model_loading_gib" in facts:
        weights_gib = facts["model_loading_gib"]
        weights_source = "log: vLLM's 'Model loading took X GiB memory' (per card)"
    elif "loaded_weights" in facts:
        weights_gib = facts["loaded_weights"]["weight_bytes"] / GIB  # each worker logs its own (one card's) share
        weights_source = ("bytes of the parameters and buffers vLLM loaded, from the moeshrink load format's "
                          "'moeshrink weights:' log line (the CPU build of vLLM prints no weight-memory line)")
    else:
        raise MemoryCheckError("the server log has neither 'Model loading took' nor 'moeshrink weights:' "
                               "(serve with --load-format moeshrink)")
    if cache_info.get("kv_cache_memory_bytes") not in (None, ""):
        kv_bytes = int(cache_info["kv_cache_memory_bytes"])
        kv_source = "/metrics: vllm:cache_config_info kv_cache_memory_bytes"
    elif "available_kv_cache_gib" in facts:
        kv_bytes = int(facts["available_kv_cache_gib"] * GIB)
        kv_source = "log: vLLM's 'Available KV cache memory: X GiB'"
    elif "cpu_kv_cache_gib" in facts:
        kv_bytes = int(facts["cpu_kv_cache_gib"] * GIB)
        kv_source = "log: vLLM's 'Explicitly set (X/Y) GiB for KV cache'"
    else:
        raise MemoryCheckError("neither /metrics nor the log says how much memory the KV cache has")
    if cache_info.get("kv_cache_size_tokens") is not None:
        tokens, tokens_source = int(cache_info["kv_cache_size_tokens"]), "/metrics: vllm:cache_config_info kv_cache_size_tokens"
        concurrency = float(cache_info["kv_cache_max_concurrency"])
    elif "kv_cache_tokens" in facts:
        tokens, tokens_source = facts["kv_cache_tokens"], "log: vLLM's 'KV cache size: N tokens'"
        concurrency = facts["max_concurrency"]
    else:
        raise MemoryCheckError("neither /metrics nor the log gives the KV cache's size in tokens")
    block_size = int(cache_info.get("block_size") or serve.get("block_size") or 16)
    per_token = memory.kv_cache_per_token(config, serve["kv_cache_dtype"] if cache_info.get("cache_dtype") in
                                          (None, "auto") else cache_info["cache_dtype"], tp)
    ours = memory.kv_tokens(kv_bytes, per_token, block_size, serve["max_model_len"])
    measured = {"weights_gib": weights_gib, "kv_cache_gib": kv_bytes / GIB, "kv_cache_tokens": tokens}
    predicted = {"weights_gib": prediction["weights_gib"], "kv_cache_gib": prediction["kv_cache_gib"],
                 "kv_cache_tokens": prediction["kv_cache_tokens"]}
    return {
        "platform": platform, "card": prediction["card"], "card_gib": prediction["card_gib"],
        "card_emulated": platform == "cpu", "tensor_parallel_size": tp,
        "weights_gib": weights_gib, "kv_cache_gib": kv_bytes / GIB, "kv_cache_tokens": tokens,
        "kv_bytes_per_token": per_token["bytes_per_token"], "max_concurrency": concurrency,
        "max_model_len": serve["max_model_len"], "block_size": block_size,
        "sources": {"weights_gib": weights_source, "kv_cache_gib": kv_source, "kv_cache_tokens": tokens_source,
                    "max_concurrency": tokens_source.replace("kv_cache_size_tokens", "kv_cache_max_concurrency"),
                    "kv_bytes_per_token": "computation from config.json: " + per_token["method"]},
        "ours": {"kv_cache_tokens": ours["tokens"], "blocks": ours["blocks"], "max_concurrency": ours["max_concurrency"]},
        "predicted": predicted,
        "checks": {"vllm_tokens_equal_ours": tokens == ours["tokens"],
                   **{f"{key}_within_2pct_of_prediction": _within(measured[key], predicted[key]) for key in measured}},
        "log_facts": facts, "cache_config_info": cache_info,
    }
