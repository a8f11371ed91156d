"""`--load-format moeshrink`: vLLM's safetensors loader, then one log line with the bytes of the
parameters it loaded and, on the CPU, what it holds outside them (vLLM prints no weight-memory line
on CPU); the serve stage reads it from the server log."""
from __future__ import annotations

import dataclasses
import json

import torch
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.platforms import current_platform

from moeshrink_kernels import WEIGHTS_LINE
from moeshrink_kernels.vllm.ops import logger


def weight_bytes(model: torch.nn.Module, loaded: dict[int, int] | None = None) -> dict:
    """Bytes the model holds: parameters and buffers in all, parameters alone, and the routed
    experts' parameters (what the checkpoint's routed-expert bytes become in memory). On the CPU
    also `cpu`: which of the planner's CPU kinds vLLM took here and what it holds outside the
    parameters (`loaded`: each module's weight bytes before vLLM processed the weights)."""
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    routed = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if ".mlp.experts." in name)
    figures = {"weight_bytes": parameters + buffers, "parameter_bytes": parameters, "routed_expert_bytes": routed}
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
