"""The custom ops a packed MoE layer calls (torch.compile sees one opaque call): the chosen experts
decoded and run through vLLM's CPU MoE kernel on the CPU, or a Triton kernel that decodes inside the
matmul on CUDA; and which of vLLM's CPU MoE kernels a layer gets."""
from __future__ import annotations

import torch
from torch.library import Library
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEActivationFormat
from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend, backend_to_kernel_cls
from vllm.platforms import current_platform
from vllm.utils.torch_utils import direct_register_custom_op

from moeshrink_kernels.experts import CPUKernel, mxfp4_routed_experts, twx_routed_experts

logger = init_logger("vllm.moeshrink")
_ops_library = None


def _twx_op(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13_codes: torch.Tensor,
            w13_scales: torch.Tensor, w2_codes: torch.Tensor, w2_scales: torch.Tensor,
            layout: torch.Tensor, isa: str, padded_intermediate: int, version: int) -> torch.Tensor:
    if x.is_cuda:
        from moeshrink_kernels.triton_experts import triton_twx_routed_experts

        return triton_twx_routed_experts(x, topk_weights, topk_ids, w13_codes, w13_scales, w2_codes, w2_scales, layout,
                                         version)
    out = twx_routed_experts(x, topk_weights, topk_ids, w13_codes, w13_scales, w2_codes, w2_scales, layout,
                             CPUKernel(isa, padded_intermediate), version)
    _check_finite("twx", x, topk_weights, out)
    return out


def _mxfp4_op(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13_packed: torch.Tensor,
              w13_scales: torch.Tensor, w2_packed: torch.Tensor, w2_scales: torch.Tensor, isa: str,
              padded_intermediate: int) -> torch.Tensor:
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
    logger.error("moeshrink: non-finite values in a %s MoE layer of %d tokens: %s%s", method, x.shape[0],
                 ", ".join(f"{n}: {c}" for n, c in bad.items()),
                 "" if bad["hidden states in"] or bad["routing weights"] else " (made by the experts themselves)")


def _twx_fake(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13_codes: torch.Tensor,
              w13_scales: torch.Tensor, w2_codes: torch.Tensor, w2_scales: torch.Tensor,
              layout: torch.Tensor, isa: str, padded_intermediate: int, version: int) -> torch.Tensor:
    return torch.empty_like(x)


def _mxfp4_fake(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13_packed: torch.Tensor,
                w13_scales: torch.Tensor, w2_packed: torch.Tensor, w2_scales: torch.Tensor, isa: str,
                padded_intermediate: int) -> torch.Tensor:
    return torch.empty_like(x)


def register_ops() -> None:
    global _ops_library
    if hasattr(torch.ops, "moeshrink") and hasattr(torch.ops.moeshrink, "twx_experts"):
        return
    _ops_library = Library("moeshrink", "FRAGMENT")
    direct_register_custom_op("twx_experts", _twx_op, mutates_args=[], fake_impl=_twx_fake, target_lib=_ops_library)
    direct_register_custom_op("mxfp4_experts", _mxfp4_op, mutates_args=[], fake_impl=_mxfp4_fake,
                              target_lib=_ops_library)


def cpu_kernel_for(moe):
    """The grouped-GEMM kernel vLLM's unquantized CPU backend would use for this layer (its own order
    of preference), or none (another platform, or a shape the kernels refuse)."""
    if not current_platform.is_cpu():
        return CPUKernel()
    reasons = []
    for kernel_class in backend_to_kernel_cls(UnquantizedMoeBackend.CPU):
        supported, reason = kernel_class.is_supported_config(kernel_class, moe, None, None,
                                                             FusedMoEActivationFormat.Standard)
        if supported:
            return CPUKernel(kernel_class.isa, kernel_class._padded_intermediate_size(moe))
        reasons.append(f"{kernel_class.__name__}: {reason}")
    logger.warning("moeshrink: no vLLM CPU MoE kernel takes this layer (%s); experts run in float32 torch",
                   "; ".join(reasons))
    return CPUKernel()
