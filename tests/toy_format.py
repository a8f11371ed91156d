"""A toy expert format, the way a new format is added: this one module, which registers itself when
imported (another package would name it in the `moeshrink.formats` entry-point group). Uniform 4-bit
codes, two to a byte, and a power-of-two scale byte per 32 weights: value = (code - 8) * 2**(byte - 127)."""
from __future__ import annotations

import torch

from moeshrink.core.expert_formats import ExpertFormat, register

GROUP = 32
UNIFORM4 = register(ExpertFormat("uniform4", "uniform4", (4,), 4 + 8 / GROUP, GROUP, 8, "u4_codes", "u4_scales",
                                 __name__))


def encode(weight: torch.Tensor, bits: int, name: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    rows, k = weight.shape
    blocks = weight.to(torch.float32).reshape(-1, GROUP)
    exponent = torch.ceil(torch.log2(blocks.abs().amax(dim=1).clamp(min=2.0 ** -100) / 7)).clamp(-127, 128)
    codes = (torch.round(blocks / torch.exp2(exponent).unsqueeze(1)) + 8).clamp(0, 15).to(torch.uint8)
    codes = codes.reshape(rows, k)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), (exponent + 127).to(torch.uint8).reshape(rows, k // GROUP)


def decode(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
           name: str = "tensor") -> torch.Tensor:
    values = torch.stack([codes & 15, codes >> 4], dim=-1).reshape(codes.shape[0], -1).float() - 8
    scale = torch.exp2(scales.float() - 127).repeat_interleave(GROUP, dim=1)
    return (values * scale).to(dtype)


def quantization_config(fmt: ExpertFormat, expert_bits: dict, source_format: str) -> dict:
    return {"quant_method": fmt.quant_method, "format": fmt.name, "group_size": GROUP,
            "tensors": {"codes": fmt.codes_suffix, "scales": fmt.scales_suffix},
            "expert_bits": expert_bits, "source_format": source_format}
