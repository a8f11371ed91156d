"""vLLM plugin: serves moeshrink's packed expert formats.

- `twx`: TWX3 / TWX2.5 builds (config.json `quantization_config.quant_method: twx`).
- `moeshrink_mxfp4`: per-expert MXFP4 checkpoints of DeepSeek-V3-style models on the CPU, whose
  grouped sigmoid routing vLLM's own CPU MXFP4 backend refuses; it claims such checkpoints through
  `override_quantization_method`, so they serve with no extra flag.

Routed experts stay packed in memory and are decoded inside a custom op (torch.compile sees one
opaque call): on the CPU the chosen experts are decoded in groups within a byte budget and run
through vLLM's own CPU MoE kernel; on CUDA a Triton kernel decodes inside the matmul. Routing,
the routed scaling factor and shared experts stay vLLM's. Everything else in the model is unquantized. Registered through the
`vllm.general_plugins` entry point; registration is idempotent (vLLM calls it in every process).
"""
from __future__ import annotations

import functools
import re
from typing import Any

import torch

from moeshrink.core.errors import MoeshrinkError
from moeshrink_kernels import WEIGHTS_LINE

TWX_FORMAT_VERSIONS = (1,)
LOAD_FORMAT = "moeshrink"
_registered = False
_ops_library = None


class PackedExpertsError(MoeshrinkError, ValueError):
    pass


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm.model_executor.layers.quantization import register_quantization_config
    from vllm.model_executor.model_loader import register_model_loader

    from moeshrink_kernels import inductor_fix

    _logger().info("moeshrink: torch Inductor fix (mutation renames): %s", inductor_fix.apply())
    register_quantization_config("twx")(_twx_config_class())
    register_quantization_config("moeshrink_mxfp4")(_mxfp4_config_class())
    register_model_loader(LOAD_FORMAT)(_loader_class())
    _register_ops()
    _registered = True


# ------------------------------------------------------------------------------------ custom ops
def _twx_op(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13_codes: torch.Tensor,
            w13_scales: torch.Tensor, w2_codes: torch.Tensor, w2_scales: torch.Tensor,
            layout: torch.Tensor, isa: str, padded_intermediate: int) -> torch.Tensor:
    from moeshrink_kernels.experts import CPUKernel, twx_routed_experts

    if x.is_cuda:
        from moeshrink_kernels.triton_experts import triton_twx_routed_experts

        return triton_twx_routed_experts(x, topk_weights, topk_ids, w13_codes, w13_scales, w2_codes, w2_scales, layout)
    out = twx_routed_experts(x, topk_weights, topk_ids, w13_codes, w13_scales, w2_codes, w2_scales, layout,
                             CPUKernel(isa, padded_intermediate))
    _check_finite("twx", x, topk_weights, out)
    return out


def _mxfp4_op(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13_packed: torch.Tensor,
              w13_scales: torch.Tensor, w2_packed: torch.Tensor, w2_scales: torch.Tensor, isa: str,
              padded_intermediate: int) -> torch.Tensor:
    from moeshrink_kernels.experts import CPUKernel, mxfp4_routed_experts

    if x.is_cuda:
        from moeshrink_kernels.triton_experts import triton_mxfp4_routed_experts

        return triton_mxfp4_routed_experts(x, topk_weights, topk_ids, w13_packed, w13_scales, w2_packed, w2_scales)
    out = mxfp4_routed_experts(x, topk_weights, topk_ids, w13_packed, w13_scales, w2_packed, w2_scales,
                               CPUKernel(isa, padded_intermediate))
    _check_finite("moeshrink_mxfp4", x, topk_weights, out)
    return out


_NONFINITE_REPORTS_LEFT = [20]


