"""Memory per card of a served build, computed from config.json and safetensors headers alone.

What vLLM holds per card (tensor parallel size `tp`, no expert parallelism):
- weights: every checkpoint tensor at the dtype vLLM keeps it in (floats at the serving dtype,
  except the router's score-correction bias in float32; packed codes and scales as stored),
  divided by `tp` where vLLM shards it and whole where it replicates it (norms, the router, MLA's
  down-projections `q_a_proj`/`kv_a_proj_with_mqa`, GQA key/value heads when there are fewer
  than `tp`); plus what vLLM derives at load: MLA's absorbed up-projections (one more copy of
  `kv_b_proj` in the serving dtype), the rotary cos/sin cache, and the TWX layout tables;
- KV cache per token and layer: MLA (kv_lora_rank + qk_rope_head_dim) x cache dtype bytes, on
  every card; GQA 2 x kv heads per card x head_dim x cache dtype bytes;
- tokens the room holds, as vLLM counts them: blocks = room // (block bytes x layers), then
  blocks / ceil(max_model_len / block_size) requests of max_model_len tokens.
"""
from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from moeshrink.arch import adapter_for

GIB = 2**30
DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "U8": 1, "I8": 1, "I16": 2, "I32": 4, "I64": 8,
               "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "BOOL": 1}
