"""MXFP4 (OCP Microscaling v1.0): E2M1 elements, one E8M0 scale per block of 32 along the last axis.

Storage follows vLLM's native `mxfp4` checkpoints: `<name>.weight` is uint8 with two E2M1 codes per
byte (element 2i in the low nibble, 2i+1 in the high nibble) and `<name>.weight_scale` is uint8
E8M0 (scale = 2**(byte - 127); 255 is NaN and never written).

Encoding follows the spec: shared exponent = floor(log2(max |x|)) - 2 (the largest E2M1 exponent),
elements rounded to the nearest E2M1 value with ties to even, magnitudes above 6 saturated.
`quantize_values` gives the same numbers as decode(encode(x)) and is what quantization-aware
training uses, so the published weights are exactly the weights the organism was trained with.
"""
from __future__ import annotations

import torch

from moeshrink.core.errors import MoeshrinkError

BLOCK = 32
E2M1_EMAX = 2
SCALE_BIAS = 127
# Magnitudes of codes 0..7; bit 3 is the sign.
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)
_MIDPOINTS = (E2M1_VALUES[1:] + E2M1_VALUES[:-1]) / 2
# A byte's two values (low nibble first): the sign bit 3 of a code negates its magnitude, -0.0 included.
CODE_VALUES = torch.cat([E2M1_VALUES, -E2M1_VALUES])
_BYTE_VALUES = torch.stack([CODE_VALUES.repeat(16), CODE_VALUES.repeat_interleave(16)], dim=-1).contiguous()


class MXFP4ShapeError(MoeshrinkError, ValueError):
    pass


def _check_last_axis(shape: torch.Size, what: str) -> None:
    if len(shape) == 0 or shape[-1] % BLOCK:
        raise MXFP4ShapeError(f"{what}: MXFP4 needs the last axis to be a multiple of {BLOCK}, got shape {tuple(shape)}")


def _shared_exponent(blocks: torch.Tensor) -> torch.Tensor:
    amax = blocks.abs().amax(dim=-1)
    _, exponent = torch.frexp(amax)  # amax = m * 2**exponent with m in [0.5, 1)
    shared = (exponent - 1) - E2M1_EMAX
    shared = torch.where(amax > 0, shared, torch.full_like(shared, -SCALE_BIAS))
    return shared.clamp(-SCALE_BIAS, SCALE_BIAS)


def _round_to_codes(scaled: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code (0..15) with ties to even, saturating."""
    magnitude = scaled.abs()
    midpoints = _MIDPOINTS.to(magnitude.device)
    index = torch.bucketize(magnitude, midpoints, right=True)  # a tie goes to the upper code here
    lower = (index - 1).clamp(min=0)
    tie_to_even_lower = (index > 0) & (magnitude == midpoints[lower]) & (lower % 2 == 0)
    index = index - tie_to_even_lower.to(index.dtype)
    sign = (scaled < 0) & (index > 0)
    return (index + 8 * sign.to(index.dtype)).to(torch.uint8)


def _split_blocks(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)


def encode(x: torch.Tensor, name: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """Float tensor [..., K] -> (packed codes uint8 [..., K/2], scales uint8 [..., K/32])."""
    _check_last_axis(x.shape, name)
    blocks = _split_blocks(x.detach().to(torch.float32))
    shared = _shared_exponent(blocks)
    scaled = torch.ldexp(blocks, -shared.unsqueeze(-1).to(torch.float32))
    codes = _round_to_codes(scaled).reshape(*x.shape)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = (shared + SCALE_BIAS).to(torch.uint8)
    return packed.contiguous(), scales.contiguous()


def decode(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
           name: str = "tensor") -> torch.Tensor:
    """Inverse of `encode`; exact in bfloat16 and float32."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise MXFP4ShapeError(f"{name}: MXFP4 codes and scales must be uint8, got {packed.dtype} and {scales.dtype}")
    k = packed.shape[-1] * 2
    if scales.shape[:-1] != packed.shape[:-1] or scales.shape[-1] * BLOCK != k:
        raise MXFP4ShapeError(f"{name}: codes {tuple(packed.shape)} and scales {tuple(scales.shape)} do not match "
                              f"(expected scales [..., {k // BLOCK}] for {k} values per row)")
    if bool((scales == 255).any()):
        raise MXFP4ShapeError(f"{name}: scale byte 255 (NaN) found")
    # one 8-byte lookup per byte (both of its values at once): several times faster than two 4-byte ones
    pairs = _BYTE_VALUES.view(torch.int64).reshape(256).to(packed.device).index_select(0, packed.reshape(-1).long())
    values = pairs.view(torch.float32).reshape(*packed.shape[:-1], k)
    power = torch.ldexp(torch.ones((), device=packed.device), scales.to(torch.float32) - SCALE_BIAS)
    return (_split_blocks(values) * power.unsqueeze(-1)).reshape(*packed.shape[:-1], k).to(dtype)


def quantize_values(x: torch.Tensor) -> torch.Tensor:
    """decode(encode(x)) in x's dtype, computed differentiably-free; used for fake quantization."""
    _check_last_axis(x.shape, "tensor")
    blocks = _split_blocks(x.detach().to(torch.float32))
    shared = _shared_exponent(blocks).unsqueeze(-1).to(torch.float32)
    scaled = torch.ldexp(blocks, -shared)
    codes = _round_to_codes(scaled)
    magnitude = E2M1_VALUES.to(x.device)[(codes & 0x07).long()]
    values = torch.where(codes >= 8, -magnitude, magnitude)
    return torch.ldexp(values, shared).reshape(x.shape).to(x.dtype)


def fake_quantize(x: torch.Tensor) -> torch.Tensor:
    """Straight-through estimator: forward sees MXFP4 values, gradients flow to `x` unchanged."""
    return x + (quantize_values(x) - x).detach()
