"""TWX expert formats: non-uniform 3-bit and 2-bit codes with a searched 8-bit scale per 32 weights.

This module is the reference encoder and decoder; `kernels/FORMAT.md` describes the same layout for
other engines. In short, for a weight matrix [rows, K] (K = input dimension, a multiple of 32):

- codes: uint8 [rows, K * bits / 8]; each row packs its K codes little-endian in bit order,
  3-bit codes 8 per 3 bytes, 2-bit codes 4 per byte (element j of a row starts at bit j * bits);
- scales: uint8 [rows, K / 32], UE5M3: scale = 2**(e - 20) * (1 + m / 8), e = byte >> 3, m = byte & 7;
- value = LEVELS[bits][code] * scale of its block of 32.

The levels are format constants (Lloyd-Max levels for block-normalised MXFP4-published Gaussian
weights; TWX3 keeps an exact zero). The encoder searches, per block, the scale on the UE5M3 grid
that minimises the block's squared error. Bits per weight: 3.25 (TWX3 codes) and 2.25 (TWX2 codes).
"""
from __future__ import annotations

import numpy as np
import torch

GROUP = 32
# tensor-name suffixes of a TWX weight, in place of `weight`: `<module>.twx_codes`, `<module>.twx_scales`
CODES, SCALES = "twx_codes", "twx_scales"
SCALE_EXP_BIAS = 20
# float32 whatever the default dtype when imported (vLLM sets bfloat16 while it builds a model)
LEVELS: dict[int, torch.Tensor] = {
    3: torch.tensor([-1.0, -0.5534, -0.2948, -0.1286, 0.0, 0.2410, 0.5519, 1.0], dtype=torch.float32),
    2: torch.tensor([-1.0, -0.2884, 0.2884, 1.0], dtype=torch.float32),
}
# Scale candidates searched around the block's absolute maximum, in UE5M3 steps (1/8 octave).
SEARCH_STEPS = range(-8, 3)


class TWXFormatError(ValueError):
    pass


def bits_per_weight(bits: int) -> float:
    return bits + 8 / GROUP


def decode_scales(scale_bytes: torch.Tensor) -> torch.Tensor:
    b = scale_bytes.to(torch.int32)
    return torch.ldexp(1 + (b & 7).to(torch.float32) / 8, (b >> 3) - SCALE_EXP_BIAS)


def nearest_scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    """The UE5M3 byte whose value is nearest below-or-at `scale` (clamped to the representable range)."""
    mantissa, exponent = torch.frexp(scale.clamp(min=2.0 ** -SCALE_EXP_BIAS))  # scale = m * 2**e, m in [0.5, 1)
    e_field = exponent - 1 + SCALE_EXP_BIAS
    m_field = torch.floor((mantissa * 2 - 1) * 8).to(torch.int32)
    byte = (e_field.to(torch.int32) << 3) + m_field
    return byte.clamp(0, 255)


