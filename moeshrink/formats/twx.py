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

Two searches make the same choice: per weight (any source) and from a table (blocks whose values,
divided by the power of two just above their maximum, have at most 3 mantissa bits: every MXFP4
block). Dividing by a power of two scales every float32 step of the search exactly, so a block's
error for a candidate is a sum of per-value table entries weighted by how often each value occurs.
The table path sums exactly; the per-weight path sums in float32, whose rounding (at most 31 * 2**-24
of the sum) can reorder candidates closer than that, so a block whose best two candidates are within
`NEAR_TIE` of each other is decided by the per-weight path.
"""
from __future__ import annotations

from functools import cache

import numpy as np
import torch

from moeshrink.core.errors import MoeshrinkError
from moeshrink.formats.twx_layout import CODES, GROUP, SCALE_EXP_BIAS, SCALES, bits_per_weight  # noqa: F401

# float32 whatever the default dtype when imported (vLLM sets bfloat16 while it builds a model)
LEVELS: dict[int, torch.Tensor] = {
    3: torch.tensor([-1.0, -0.5534, -0.2948, -0.1286, 0.0, 0.2410, 0.5519, 1.0], dtype=torch.float32),
    2: torch.tensor([-1.0, -0.2884, 0.2884, 1.0], dtype=torch.float32),
}
# Scale candidates searched around the block's absolute maximum, in UE5M3 steps (1/8 octave).
SEARCH_STEPS = range(-8, 3)
_STEPS = np.asarray(SEARCH_STEPS)
# The table search keys a normalised value (|x0| < 1) by its float32 top 12 bits: sign, exponent and 3
# mantissa bits. A value with more mantissa bits, or nonzero below 2**-32 (where scaling back by the
# block's power of two could leave float32's normal range), sends its block to the per-weight search.
_KEY_SHIFT = 20
_N_KEYS = 1 << (32 - _KEY_SHIFT)
_KEY_VALUES = (np.arange(_N_KEYS, dtype=np.uint32) << _KEY_SHIFT).view(np.float32)
_KEY_VALID = (_KEY_VALUES == 0) | ((np.abs(_KEY_VALUES) < 1) & (np.abs(_KEY_VALUES) >= 2.0 ** -32))
# well above float32's worst rounding of a 32-term sum of squares (31 * 2**-24 ~ 1.9e-6 of the sum)
NEAR_TIE = 1e-5


class TWXFormatError(MoeshrinkError, ValueError):
    pass


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


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes uint8 [rows, K] -> uint8 [rows, K * bits / 8], little-endian bit order per row."""
    rows, k = codes.shape
    per_word = 8  # 8 codes fill 3 bytes (3-bit) or 2 bytes (2-bit)
    groups = codes.numpy().reshape(-1, per_word)
    words = np.zeros(groups.shape[0], np.dtype("<u4"))
    for i in range(per_word):
        words |= groups[:, i].astype(np.uint32) << np.uint32(i * bits)
    out = words.view(np.uint8).reshape(-1, 4)[:, :bits]  # bytes per 8 codes: `bits`
    return torch.from_numpy(np.ascontiguousarray(out).reshape(rows, k * bits // 8))


def unpack_codes(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    rows = packed.shape[0]
    words = packed.to(torch.int32).reshape(rows, k // 8, bits)
    value = words[..., 0]
    for i in range(1, bits):
        value = value + (words[..., i] << (8 * i))
    shifts = torch.arange(8, dtype=torch.int32) * bits
    return ((value.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(rows, k).to(torch.uint8)


def check_shape(shape: tuple, name: str) -> None:
    if len(shape) != 2 or shape[1] % GROUP:
        raise TWXFormatError(f"{name}: TWX needs a 2-D weight whose input dimension is a multiple of {GROUP}, "
                             f"got shape {tuple(shape)}")


def check_encodable(shape: tuple, bits: int, widths, name: str, what: str = "TWX") -> None:
    if bits not in widths:
        raise TWXFormatError(f"{name}: {what} has {sorted(widths)}-bit codes, not {bits}")
    check_shape(shape, name)


def non_finite(name: str, flat_index: int, k: int) -> TWXFormatError:
    """The error for a weight matrix [rows, k] whose first non-finite value is at `flat_index`."""
    return TWXFormatError(f"{name}: non-finite weights, the first at row {flat_index // k}, column {flat_index % k}: "
                          f"the source checkpoint is damaged")


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


@cache
def _search_tables(bits: int) -> tuple[np.ndarray, np.ndarray]:
    """For each of the 8 normalised maxima in [0.5, 1) with 3 mantissa bits (rows), each step (columns)
    and each key: the float32 squared error (as float64) and the code, from the search's own ops."""
    levels = LEVELS[bits]
    midpoints = (levels[1:] + levels[:-1]) / 2
    maxima = torch.tensor([0.5 * (1 + m / 8) for m in range(8)], dtype=torch.float32)
    scale = decode_scales(nearest_scale_bytes(maxima)[:, None] + torch.from_numpy(_STEPS)[None, :])[..., None]
    values = torch.from_numpy(_KEY_VALUES)[None, None, :]
    codes = torch.bucketize(values / scale, midpoints)
    error = (levels[codes] * scale - values).square_()
    return error.numpy().astype(np.float64), codes.to(torch.uint8).numpy()


def _key_counts(keys: np.ndarray) -> np.ndarray:
    return torch.bincount(torch.from_numpy(keys.astype(np.int32)).reshape(-1), minlength=_N_KEYS).numpy()


def _table_search(blocks: torch.Tensor, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """blocks float32 [n, 32] -> (scale bytes int64 [n], codes uint8 [n, 32], decided bool [n]); a block
    that is not decided (values off the table, or a near tie) has garbage in the first two."""
    n = blocks.shape[0]
    amax = blocks.abs().amax(dim=1)
    base = nearest_scale_bytes(amax).numpy()
    amax_mantissa, amax_octave = np.frexp(amax.numpy())
    raw = np.ldexp(blocks.numpy(), -amax_octave[:, None]).view(np.uint32)
    keys = np.right_shift(raw, _KEY_SHIFT, dtype=np.int64)  # int64: np.take's fast index type
    fits = (amax_mantissa > 0) & (base + _STEPS.min() >= 0) & (base + _STEPS.max() <= 255)
    low_bits = raw & ((1 << _KEY_SHIFT) - 1)
    if low_bits.any():  # whole-array checks first: an MXFP4 chunk passes them without a per-block pass
        fits &= ~low_bits.any(axis=1)
    key_counts = _key_counts(keys if fits.all() else keys[fits])
    if not _KEY_VALID[np.flatnonzero(key_counts)].all():
        fits &= np.take(_KEY_VALID, keys, mode="clip").all(axis=1)
        key_counts = _key_counts(keys[fits])
    decided = np.zeros(n, np.bool_)
    scale_bytes = np.zeros(n, np.int64)
    codes = np.zeros((n, GROUP), np.uint8)
    rows = np.flatnonzero(fits)
    if rows.size == 0:
        return scale_bytes, codes, decided
    if rows.size < n:
        keys = keys[rows]
    present = np.flatnonzero(key_counts)
    compact = np.zeros(_N_KEYS, np.int32)
    compact[present] = np.arange(present.size, dtype=np.int32)
    cell = np.take(compact, keys, mode="clip")
    cell += (np.arange(rows.size, dtype=np.int32) * np.int32(present.size))[:, None]
    counts = torch.bincount(torch.from_numpy(cell).reshape(-1), minlength=rows.size * present.size).numpy()
    counts = counts.reshape(rows.size, present.size).astype(np.float64)
    table_row = (amax_mantissa[rows].astype(np.float32).view(np.uint32) >> _KEY_SHIFT) & 7
    error_table, code_table = _search_tables(bits)
    row_values = np.unique(table_row)
    error = counts @ error_table[row_values[0]][:, present].T
    for row in row_values[1:]:  # a whole product per row value: cheaper than gathering each one's blocks
        error = np.where((table_row == row)[:, None], counts @ error_table[row][:, present].T, error)
    best = np.argmin(error, axis=1)
    best_error = error[np.arange(rows.size), best]
    # decided: every other candidate's error exceeds the best's by more than NEAR_TIE of its own
    decided[rows] = (error <= (best_error / (1 - NEAR_TIE))[:, None]).sum(axis=1) == 1
    scale_bytes[rows] = base[rows] + _STEPS[best]
    offset = (table_row.astype(np.int64) * _STEPS.size + best) * _N_KEYS
    codes[rows] = np.take(code_table, keys + offset[:, None], mode="clip")
    return scale_bytes, codes, decided


@torch.no_grad()
def encode(weight: torch.Tensor, bits: int, name: str = "tensor", chunk_rows: int = 256
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """float [rows, K] -> (codes uint8 [rows, K*bits/8], scales uint8 [rows, K/32])."""
    check_encodable(tuple(weight.shape), bits, LEVELS, name)
    levels = LEVELS[bits]
    midpoints = (levels[1:] + levels[:-1]) / 2
    rows, k = weight.shape
    all_blocks = weight.reshape(-1, GROUP)
    codes = np.empty((all_blocks.shape[0], GROUP), np.uint8)  # a byte per weight: a quarter of the floats
    scale_bytes = np.empty(all_blocks.shape[0], np.int64)
    undecided_chunks: list[np.ndarray] = []
    per_chunk = chunk_rows * k // GROUP
    for first_block in range(0, all_blocks.shape[0], per_chunk):  # a few MB at a time: memory stays flat
        blocks = all_blocks[first_block:first_block + per_chunk].to(torch.float32).contiguous()
        if not np.isfinite(blocks.numpy()).all():
            raise non_finite(name, first_block * GROUP + int((~torch.isfinite(blocks)).reshape(-1).nonzero()[0]), k)
        chunk = slice(first_block, first_block + blocks.shape[0])
        scale_bytes[chunk], codes[chunk], decided = _table_search(blocks, bits)
        undecided_chunks.append(first_block + np.flatnonzero(~decided))
    undecided = np.concatenate(undecided_chunks)
    if undecided.size:  # one per-weight search for all of them: its per-call cost is not per chunk
        rest = all_blocks[torch.from_numpy(undecided)].to(torch.float32)
        rest_bytes = _best_scale_bytes(rest, levels)
        scale_bytes[undecided] = rest_bytes.numpy()
        codes[undecided] = torch.bucketize(rest / decode_scales(rest_bytes).unsqueeze(1), midpoints).to(torch.uint8).numpy()
    return (pack_codes(torch.from_numpy(codes).reshape(rows, k), bits),
            torch.from_numpy(scale_bytes.astype(np.uint8)).reshape(rows, k // GROUP))


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


def checked_pair(codes: torch.Tensor, scales: torch.Tensor, widths, name: str, what: str = "TWX") -> tuple[int, int]:
    """(K, bits) of a codes/scales pair whose code width is one of `widths` (either format version)."""
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TWXFormatError(f"{name}: codes and scales must be uint8, got {codes.dtype} and {scales.dtype}")
    if codes.dim() != 2 or scales.dim() != 2 or codes.shape[0] != scales.shape[0]:
        raise TWXFormatError(f"{name}: codes {tuple(codes.shape)} and scales {tuple(scales.shape)} do not pair up")
    k = scales.shape[1] * GROUP
    bits, remainder = divmod(codes.shape[1] * 8, k)
    if remainder or bits not in widths:
        raise TWXFormatError(f"{name}: codes {tuple(codes.shape)} hold {codes.shape[1] * 8 / k:g} bits per weight "
                             f"for K = {k}; {what} codes are {sorted(widths)} bits")
    return k, bits


def decode(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
           name: str = "tensor") -> torch.Tensor:
    """The reference decoder: (codes, scales) -> [rows, K]; bits follow from the two shapes."""
    k, bits = checked_pair(codes, scales, LEVELS, name)
    values = LEVELS[bits][unpack_codes(codes, bits, k).long()]
    scale = decode_scales(scales).repeat_interleave(GROUP, dim=1)
    return (values * scale).to(dtype)


def code_bits(codes: torch.Tensor, scales: torch.Tensor) -> int:
    return codes.shape[1] * 8 // (scales.shape[1] * GROUP)


def quantization_config(fmt, expert_bits: dict, source_format: str) -> dict:
    """config.json's `quantization_config` of a build in a TWX format (`fmt`, a registry entry):
    what the vLLM plugin reads to lay out and decode the experts."""
    return {
        "quant_method": fmt.quant_method,
        "format": fmt.name,
        "format_version": 1,
        "group_size": GROUP,
        "scale_encoding": "ue5m3",
        "scale_exponent_bias": SCALE_EXP_BIAS,
        "levels": {str(b): [float(v) for v in LEVELS[b]] for b in sorted(LEVELS)},
        "tensors": {"codes": CODES, "scales": SCALES},
        "expert_bits": expert_bits,
        "source_format": source_format,
    }
