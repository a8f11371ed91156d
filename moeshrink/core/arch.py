"""Architecture adapters: what each tensor of a MoE checkpoint is, by name and config.json.

An adapter answers, for its family of checkpoints: which layers are MoE layers, how many routed
experts and which top-k they use, the router's tensors, how a routed expert's tensor is named
(per-expert tensors, or fused tensors whose first axis is the expert), and the class of every
tensor for size accounting.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from moeshrink.core.errors import MoeshrinkError

CLASSES = ("routed_experts", "shared_experts", "router", "attention", "embeddings", "other")


class UnsupportedArchitecture(MoeshrinkError, ValueError):
    pass


@dataclass(frozen=True)
class ExpertTensor:
    """A per-expert tensor: layer, expert index, projection and what follows it in the name."""
    layer: int
    expert: int
    projection: str
    suffix: str


class Adapter:
    name: str = ""
    architectures: tuple[str, ...] = ()
    experts_key: str = ""
    top_k_keys: tuple[str, ...] = ("num_experts_per_tok",)
    # per-expert tensor names: prefix (with the layer), expert index, projection, suffix
    expert_pattern: re.Pattern = re.compile(r"$^")
    # fused expert tensors (gpt-oss): the first axis is the expert
    fused_pattern: re.Pattern | None = None
    router_suffixes: tuple[str, ...] = ()
    shared_marker: str | None = None
    attention_marker: str = ".self_attn."

    # older names first: transformers 5 writes some families under a new key (Qwen3-MoE: num_local_experts)
    extra_experts_keys: tuple[str, ...] = ()

    def _experts_keys(self, config: dict) -> list[str]:
        return [k for k in (self.experts_key, *self.extra_experts_keys) if config.get(k) is not None]

    def num_experts(self, config: dict) -> int:
        keys = self._experts_keys(config)
        if not keys:
            raise KeyError(f"config.json has none of {(self.experts_key, *self.extra_experts_keys)}")
        return int(config[keys[0]])

    def with_num_experts(self, config: dict, count: int) -> dict:
        return {**config, **{k: count for k in self._experts_keys(config)}}

    def top_k(self, config: dict) -> int:
        for key in self.top_k_keys:
            if key in config:
                return int(config[key])
        raise KeyError(f"config.json has none of {self.top_k_keys}")

    def n_group(self, config: dict) -> int:
        return 1

    def moe_layers(self, config: dict) -> list[int]:
        return list(range(int(config["num_hidden_layers"])))

    def router_tensors(self, layer: int) -> dict[str, str]:
        """role (weight, bias, correction_bias) -> tensor name; every one has the expert on axis 0."""
        raise NotImplementedError

    expert_intermediate_key = "moe_intermediate_size"

    def expert_weight_count(self, config: dict) -> int:
        """Logical weights in all routed experts: gate, up and down projections of every expert."""
        per_expert = 3 * int(config["hidden_size"]) * int(config[self.expert_intermediate_key])
        return per_expert * self.num_experts(config) * len(self.moe_layers(config))

    # per-expert projections whose weight maps the expert's intermediate width back to the hidden size
    down_projections: tuple[str, ...] = ("down_proj", "w2")

    def expert_weight_shape(self, config: dict, projection: str) -> tuple[int, int]:
        """[rows, columns] of a per-expert projection weight as the model computes with it."""
        hidden, intermediate = int(config["hidden_size"]), int(config[self.expert_intermediate_key])
        return (hidden, intermediate) if projection in self.down_projections else (intermediate, hidden)

    def parse_expert(self, name: str) -> ExpertTensor | None:
        match = self.expert_pattern.match(name)
        if not match:
            return None
        return ExpertTensor(int(match["layer"]), int(match["expert"]), match["projection"], match["suffix"])

    def expert_name(self, ref: ExpertTensor) -> str:
        raise NotImplementedError

    def is_fused_expert(self, name: str) -> bool:
        return bool(self.fused_pattern and self.fused_pattern.match(name))

    def fused_layer(self, name: str) -> int | None:
        match = self.fused_pattern.match(name) if self.fused_pattern else None
        return int(match["layer"]) if match else None

    def router_layer(self, name: str) -> int | None:
        match = re.match(r"model\.layers\.(\d+)\.", name)
        if not match:
            return None
        layer = int(match[1])
        return layer if name in self.router_tensors(layer).values() else None

    def tensor_class(self, name: str) -> str:
        if self.parse_expert(name) or self.is_fused_expert(name):
            return "routed_experts"
        if self.router_layer(name) is not None:
            return "router"
        if self.shared_marker and self.shared_marker in name:
            return "shared_experts"
        if self.attention_marker in name:
            return "attention"
        if "embed_tokens" in name or name.startswith("lm_head"):
            return "embeddings"
        return "other"


class DeepseekV3Adapter(Adapter):
    """DeepSeek-V3 and Kimi K2/K3: per-expert tensors, sigmoid router with a score-correction bias,
    grouped top-k, shared experts, `first_k_dense_replace` dense layers."""
    name = "deepseek_v3"
    architectures = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM", "KimiK2ForCausalLM")
    experts_key = "n_routed_experts"
    expert_pattern = re.compile(r"^model\.layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<expert>\d+)\."
                                r"(?P<projection>gate_proj|up_proj|down_proj)\.(?P<suffix>.+)$")
    shared_marker = ".mlp.shared_experts."

    def n_group(self, config: dict) -> int:
        return int(config.get("n_group") or 1)

    def moe_layers(self, config: dict) -> list[int]:
        first = int(config.get("first_k_dense_replace", 0))
        every = int(config.get("moe_layer_freq", 1))
        return [i for i in range(int(config["num_hidden_layers"])) if i >= first and (i - first) % every == 0]

    def router_tensors(self, layer: int) -> dict[str, str]:
        return {"weight": f"model.layers.{layer}.mlp.gate.weight",
                "correction_bias": f"model.layers.{layer}.mlp.gate.e_score_correction_bias"}

    def expert_name(self, ref: ExpertTensor) -> str:
        return f"model.layers.{ref.layer}.mlp.experts.{ref.expert}.{ref.projection}.{ref.suffix}"


class Qwen3MoeAdapter(Adapter):
    """Qwen2/Qwen3-MoE: softmax router, per-expert tensors, optional shared expert (Qwen2)."""
    name = "qwen3_moe"
    architectures = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
    experts_key = "num_experts"
    extra_experts_keys = ("num_local_experts",)
    expert_pattern = DeepseekV3Adapter.expert_pattern
    shared_marker = ".mlp.shared_expert."

    def moe_layers(self, config: dict) -> list[int]:
        step = int(config.get("decoder_sparse_step", 1))
        dense = set(config.get("mlp_only_layers") or [])
        return [i for i in range(int(config["num_hidden_layers"])) if i not in dense and (i + 1) % step == 0]

    def router_tensors(self, layer: int) -> dict[str, str]:
        return {"weight": f"model.layers.{layer}.mlp.gate.weight"}

    def expert_name(self, ref: ExpertTensor) -> str:
        return f"model.layers.{ref.layer}.mlp.experts.{ref.expert}.{ref.projection}.{ref.suffix}"


class MixtralAdapter(Adapter):
    """Mixtral: softmax router `block_sparse_moe.gate`, experts w1 (gate), w2 (down), w3 (up)."""
    name = "mixtral"
    architectures = ("MixtralForCausalLM",)
    experts_key = "num_local_experts"
    expert_intermediate_key = "intermediate_size"
    expert_pattern = re.compile(r"^model\.layers\.(?P<layer>\d+)\.block_sparse_moe\.experts\.(?P<expert>\d+)\."
                                r"(?P<projection>w1|w2|w3)\.(?P<suffix>.+)$")

    def router_tensors(self, layer: int) -> dict[str, str]:
        return {"weight": f"model.layers.{layer}.block_sparse_moe.gate.weight"}

    def expert_name(self, ref: ExpertTensor) -> str:
        return f"model.layers.{ref.layer}.block_sparse_moe.experts.{ref.expert}.{ref.projection}.{ref.suffix}"


class GptOssAdapter(Adapter):
    """gpt-oss: fused expert tensors ([experts, ...] MXFP4 `_blocks` and `_scales`, bf16 `_bias`),
    router `mlp.router` with a bias."""
    name = "gpt_oss"
    architectures = ("GptOssForCausalLM",)
    experts_key = "num_local_experts"
    expert_intermediate_key = "intermediate_size"
    top_k_keys = ("num_experts_per_tok", "experts_per_token")
    fused_pattern = re.compile(r"^model\.layers\.(?P<layer>\d+)\.mlp\.experts\."
                               r"(?P<projection>gate_up_proj|down_proj)_(?P<suffix>blocks|scales|bias)$")

    def router_tensors(self, layer: int) -> dict[str, str]:
        return {"weight": f"model.layers.{layer}.mlp.router.weight", "bias": f"model.layers.{layer}.mlp.router.bias"}


ADAPTERS: tuple[Adapter, ...] = (DeepseekV3Adapter(), Qwen3MoeAdapter(), MixtralAdapter(), GptOssAdapter())


def adapter_for(config: dict) -> Adapter:
    architectures = config.get("architectures") or []
    for adapter in ADAPTERS:
        if any(a in adapter.architectures for a in architectures):
            return adapter
    supported = sorted(a for adapter in ADAPTERS for a in adapter.architectures)
    raise UnsupportedArchitecture(f"config.json architectures {architectures} is not supported; "
                                  f"supported: {', '.join(supported)}")


def check_has_moe(config: dict, adapter: Adapter) -> None:
    keys = (adapter.experts_key, *adapter.extra_experts_keys)
    if not adapter._experts_keys(config) or not adapter.moe_layers(config) or adapter.num_experts(config) < 2:
        raise UnsupportedArchitecture(f"the model has no MoE layers (config.json: {' or '.join(keys)} missing or < 2)")