def _assign(scaled: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    midpoints = (levels[1:] + levels[:-1]) / 2
    return torch.bucketize(scaled, midpoints)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes uint8 [rows, K] -> uint8 [rows, K * bits / 8], little-endian bit order per row."""
    rows, k = codes.shape
    per_word = 8  # 8 codes fill 3 bytes (3-bit) or 2 bytes (2-bit)
    words = codes.to(torch.int32).reshape(rows, k // per_word, per_word)
    shifts = torch.arange(per_word, dtype=torch.int32) * bits
    packed = (words << shifts).sum(-1)  # bits * 8 <= 24 bits per word
    nbytes = bits  # bytes per 8 codes
    out = torch.stack([(packed >> (8 * i)) & 0xFF for i in range(nbytes)], dim=-1)
    return out.reshape(rows, k * bits // 8).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    rows = packed.shape[0]
    words = packed.to(torch.int32).reshape(rows, k // 8, bits)
    value = sum(words[..., i] << (8 * i) for i in range(bits))
    shifts = torch.arange(8, dtype=torch.int32) * bits
    return ((value.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(rows, k).to(torch.uint8)


def check_shape(shape: tuple, name: str) -> None:
    if len(shape) != 2 or shape[1] % GROUP:
        raise TWXFormatError(f"{name}: TWX needs a 2-D weight whose input dimension is a multiple of {GROUP}, "
                             f"got shape {tuple(shape)}")


def _best_scale_bytes(blocks: torch.Tensor, levels: torch.Tensor, chunk_blocks: int = 2048) -> torch.Tensor:
    """Per block of 32 (rows of `blocks`, float32), the UE5M3 byte among SEARCH_STEPS around the block's
    absolute maximum with the least squared error; the first such step on ties. The elementwise work runs
    in numpy on buffers reused across candidates (about 3x faster than the same ops in torch); each block's
    error is still torch's float32 sum over its 32 terms, so every choice is the one torch made."""
    levels_np = levels.numpy()
    midpoints = ((levels[1:] + levels[:-1]) / 2).numpy()
    base_all = nearest_scale_bytes(blocks.abs().amax(dim=1))
    best_all = base_all.clone()
    size = min(chunk_blocks, blocks.shape[0])
    scaled = np.empty((size, GROUP), np.float32)
    above = np.empty((size, GROUP), np.bool_)
    codes = np.empty((size, GROUP), np.uint8)
    error = np.empty((size, GROUP), np.float32)
    for start in range(0, blocks.shape[0], chunk_blocks):
        chunk = blocks[start:start + chunk_blocks].numpy()
        n = chunk.shape[0]
        base = base_all[start:start + n]
        best_err = torch.full((n,), float("inf"))
        best = base
        x, a, c, e = scaled[:n], above[:n], codes[:n], error[:n]
        for step in SEARCH_STEPS:
            candidate = (base + step).clamp(0, 255)
            scale = decode_scales(candidate).unsqueeze(1).numpy()
            np.divide(chunk, scale, out=x)
            # the nearest level's index: how many midpoints lie below (what torch.bucketize returns)
            np.greater(x, midpoints[0], out=a)
            np.copyto(c, a)
            for midpoint in midpoints[1:]:
                np.greater(x, midpoint, out=a)
                np.add(c, a, out=c)
            np.take(levels_np, c, out=e)
            np.multiply(e, scale, out=e)
            np.subtract(e, chunk, out=e)
            np.multiply(e, e, out=e)
            err = torch.from_numpy(e).sum(dim=1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = torch.where(better, candidate, best)
        best_all[start:start + n] = best
    return best_all


@torch.no_grad()
def encode(weight: torch.Tensor, bits: int, name: str = "tensor", chunk_rows: int = 256
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """float [rows, K] -> (codes uint8 [rows, K*bits/8], scales uint8 [rows, K/32])."""
    if bits not in LEVELS:
        raise TWXFormatError(f"{name}: TWX has {sorted(LEVELS)}-bit codes, not {bits}")
    check_shape(tuple(weight.shape), name)
    levels = LEVELS[bits]
    midpoints = (levels[1:] + levels[:-1]) / 2
    rows, k = weight.shape
    all_codes, all_scales = [], []
    for start in range(0, rows, chunk_rows):  # a few MB at a time: a shard job's memory stays flat
        blocks = weight[start:start + chunk_rows].to(torch.float32).reshape(-1, GROUP).contiguous()
        finite = torch.isfinite(blocks)
        if not bool(finite.all()):
            first = start * k + int((~finite).reshape(-1).nonzero()[0])
            raise TWXFormatError(f"{name}: non-finite weights, the first at row {first // k}, column {first % k}: "
                                 f"the source checkpoint is damaged")
        scale_bytes = _best_scale_bytes(blocks, levels)
        codes = torch.bucketize(blocks / decode_scales(scale_bytes).unsqueeze(1), midpoints).to(torch.uint8)
        chunk = blocks.shape[0] * GROUP // k
        all_codes.append(pack_codes(codes.reshape(chunk, k), bits))
        all_scales.append(scale_bytes.to(torch.uint8).reshape(chunk, k // GROUP))
    return torch.cat(all_codes), torch.cat(all_scales)


@torch.no_grad()
def encode_plain(weight: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same search in plain torch ops on whole blocks (format version 1 as first written): the
    oracle `encode` must match bit for bit, and the baseline of bench/compress_speed.py."""
    levels = LEVELS[bits]
    midpoints = (levels[1:] + levels[:-1]) / 2
    blocks = weight.to(torch.float32).reshape(-1, GROUP)
    base = nearest_scale_bytes(blocks.abs().amax(dim=1))
    best_err, best = torch.full((blocks.shape[0],), float("inf")), base
    for step in SEARCH_STEPS:
        candidate = (base + step).clamp(0, 255)
        scale = decode_scales(candidate).unsqueeze(1)
        err = (levels[torch.bucketize(blocks / scale, midpoints)] * scale - blocks).square_().sum(dim=1)
        better = err < best_err
        best_err, best = torch.where(better, err, best_err), torch.where(better, candidate, best)
    codes = torch.bucketize(blocks / decode_scales(best).unsqueeze(1), midpoints).to(torch.uint8)
    rows, k = weight.shape
    return pack_codes(codes.reshape(rows, k), bits), best.to(torch.uint8).reshape(rows, k // GROUP)


def decode(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
           name: str = "tensor") -> torch.Tensor:
    """The reference decoder: (codes, scales) -> [rows, K]; bits follow from the two shapes."""
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TWXFormatError(f"{name}: codes and scales must be uint8, got {codes.dtype} and {scales.dtype}")
    if codes.dim() != 2 or scales.dim() != 2 or codes.shape[0] != scales.shape[0]:
        raise TWXFormatError(f"{name}: codes {tuple(codes.shape)} and scales {tuple(scales.shape)} do not pair up")
    k = scales.shape[1] * GROUP
    bits, remainder = divmod(codes.shape[1] * 8, k)
    if remainder or bits not in LEVELS:
        raise TWXFormatError(f"{name}: codes {tuple(codes.shape)} hold {codes.shape[1] * 8 / k:g} bits per weight "
                             f"for K = {k}; TWX codes are {sorted(LEVELS)} bits")
    values = LEVELS[bits][unpack_codes(codes, bits, k).long()]
    scale = decode_scales(scales).repeat_interleave(GROUP, dim=1)
    return (values * scale).to(dtype)


def code_bits(codes: torch.Tensor, scales: torch.Tensor) -> int:
    return codes.shape[1] * 8 // (scales.shape[1] * GROUP)
