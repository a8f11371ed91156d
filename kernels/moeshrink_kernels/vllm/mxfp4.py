"""Per-expert MXFP4 checkpoints of DeepSeek-V3-style models on the CPU, whose grouped sigmoid routing
vLLM's own CPU MXFP4 backend refuses: `moeshrink_mxfp4` claims them through
`override_quantization_method`, so they serve with no extra flag."""
from __future__ import annotations

from typing import Any

import torch
from vllm.platforms import current_platform

from moeshrink_kernels.vllm.packed import PackedExpertsConfig, PackedExpertsMethod


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


class MoeshrinkMXFP4Config(PackedExpertsConfig):
    name = "moeshrink_mxfp4"

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: dict, user_quant: str | None, hf_config: Any = None):
        architectures = getattr(hf_config, "architectures", None) or []
        claims = (hf_quant_cfg.get("quant_method") == "mxfp4" and current_platform.is_cpu()
                  and any(a.startswith(("DeepseekV3", "DeepseekV2", "KimiK2")) for a in architectures))
        return "moeshrink_mxfp4" if claims and user_quant in (None, "mxfp4", "moeshrink_mxfp4") else None

    def make_moe_method(self, moe, prefix: str):
        return MXFP4ExpertsMethod(moe, prefix)