CACHE_DTYPE_BYTES = {"auto": None, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
SERVING_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

# names of tensors vLLM keeps whole on every card (everything else is split over tensor parallelism)
REPLICATED = re.compile(r"norm\.(weight|bias)$|\.mlp\.gate\.weight$|\.mlp\.router\.|e_score_correction_bias$"
                        r"|\.q_a_proj\.|\.kv_a_proj_with_mqa\.|\.o_proj\.bias$")
GQA_KV = re.compile(r"\.self_attn\.(k_proj|v_proj)\.")


class MemoryModelError(ValueError):
    pass


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def header_tensors(path: Path) -> list[Tensor]:
    """The tensors a safetensors file describes, from its header alone (a header-only file, as
    `huggingface_hub.get_safetensors_metadata` sees a remote checkpoint, is enough)."""
    with open(path, "rb") as f:
        raw_length = f.read(8)
        if len(raw_length) < 8:
            raise MemoryModelError(f"{path}: not a safetensors file (no header length)")
        (length,) = struct.unpack("<Q", raw_length)
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise MemoryModelError(f"{path}: unreadable safetensors header ({exc})") from exc
    return [Tensor(name, entry["dtype"], tuple(entry["shape"])) for name, entry in header.items()
            if name != "__metadata__"]


def checkpoint_tensors(folder: Path) -> list[Tensor]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").exists():
        shards = ["model.safetensors"]
    else:
        raise MemoryModelError(f"{folder}: no model.safetensors.index.json and no model.safetensors")
    return [t for shard in shards for t in header_tensors(folder / shard)]


def _serving_dtype_bytes(config: dict) -> int:
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16").replace("torch.", "")
    return SERVING_DTYPE_BYTES.get(dtype, 2)


def is_mla(config: dict) -> bool:
    return config.get("kv_lora_rank") is not None


def _held_bytes(tensor: Tensor, serving_bytes: int) -> int:
    """Bytes vLLM keeps for one checkpoint tensor: floats at the serving dtype, the score-correction
    bias in float32, integer (packed) tensors as stored."""
    if tensor.dtype in ("BF16", "F16", "F32", "F64"):
        per = 4 if tensor.name.endswith("e_score_correction_bias") else serving_bytes
        return tensor.numel * per
    return tensor.numel * DTYPE_BYTES[tensor.dtype]


def weights_per_card(tensors: list[Tensor], config: dict, tp: int = 1) -> dict:
    """Weight bytes on one card, with the parts that make them up."""
    serving = _serving_dtype_bytes(config)
    kv_heads = int(config.get("num_key_value_heads") or config.get("num_attention_heads") or 1)
    sharded = replicated = 0
    for tensor in tensors:
        held = _held_bytes(tensor, serving)
        if REPLICATED.search(tensor.name):
            replicated += held
        elif GQA_KV.search(tensor.name) and kv_heads < tp:  # each card keeps one whole head
            replicated += held // kv_heads
        else:
            sharded += held
    derived = {"mla_absorbed": 0, "rotary_cache": 0, "twx_layout": 0}
    heads = int(config.get("num_attention_heads") or 1)
    if is_mla(config):
        per_head = int(config["qk_nope_head_dim"]) + int(config["v_head_dim"])
        layers = int(config["num_hidden_layers"])
        derived["mla_absorbed"] = layers * heads * per_head * int(config["kv_lora_rank"]) * serving // tp
        rotary_dim = int(config["qk_rope_head_dim"])
    else:
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        rotary_dim = int(head_dim * float(config.get("partial_rotary_factor", 1.0)))
    derived["rotary_cache"] = int(config.get("max_position_embeddings", 0)) * rotary_dim * serving
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") == "twx":
        derived["twx_layout"] = sum(len(experts) * 3 * 8 for experts in quant["expert_bits"].values())
    total = sharded // tp + replicated + sum(derived.values())
    return {"bytes": total, "sharded_bytes": sharded // tp, "replicated_bytes": replicated, "derived": derived}


def kv_cache_per_token(config: dict, cache_dtype: str, tp: int = 1) -> dict:
    """Bytes one token takes in one layer's cache on one card, the layers that hold it, and how."""
    per = CACHE_DTYPE_BYTES.get(cache_dtype)
    if cache_dtype not in CACHE_DTYPE_BYTES:
        raise MemoryModelError(f"serve.kv_cache_dtype {cache_dtype!r}: known {sorted(CACHE_DTYPE_BYTES)}")
    per = per or _serving_dtype_bytes(config)
    layers = int(config["num_hidden_layers"])
    if is_mla(config):
        width = int(config["kv_lora_rank"]) + int(config["qk_rope_head_dim"])
        method = (f"MLA: (kv_lora_rank {config['kv_lora_rank']} + qk_rope_head_dim {config['qk_rope_head_dim']}) "
                  f"x {per} bytes x {layers} layers, the same on every card")
    else:
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        per_card_heads = max(1, kv_heads // tp)
        width = 2 * per_card_heads * head_dim
        method = (f"GQA: 2 x {per_card_heads} kv heads per card x head_dim {head_dim} x {per} bytes x {layers} layers")
    return {"bytes_per_token_per_layer": width * per, "layers": layers,
            "bytes_per_token": width * per * layers, "method": method}


def kv_tokens(room_bytes: int, per_token: dict, block_size: int, max_model_len: int) -> dict:
    """Tokens vLLM's cache holds in `room_bytes`, counted the way vLLM counts them."""
    block_bytes = block_size * per_token["bytes_per_token_per_layer"] * per_token["layers"]
    blocks = max(0, room_bytes) // block_bytes
    concurrency = blocks / math.ceil(max_model_len / block_size)
    return {"blocks": blocks, "tokens": int(concurrency * max_model_len), "max_concurrency": concurrency}


def predict(tensors: list[Tensor], config: dict, card_bytes: float, utilisation: float, reserve_bytes: float,
            tp: int, cache_dtype: str, block_size: int, max_model_len: int) -> dict:
    """Weights, room and tokens per card: room = utilisation x card - weights - reserve."""
    adapter_for(config)  # refuses architectures the workflow does not know, naming them
    weights = weights_per_card(tensors, config, tp)
    room = int(utilisation * card_bytes - weights["bytes"] - reserve_bytes)
    per_token = kv_cache_per_token(config, cache_dtype, tp)
    tokens = kv_tokens(room, per_token, block_size, max_model_len)
    return {"tensor_parallel_size": tp, "weights_bytes": weights["bytes"], "weights_gib": weights["bytes"] / GIB,
            "weights": weights, "kv_cache_bytes": room, "kv_cache_gib": room / GIB, "fits": room > 0,
            "kv_bytes_per_token": per_token["bytes_per_token"], "kv_method": per_token["method"],
            "kv_cache_tokens": tokens["tokens"], "max_concurrency": tokens["max_concurrency"],
            "block_size": block_size, "max_model_len": max_model_len}
