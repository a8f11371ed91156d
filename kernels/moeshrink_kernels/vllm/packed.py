"""What the packed formats' vLLM methods and configs share: a MoE method whose routed experts stay
packed (subclasses say which parameters a layer has, where a checkpoint tensor goes in them, and which
custom op computes), and a quantization config that quantizes only the routed experts."""
from __future__ import annotations

import re
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.utils import set_weight_attrs

from moeshrink.core.errors import MoeshrinkError
from moeshrink_kernels.vllm.ops import cpu_kernel_for, logger


class PackedExpertsError(MoeshrinkError, ValueError):
    pass


def layer_index(prefix: str) -> int:
    match = re.search(r"layers\.(\d+)\.", prefix + ".")
    if not match:
        raise PackedExpertsError(f"cannot tell the layer of MoE module {prefix!r}")
    return int(match[1])


def check_single_partition(moe, what: str) -> None:
    parallel = getattr(moe, "moe_parallel_config", None)
    for attribute in ("tp_size", "ep_size", "dp_size"):
        if parallel is not None and getattr(parallel, attribute, 1) > 1:
            raise PackedExpertsError(f"{what}: serving with {attribute} > 1 is not supported yet (TP/EP/DP = 1)")


def copy_checked(target: torch.Tensor, source: torch.Tensor, weight_name: str) -> None:
    if tuple(target.shape) != tuple(source.shape) or source.dtype != target.dtype:
        raise PackedExpertsError(f"{weight_name}: expected {target.dtype} {tuple(target.shape)}, "
                                 f"the checkpoint has {source.dtype} {tuple(source.shape)}")
    target.copy_(source)


class PackedExpertsMethod(FusedMoEMethodBase):
    """Routed experts held packed: subclasses say which parameters a layer has (`parameters`),
    where one checkpoint tensor goes in them (`target`), and which custom op computes (`run`)."""

    def __init__(self, moe, layer_name: str):
        super().__init__(moe)
        self.layer_name = layer_name

    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
        check_single_partition(self.moe, self.layer_name)
        activation = getattr(self.moe.activation, "value", self.moe.activation)
        if activation != "silu":
            raise PackedExpertsError(f"{self.layer_name}: packed experts compute SiLU-gated MLPs, "
                                     f"the model's experts use {activation!r}")
        self.kernel = cpu_kernel_for(self.moe)
        logger.info_once("moeshrink: routed experts of %s computed by %s", type(self).__name__,
                         f"vLLM's CPU MoE kernel (isa {self.kernel.isa})" if self.kernel.isa else
                         "Triton (CUDA)" if not self.kernel.isa and torch.cuda.is_available() else "torch")
        self.hidden, self.intermediate = hidden_size, intermediate_size_per_partition
        for name, data in self.parameters(layer, num_experts).items():
            param = torch.nn.Parameter(data, requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(param, {"weight_loader": self._loader(name)})

    def _loader(self, param_name: str):
        def load(param, loaded_weight: torch.Tensor, weight_name: str, shard_id: str, expert_id: int,
                 return_success: bool = False):
            rows = self.intermediate if param_name.startswith("w13") else self.hidden
            row_start = self.intermediate if shard_id == "w3" else 0
            target = self.target(param.data, param_name, expert_id)[row_start:row_start + rows]
            copy_checked(target, loaded_weight, weight_name)
            return True if return_success else None

        return load

    def parameters(self, layer, num_experts: int) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def target(self, data: torch.Tensor, param_name: str, expert: int) -> torch.Tensor:
        raise NotImplementedError

    def run(self, layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def get_fused_moe_quant_config(self, layer):
        return None

    def apply(self, layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts=None, shared_experts_input=None) -> torch.Tensor:
        return self.run(layer, x, topk_weights, topk_ids)


class PackedExpertsConfig(QuantizationConfig):
    """What both formats' configs share: activations in any float dtype, no extra files, no GPU
    capability floor, and only the routed experts quantized (every linear layer stays unquantized)."""

    name = ""

    def __init__(self, quant_config: dict):
        super().__init__()
        self.quant_config = quant_config

    def get_name(self) -> str:
        return self.name

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict):
        return cls(config)

    def make_moe_method(self, moe, prefix: str):
        raise NotImplementedError

    def get_quant_method(self, layer, prefix: str):
        if isinstance(layer, LinearBase):
            return UnquantizedLinearMethod()
        if isinstance(layer, RoutedExperts):
            return self.make_moe_method(layer.moe_config, prefix)
        return None