def _check_finite(method: str, x: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor) -> None:
    """Say so in the server log when a batch's routed experts meet or make NaN or infinity (on the
    CPU, where the check costs little beside the decode): where non-finite values arise. The evals
    then fail on the items they reach, naming each (moeshrink.evals.finite)."""
    if bool(torch.isfinite(out).all()) or not _NONFINITE_REPORTS_LEFT[0]:
        return
    _NONFINITE_REPORTS_LEFT[0] -= 1
    bad = {name: int((~torch.isfinite(t)).sum()) for name, t in
           (("hidden states in", x), ("routing weights", topk_weights), ("expert output", out))}
    _logger().error("moeshrink: non-finite values in a %s MoE layer of %d tokens: %s%s", method, x.shape[0],
                    ", ".join(f"{n}: {c}" for n, c in bad.items()),
                    "" if bad["hidden states in"] or bad["routing weights"] else " (made by the experts themselves)")


def _twx_fake(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13_codes: torch.Tensor,
              w13_scales: torch.Tensor, w2_codes: torch.Tensor, w2_scales: torch.Tensor,
              layout: torch.Tensor, isa: str, padded_intermediate: int) -> torch.Tensor:
    return torch.empty_like(x)


def _mxfp4_fake(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13_packed: torch.Tensor,
                w13_scales: torch.Tensor, w2_packed: torch.Tensor, w2_scales: torch.Tensor, isa: str,
                padded_intermediate: int) -> torch.Tensor:
    return torch.empty_like(x)


def _register_ops() -> None:
    global _ops_library
    if hasattr(torch.ops, "moeshrink") and hasattr(torch.ops.moeshrink, "twx_experts"):
        return
    from torch.library import Library
    from vllm.utils.torch_utils import direct_register_custom_op

    _ops_library = Library("moeshrink", "FRAGMENT")
    direct_register_custom_op("twx_experts", _twx_op, mutates_args=[], fake_impl=_twx_fake, target_lib=_ops_library)
    direct_register_custom_op("mxfp4_experts", _mxfp4_op, mutates_args=[], fake_impl=_mxfp4_fake,
                              target_lib=_ops_library)


# ---------------------------------------------------------------------------------- MoE methods
def _layer_index(prefix: str) -> int:
    match = re.search(r"layers\.(\d+)\.", prefix + ".")
    if not match:
        raise PackedExpertsError(f"cannot tell the layer of MoE module {prefix!r}")
    return int(match[1])


def _check_single_partition(moe, what: str) -> None:
    parallel = getattr(moe, "moe_parallel_config", None)
    for attribute in ("tp_size", "ep_size", "dp_size"):
        if parallel is not None and getattr(parallel, attribute, 1) > 1:
            raise PackedExpertsError(f"{what}: serving with {attribute} > 1 is not supported yet (TP/EP/DP = 1)")


def cpu_kernel_for(moe):
    """The grouped-GEMM kernel vLLM's unquantized CPU backend would use for this layer (its own order
    of preference), or none (another platform, or a shape the kernels refuse)."""
    from vllm.platforms import current_platform

    from moeshrink_kernels.experts import CPUKernel

    if not current_platform.is_cpu():
        return CPUKernel()
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEActivationFormat
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend, backend_to_kernel_cls

    reasons = []
    for kernel_class in backend_to_kernel_cls(UnquantizedMoeBackend.CPU):
        supported, reason = kernel_class.is_supported_config(kernel_class, moe, None, None,
                                                             FusedMoEActivationFormat.Standard)
        if supported:
            return CPUKernel(kernel_class.isa, kernel_class._padded_intermediate_size(moe))
        reasons.append(f"{kernel_class.__name__}: {reason}")
    _logger().warning("moeshrink: no vLLM CPU MoE kernel takes this layer (%s); experts run in float32 torch",
                      "; ".join(reasons))
    return CPUKernel()


def _logger():
    from vllm.logger import init_logger

    return init_logger("vllm.moeshrink")


def _copy_checked(target: torch.Tensor, source: torch.Tensor, weight_name: str) -> None:
    if tuple(target.shape) != tuple(source.shape) or source.dtype != target.dtype:
        raise PackedExpertsError(f"{weight_name}: expected {target.dtype} {tuple(target.shape)}, "
                                 f"the checkpoint has {source.dtype} {tuple(source.shape)}")
    target.copy_(source)


