"""results/serve/{build}/prediction.json before the server starts, memory.json once it serves.

memory.json gives, per card: `weights_gib`, `kv_cache_gib` (the room for the cache), `kv_cache_tokens`,
`kv_bytes_per_token`, `max_concurrency` at the configured length, each with its source (a log
line, /metrics, or a computation), our own computation beside vLLM's, and the prediction beside
both. On GPUs vLLM's log gives the weights ("Model loading took X GiB") and the room ("Available
KV cache memory"); the CPU build prints no weight line, so there the weights are the bytes of the
parameters and buffers vLLM loaded, which the moeshrink load format logs. Which of them vLLM's
CPU build holds depends on the CPU (memory.CPU_KINDS): the prediction has one figure per kind,
and the one for the kind vLLM took (the plugin's line says) is compared.
"""
from __future__ import annotations

import json
from pathlib import Path

from moeshrink.core.errors import MoeshrinkError
from moeshrink.core.machine import cpu_facts
from moeshrink.serve import memory
from moeshrink.serve.memory import GIB
from moeshrink.serve.serverlog import parse_cache_config_info, parse_log

TOLERANCE = 0.02  # measured within 2% of predicted


class MemoryCheckError(MoeshrinkError, RuntimeError):
    pass


def predict_for_serving(build_dir: Path, serve: dict, facts: memory.CpuFacts | None = None) -> dict:
    """The GPU prediction (top level, in serve.dtype or the checkpoint's own) and, under `cpu`, one
    prediction per dtype the build may be served in on a CPU (`memory.cpu_dtypes`) and kind of CPU vLLM's
    CPU build tells apart (memory.CPU_KINDS), with the dtype and kind of this machine's CPU (`facts`: this
    machine's, as torch reports them). The serve stage picks those of the machine it serves on (`for_cpu`)."""
    config = json.loads((build_dir / "config.json").read_text())
    tensors = memory.checkpoint_tensors(build_dir)
    card = serve["memory"]

    def figures(dtype: str, cpu: str | None) -> dict:
        served = memory.served_as(config, dtype)
        block = (serve["block_size"] or 16) if cpu is None else \
            memory.cpu_block_size(served, cpu, serve["block_size"])
        return {"serving_dtype": dtype, **memory.predict(
            tensors, served, card["card_gib"] * GIB, serve["gpu_memory_utilization"], card["reserve_gib"] * GIB,
            serve["tensor_parallel_size"], serve["kv_cache_dtype"], block, serve["max_model_len"], cpu=cpu)}

    facts = facts or cpu_facts()
    dtype_here = memory.serving_dtype(serve["dtype"], config, facts) if facts else None
    gpu_dtype = memory.serving_dtype(serve["dtype"], config, None)
    return {"card": card["card"], "card_gib": card["card_gib"], "reserve_gib": card["reserve_gib"],
            "utilisation": serve["gpu_memory_utilization"], **figures(gpu_dtype, None),
            "cpu": {"dtypes": {dtype: {kind: figures(dtype, kind) for kind in memory.CPU_KINDS}
                               for dtype in memory.cpu_dtypes(serve["dtype"], config)},
                    "dtype_here": dtype_here,
                    "kind_here": memory.cpu_kind(facts, memory.served_as(config, dtype_here)) if facts else None,
                    "facts_here": facts.as_dict() if facts else None}}


def for_cpu(prediction: dict, kind: str | None, dtype: str | None) -> dict:
    """The prediction for a CPU of `kind` serving in `dtype` (the GPU one where the prediction has no such
    CPU figures)."""
    kinds = prediction.get("cpu", {}).get("dtypes", {}).get(dtype, {})
    if kind is None or kind not in kinds:
        return prediction
    return {**prediction, **kinds[kind], "cpu_kind": kind}


def _within(measured: float, predicted: float) -> bool:
    return abs(measured - predicted) <= TOLERANCE * abs(predicted)


def measure(log_text: str, metrics_text: str, config: dict, serve: dict, prediction: dict, platform: str,
            cpu_kind: str | None = None, dtype: str | None = None) -> dict:
    """`cpu_kind`: the kind the serve stage found the serving machine's CPU to be; the plugin's
    line says which vLLM took, and the prediction for that kind is the one compared. `dtype`: the dtype the
    serve stage served in (None: the checkpoint's own)."""
    dtype = dtype or memory.serving_dtype("auto", config, None)
    config = memory.served_as(config, dtype)
    facts = parse_log(log_text)
    cache_info = parse_cache_config_info(metrics_text)
    tp = serve["tensor_parallel_size"]
    held = facts.get("loaded_weights", {}).get("cpu") or {}
    served_kind = held.get("kind") or cpu_kind
    if platform == "cpu":
        prediction = for_cpu(prediction, served_kind, dtype)
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
        tokens = int(cache_info["kv_cache_size_tokens"])
        tokens_source = "/metrics: vllm:cache_config_info kv_cache_size_tokens"
        concurrency = float(cache_info["kv_cache_max_concurrency"])
    elif "kv_cache_tokens" in facts:
        tokens, tokens_source = facts["kv_cache_tokens"], "log: vLLM's 'KV cache size: N tokens'"
        concurrency = facts["max_concurrency"]
    else:
        raise MemoryCheckError("neither /metrics nor the log gives the KV cache's size in tokens")
    block_size = int(cache_info.get("block_size") or serve["block_size"] or 16)
    per_token = memory.kv_cache_per_token(config, serve["kv_cache_dtype"] if cache_info.get("cache_dtype") in
                                          (None, "auto") else cache_info["cache_dtype"], tp)
    ours = memory.kv_tokens(kv_bytes, per_token, block_size, serve["max_model_len"])
    measured = {"weights_gib": weights_gib, "kv_cache_gib": kv_bytes / GIB, "kv_cache_tokens": tokens}
    predicted = {"weights_gib": prediction["weights_gib"], "kv_cache_gib": prediction["kv_cache_gib"],
                 "kv_cache_tokens": prediction["kv_cache_tokens"]}
    cpu_checks, cpu = {}, None
    if platform == "cpu" and held:
        predicted_cpu = prediction.get("weights", {}).get("cpu") or {}
        cpu = {"kind": served_kind, "kind_probed_by_serve": cpu_kind, "facts": held.get("facts"),
               "resident_weights_gib": held["resident_bytes"] / GIB,
               "packed_outside_parameters_gib": held["packed_outside_parameters_bytes"] / GIB,
               "predicted_resident_weights_gib": (predicted_cpu["resident_bytes"] / GIB
                                                  if "resident_bytes" in predicted_cpu else None),
               "decoded_layers_gib": facts.get("decoded_layers", {}).get("bytes", 0) / GIB,
               "source": "the plugin's 'moeshrink weights:' line: each storage once, plus the packed copies "
                         "vLLM's CPU kernels keep outside the parameters (oneDNN's at the bytes packed from); "
                         "decoded_layers_gib: the routed experts the plugin keeps decoded for vLLM's CPU MoE kernel "
                         "(its 'moeshrink decoded layers:' line; a serving-speed copy within "
                         "MOESHRINK_DECODED_LAYERS_MIB, not counted in the weights)"}
        if cpu_kind is not None:
            cpu_checks["cpu_kind_as_probed"] = served_kind == cpu_kind
    return {
        "platform": platform, "serving_dtype": dtype, "card": prediction["card"], "card_gib": prediction["card_gib"],
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
                   **{f"{key}_within_2pct_of_prediction": _within(measured[key], predicted[key]) for key in measured},
                   **cpu_checks},
        "cpu": cpu, "log_facts": facts, "cache_config_info": cache_info,
    }
