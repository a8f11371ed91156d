"""TWX builds in vLLM (config.json `quantization_config.quant_method: twx`, format versions 1 and 2):
flat per-layer code buffers, each expert at its own width, computed by the `moeshrink::twx_experts` op."""
from __future__ import annotations

import torch

from moeshrink.formats import twx_vq
from moeshrink.formats.twx_layout import CODES, SCALES, VQ_CODES, VQ_SCALES
from moeshrink_kernels.experts import TWXLayout
from moeshrink_kernels.vllm.packed import PackedExpertsConfig, PackedExpertsError, PackedExpertsMethod, layer_index

TWX_FORMAT_VERSIONS = (1, 2)
# the tensor suffixes of each version, where quantization_config.tensors does not say
DEFAULT_TENSORS = {1: {"codes": CODES, "scales": SCALES}, 2: {"codes": VQ_CODES, "scales": VQ_SCALES}}


class TWXExpertsMethod(PackedExpertsMethod):
    """Routed experts in TWX: flat per-layer code buffers (each expert at its own width) and
    [E, rows, K/32] scale tensors."""

    def __init__(self, moe, expert_bits: list[int], layer_name: str, version: int, tensors: dict[str, str]):
        super().__init__(moe, layer_name)
        self.expert_bits = expert_bits
        self.version = version
        # parameter names follow the checkpoint's tensor suffixes (vLLM maps `experts.E.gate_proj.X` to `w13_X`)
        self.codes, self.scales = tensors["codes"], tensors["scales"]

    def parameters(self, layer, num_experts: int) -> dict[str, torch.Tensor]:
        if len(self.expert_bits) != num_experts:
            raise PackedExpertsError(f"{self.layer_name}: quantization_config.expert_bits lists "
                                     f"{len(self.expert_bits)} experts, the model has {num_experts}")
        hidden, inter = self.hidden, self.intermediate
        self.layout = TWXLayout.of(self.expert_bits, hidden, inter)
        layer.register_buffer("twx_layout", self.layout.as_tensor(), persistent=False)
        return {
            f"w13_{self.codes}": torch.zeros(self.layout.w13_bytes, dtype=torch.uint8),
            f"w13_{self.scales}": torch.zeros(num_experts, 2 * inter, hidden // 32, dtype=torch.uint8),
            f"w2_{self.codes}": torch.zeros(self.layout.w2_bytes, dtype=torch.uint8),
            f"w2_{self.scales}": torch.zeros(num_experts, hidden, inter // 32, dtype=torch.uint8),
        }

    def target(self, data: torch.Tensor, param_name: str, expert: int) -> torch.Tensor:
        if param_name.endswith(self.scales):
            return data[expert]
        w13 = param_name.startswith("w13")
        rows, k = (2 * self.intermediate, self.hidden) if w13 else (self.hidden, self.intermediate)
        width = k * self.expert_bits[expert] // 8
        offset = (self.layout.w13_offsets if w13 else self.layout.w2_offsets)[expert]
        return data[offset:offset + rows * width].view(rows, width)

    def run(self, layer, x, topk_weights, topk_ids):
        return torch.ops.moeshrink.twx_experts(x, topk_weights, topk_ids, getattr(layer, f"w13_{self.codes}"),
                                               getattr(layer, f"w13_{self.scales}"), getattr(layer, f"w2_{self.codes}"),
                                               getattr(layer, f"w2_{self.scales}"), layer.twx_layout, self.kernel.isa,
                                               self.kernel.padded_intermediate, self.version)


class TWXConfig(PackedExpertsConfig):
    name = "twx"

    def __init__(self, quant_config: dict):
        super().__init__(quant_config)
        version = quant_config.get("format_version")
        if version not in TWX_FORMAT_VERSIONS:
            raise PackedExpertsError(f"quantization_config.format_version {version!r}: this plugin reads TWX "
                                     f"format versions {list(TWX_FORMAT_VERSIONS)}")
        if quant_config.get("group_size") != 32 or quant_config.get("scale_encoding") != "ue5m3":
            raise PackedExpertsError(f"quantization_config: TWX v{version} has group_size 32 and scale_encoding ue5m3, "
                                     f"got {quant_config.get('group_size')!r} and {quant_config.get('scale_encoding')!r}")
        self.version = version
        self.tensors = quant_config.get("tensors") or DEFAULT_TENSORS[version]
        if version == 2:
            written = (quant_config.get("codebook") or {}).get("sha256")
            if written != twx_vq.codebook_sha256():
                raise PackedExpertsError(f"quantization_config.codebook.sha256 is {written!r}; this plugin decodes TWX v2 "
                                         f"with the codebooks {twx_vq.CODEBOOK_FILE.name} "
                                         f"(sha256 {twx_vq.codebook_sha256()})")
        self.expert_bits = {int(layer): [int(b) for _, b in sorted(experts.items(), key=lambda kv: int(kv[0]))]
                            for layer, experts in quant_config["expert_bits"].items()}

    def make_moe_method(self, moe, prefix: str):
        index = layer_index(prefix)
        if index not in self.expert_bits:
            raise PackedExpertsError(f"{prefix}: quantization_config.expert_bits has no layer {index}")
        return TWXExpertsMethod(moe, self.expert_bits[index], prefix, self.version, self.tensors)