@functools.cache  # the classes once per process, not once per layer
def _methods():
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
    from vllm.model_executor.utils import set_weight_attrs

    class PackedExpertsMethod(FusedMoEMethodBase):
        """Routed experts held packed: subclasses say which parameters a layer has (`parameters`),
        where one checkpoint tensor goes in them (`target`), and which custom op computes (`run`)."""

        def __init__(self, moe, layer_name: str):
            super().__init__(moe)
            self.layer_name = layer_name

        def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                           params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
            _check_single_partition(self.moe, self.layer_name)
            activation = getattr(self.moe.activation, "value", self.moe.activation)
            if activation != "silu":
                raise PackedExpertsError(f"{self.layer_name}: packed experts compute SiLU-gated MLPs, "
                                         f"the model's experts use {activation!r}")
            self.kernel = cpu_kernel_for(self.moe)
            _logger().info_once("moeshrink: routed experts of %s computed by %s", type(self).__name__,
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
                _copy_checked(target, loaded_weight, weight_name)
                return True if return_success else None

            return load

        def get_fused_moe_quant_config(self, layer):
            return None

        def apply(self, layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  shared_experts=None, shared_experts_input=None) -> torch.Tensor:
            return self.run(layer, x, topk_weights, topk_ids)

    class TWXExpertsMethod(PackedExpertsMethod):
        """Routed experts in TWX: flat per-layer code buffers (each expert at its own width) and
        [E, rows, K/32] scale tensors."""

        def __init__(self, moe, expert_bits: list[int], layer_name: str):
            super().__init__(moe, layer_name)
            self.expert_bits = expert_bits

        def parameters(self, layer, num_experts: int) -> dict[str, torch.Tensor]:
            from moeshrink_kernels.experts import TWXLayout

            if len(self.expert_bits) != num_experts:
                raise PackedExpertsError(f"{self.layer_name}: quantization_config.expert_bits lists "
                                         f"{len(self.expert_bits)} experts, the model has {num_experts}")
            hidden, inter = self.hidden, self.intermediate
            self.layout = TWXLayout.of(self.expert_bits, hidden, inter)
            layer.register_buffer("twx_layout", self.layout.as_tensor(), persistent=False)
            return {
                "w13_twx_codes": torch.zeros(self.layout.w13_bytes, dtype=torch.uint8),
                "w13_twx_scales": torch.zeros(num_experts, 2 * inter, hidden // 32, dtype=torch.uint8),
                "w2_twx_codes": torch.zeros(self.layout.w2_bytes, dtype=torch.uint8),
                "w2_twx_scales": torch.zeros(num_experts, hidden, inter // 32, dtype=torch.uint8),
            }

        def target(self, data: torch.Tensor, param_name: str, expert: int) -> torch.Tensor:
            if param_name.endswith("scales"):
                return data[expert]
            w13 = param_name.startswith("w13")
            rows, k = (2 * self.intermediate, self.hidden) if w13 else (self.hidden, self.intermediate)
            width = k * self.expert_bits[expert] // 8
            offset = (self.layout.w13_offsets if w13 else self.layout.w2_offsets)[expert]
            return data[offset:offset + rows * width].view(rows, width)

        def run(self, layer, x, topk_weights, topk_ids):
            return torch.ops.moeshrink.twx_experts(x, topk_weights, topk_ids, layer.w13_twx_codes,
                                                   layer.w13_twx_scales, layer.w2_twx_codes, layer.w2_twx_scales,
                                                   layer.twx_layout, self.kernel.isa,
                                                   self.kernel.padded_intermediate)

    class MXFP4ExpertsMethod(PackedExpertsMethod):
        """Routed experts in vLLM's per-expert MXFP4 layout: w13/w2 `_weight` uint8 (two E2M1 codes per
        byte) and `_weight_scale` uint8 E8M0 per 32 inputs."""

        def parameters(self, layer, num_experts: int) -> dict[str, torch.Tensor]:
            hidden, inter = self.hidden, self.intermediate
            return {
                "w13_weight": torch.zeros(num_experts, 2 * inter, hidden // 2, dtype=torch.uint8),
                "w13_weight_scale": torch.zeros(num_experts, 2 * inter, hidden // 32, dtype=torch.uint8),
                "w2_weight": torch.zeros(num_experts, hidden, inter // 2, dtype=torch.uint8),
                "w2_weight_scale": torch.zeros(num_experts, hidden, inter // 32, dtype=torch.uint8),
            }

        def target(self, data: torch.Tensor, param_name: str, expert: int) -> torch.Tensor:
            return data[expert]

        def run(self, layer, x, topk_weights, topk_ids):
            return torch.ops.moeshrink.mxfp4_experts(x, topk_weights, topk_ids, layer.w13_weight,
                                                     layer.w13_weight_scale, layer.w2_weight, layer.w2_weight_scale,
                                                     self.kernel.isa, self.kernel.padded_intermediate)

    return TWXExpertsMethod, MXFP4ExpertsMethod


def _quant_method_for(layer, prefix: str, make_moe_method):
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    if isinstance(layer, LinearBase):
        return UnquantizedLinearMethod()
    if isinstance(layer, RoutedExperts):
        return make_moe_method(layer.moe_config, prefix)
    return None


def _packed_config_base():
    """What both methods' configs share: activations in any float dtype, no extra files, no GPU
    capability floor, and only routed experts quantized."""
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

    class PackedExpertsConfig(QuantizationConfig):
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
            return _quant_method_for(layer, prefix, self.make_moe_method)

    return PackedExpertsConfig


def _twx_config_class():
    class TWXConfig(_packed_config_base()):
        name = "twx"

        def __init__(self, quant_config: dict):
            super().__init__(quant_config)
            version = quant_config.get("format_version")
            if version not in TWX_FORMAT_VERSIONS:
                raise PackedExpertsError(f"quantization_config.format_version {version!r}: this plugin reads TWX "
                                         f"format versions {list(TWX_FORMAT_VERSIONS)}")
            if quant_config.get("group_size") != 32 or quant_config.get("scale_encoding") != "ue5m3":
                raise PackedExpertsError("quantization_config: TWX v1 has group_size 32 and scale_encoding ue5m3, got "
                                         f"{quant_config.get('group_size')!r} and {quant_config.get('scale_encoding')!r}")
            self.expert_bits = {int(layer): [int(b) for _, b in sorted(experts.items(), key=lambda kv: int(kv[0]))]
                                for layer, experts in quant_config["expert_bits"].items()}

        def make_moe_method(self, moe, prefix: str):
            twx_method, _ = _methods()
            index = _layer_index(prefix)
            if index not in self.expert_bits:
                raise PackedExpertsError(f"{prefix}: quantization_config.expert_bits has no layer {index}")
            return twx_method(moe, self.expert_bits[index], prefix)

    return TWXConfig


def _mxfp4_config_class():
    from vllm.platforms import current_platform

    class MoeshrinkMXFP4Config(_packed_config_base()):
        name = "moeshrink_mxfp4"

        @classmethod
        def override_quantization_method(cls, hf_quant_cfg: dict, user_quant: str | None, hf_config: Any = None):
            architectures = getattr(hf_config, "architectures", None) or []
            claims = (hf_quant_cfg.get("quant_method") == "mxfp4" and current_platform.is_cpu()
                      and any(a.startswith(("DeepseekV3", "DeepseekV2", "KimiK2")) for a in architectures))
            return "moeshrink_mxfp4" if claims and user_quant in (None, "mxfp4", "moeshrink_mxfp4") else None

        def make_moe_method(self, moe, prefix: str):
            _, mxfp4_method = _methods()
            return mxfp4_method(moe, prefix)

    return MoeshrinkMXFP4Config


def weight_bytes(model: torch.nn.Module, loaded: dict[int, int] | None = None) -> dict:
    """Bytes the model holds: parameters and buffers in all, parameters alone, and the routed
    experts' parameters (what the checkpoint's routed-expert bytes become in memory). On the CPU
    also `cpu`: which of the planner's CPU kinds vLLM took here and what it holds outside the
    parameters (`loaded`: each module's weight bytes before vLLM processed the weights)."""
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    routed = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if ".mlp.experts." in name)
    figures = {"weight_bytes": parameters + buffers, "parameter_bytes": parameters, "routed_expert_bytes": routed}
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        figures["cpu"] = cpu_holdings(model, loaded or {})
    return figures


# the names a packed CPU GEMM's closure calls (vllm/model_executor/layers/utils.py
# dispatch_cpu_unquantized_gemm); torch's F.linear fallback calls none of them
_PACKED_GEMMS = ("onednn_mm", "weight_packed_linear_cpu", "zentorch_linear_unary")


def _packed_copy_bytes(module: torch.nn.Module, loaded: dict[int, int]) -> int:
    """Bytes of the copy vLLM's CPU dispatch packed this layer's weight into, outside its parameters:
    sgl-kernel's packed tensor exactly (it sits in the closure); a oneDNN handler's copy, which
    Python cannot see, at the bytes it was packed from."""
    gemm = getattr(module, "cpu_linear", None)
    code = getattr(gemm, "__code__", None)
    if code is None or not any(name in code.co_names for name in _PACKED_GEMMS):
        return 0
    cells = [cell.cell_contents for cell in (gemm.__closure__ or ())]
    packed = sum(t.numel() * t.element_size() for t in cells if isinstance(t, torch.Tensor))
    return packed or loaded.get(id(module), 0)


def cpu_holdings(model: torch.nn.Module, loaded: dict[int, int]) -> dict:
    """What vLLM's CPU build holds for this model: the kind (amx: AMX_MLA; packed: linear layers
    packed for oneDNN/sgl-kernel/zentorch, Parameters emptied; unpacked: torch's F.linear on every
    Parameter), the torch facts it branched on, each storage once, and the packed copies."""
    tensors = [*model.parameters(), *model.buffers()]
    unique = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.numel()}.values())
    outside = emptied = 0
    amx_mla = False
    for module in model.modules():
        outside += _packed_copy_bytes(module, loaded)
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.numel() == 0 and loaded.get(id(module)):
            emptied += 1
        if getattr(module, "is_amx_bmm_enabled", False):
            amx_mla = True
            impl = module.impl
            outside += sum(t.numel() * t.element_size() for t in (impl._w_uk_packed, impl._w_uv_packed)
                           if isinstance(t, torch.Tensor))
    from moeshrink.core.machine import cpu_facts

    facts = cpu_facts()
    return {"kind": "amx" if amx_mla else "packed" if emptied else "unpacked",
            "facts": facts.as_dict() if facts else None, "unique_bytes": unique,
            "packed_outside_parameters_bytes": outside, "resident_bytes": unique + outside}


def _loader_class():
    """`--load-format moeshrink`: vLLM's safetensors loader, then one log line with the bytes of the
    parameters it loaded and, on the CPU, what it holds outside them (vLLM prints no weight-memory
    line on CPU)."""
    import dataclasses
    import json

    from vllm.logger import init_logger
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    logger = init_logger("vllm.moeshrink")

    class WeightCountingLoader(DefaultModelLoader):
        def __init__(self, load_config):
            super().__init__(dataclasses.replace(load_config, load_format="safetensors"))

        def load_weights(self, model, model_config) -> None:
            super().load_weights(model, model_config)
            # before vLLM processes them: its CPU GEMM dispatch may empty a layer's Parameter
            self.loaded = {id(m): m.weight.numel() * m.weight.element_size() for m in model.modules()
                           if isinstance(getattr(m, "weight", None), torch.Tensor)}

        def load_model(self, vllm_config, model_config, prefix: str = ""):
            model = super().load_model(vllm_config, model_config, prefix=prefix)
            logger.info("%s %s", WEIGHTS_LINE, json.dumps(weight_bytes(model, getattr(self, "loaded", None))))
            return model

    return WeightCountingLoader
