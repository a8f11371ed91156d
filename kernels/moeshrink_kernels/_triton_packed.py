"""The Triton kernel behind `triton_experts`: y = x @ W^T with W packed (TWX 2/3-bit or MXFP4),
decoded inside the K loop. Imports triton at module level: import it only through `triton_experts`.

A "unit" is the smallest run of codes that starts on a byte: 4 codes in 1 byte (TWX2), 8 codes in
3 bytes (TWX3, a 24-bit little-endian word), 2 codes in 1 byte (MXFP4, low nibble first). TWX v2 has
the same units, read as indices of 4 codes' bits into its codebook (1 per unit at 2 bits, 2 at 3):
position j of a unit is entry j % 4 of codeword (word >> (4 * BITS * (j // 4))), gathered from the
flat codebook. A K step
of BLOCK_K inputs holds UNITS = BLOCK_K / PER units; the kernel loads each unit once, and for each
position j in the unit multiplies the decoded [UNITS, BLOCK_N] slice with the matching strided
columns x[:, k0 + PER * u + j]. Codes are never re-interleaved, so no reshapes and each code byte is
loaded once; x (small, cache-resident) is read with stride PER instead, and each unit's scale byte
is gathered per unit.

Rows come in blocks of up to BLOCK_M rows of one expert (a block table), so one launch covers all
the experts of one code width; each expert's codes start at its own byte offset in a flat buffer.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeshrink.formats import twx

# TWX levels as compile-time constants for the arithmetic (non-table) decode
T3_0, T3_1, T3_2, T3_3, T3_4, T3_5, T3_6, T3_7 = (tl.constexpr(float(v)) for v in twx.LEVELS[3].tolist())
T2_0, T2_1, T2_2, T2_3 = (tl.constexpr(float(v)) for v in twx.LEVELS[2].tolist())


@triton.jit
def _twx3_level(code):
    b0 = (code & 1) != 0
    b1 = (code & 2) != 0
    low = tl.where(b1, tl.where(b0, T3_3, T3_2), tl.where(b0, T3_1, T3_0))
    high = tl.where(b1, tl.where(b0, T3_7, T3_6), tl.where(b0, T3_5, T3_4))
    return tl.where((code & 4) != 0, high, low)


@triton.jit
def _twx2_level(code):
    b0 = (code & 1) != 0
    return tl.where((code & 2) != 0, tl.where(b0, T2_3, T2_2), tl.where(b0, T2_1, T2_0))


@triton.jit
def _e2m1_value(code):
    # E2M1 bits placed in an fp16 (sign -> bit 15, exponent+mantissa -> bits 11..9): the fp16 equals
    # the E2M1 value times 2**-14 for normal and subnormal codes alike.
    half = ((code & 8) << 12) | ((code & 7) << 9)
    return half.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def _decode_scale(byte, FMT: tl.constexpr):
    if FMT == 4:  # E8M0: 2**(byte - 127); byte 0 is the fp32 subnormal 2**-127
        bits = tl.where(byte == 0, 0x00400000, byte << 23)
    else:  # UE5M3: 2**((byte >> 3) - 20) * (1 + (byte & 7) / 8)
        bits = (((byte >> 3) + (127 - 20)) << 23) | ((byte & 7) << 20)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _level(code, levels_ptr, FMT: tl.constexpr, LUT: tl.constexpr):
    if LUT:
        value = tl.load(levels_ptr + code)
    elif FMT == 3:
        value = _twx3_level(code)
    elif FMT == 2:
        value = _twx2_level(code)
    else:
        value = _e2m1_value(code)
    return value


@triton.jit
def packed_matmul_kernel(
        x_ptr, codes_ptr, scales_ptr, levels_ptr, y_ptr,
        block_expert_ptr, block_start_ptr, block_end_ptr, code_offset_ptr,
        N, K, stride_xm, stride_ym,
        FMT: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr, UNIT_BYTES: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
        USE_DOT: tl.constexpr, SWAP_AB: tl.constexpr, LUT: tl.constexpr, EVEN_K: tl.constexpr,
        EVEN_N: tl.constexpr, UPCAST_DOT: tl.constexpr, VQ: tl.constexpr):
    UNITS: tl.constexpr = BLOCK_K // PER
    CODE_MASK: tl.constexpr = (1 << BITS) - 1
    INDEX_MASK: tl.constexpr = (1 << (4 * BITS)) - 1
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    expert = tl.load(block_expert_ptr + pid_b).to(tl.int64)
    row_start = tl.load(block_start_ptr + pid_b)
    row_end = tl.load(block_end_ptr + pid_b)
    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N

    groups = K // 32
    row_bytes = K * BITS // 8
    code_cols = codes_ptr + tl.load(code_offset_ptr + expert) + cols[None, :] * row_bytes  # [1, BN]
    scale_cols = scales_ptr + expert * N * groups + cols[None, :] * groups
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm  # [BM, 1]
    units = tl.arange(0, UNITS)

    k_steps = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_steps, SPLIT_K)
    first = pid_k * per_split
    last = tl.minimum(first + per_split, k_steps)
    if SWAP_AB:  # y^T = W x^T: the decoded tile is the dot's A operand, no trip through shared memory
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(first, last):
        unit_k = step * BLOCK_K + units * PER  # first input index of each unit
        k_ok = unit_k < K  # K and BLOCK_K are multiples of 32: a unit is wholly in or out
        # masks only where a block can overhang (EVEN_*: the launcher found that none does)
        if EVEN_K and EVEN_N:
            w_mask, w_other = None, None
        elif EVEN_K:
            w_mask, w_other = col_mask[None, :], 0
        elif EVEN_N:
            w_mask, w_other = k_ok[:, None], 0
        else:
            w_mask, w_other = k_ok[:, None] & col_mask[None, :], 0
        if EVEN_K:
            x_mask = row_mask[:, None]
        else:
            x_mask = row_mask[:, None] & k_ok[None, :]
        byte_ptr = code_cols + (unit_k * BITS // 8)[:, None]  # [UNITS, BN]
        word = tl.load(byte_ptr, mask=w_mask, other=w_other).to(tl.int32)
        if UNIT_BYTES == 3:
            word = word | (tl.load(byte_ptr + 1, mask=w_mask, other=w_other).to(tl.int32) << 8)
            word = word | (tl.load(byte_ptr + 2, mask=w_mask, other=w_other).to(tl.int32) << 16)
        scale_byte = tl.load(scale_cols + (unit_k // 32)[:, None], mask=w_mask, other=w_other).to(tl.int32)
        scale = _decode_scale(scale_byte, FMT)
        for j in tl.static_range(PER):
            if VQ:
                index = (word >> ((j // 4) * 4 * BITS)) & INDEX_MASK
                value = tl.load(levels_ptr + index * 4 + (j % 4))
            else:
                value = _level((word >> (j * BITS)) & CODE_MASK, levels_ptr, FMT, LUT)
            w = (value * scale).to(x_ptr.dtype.element_ty)  # [UNITS, BN]
            xj = tl.load(x_rows + (unit_k + j)[None, :], mask=x_mask, other=0.0)  # [BM, UNITS]
            if UPCAST_DOT:  # weights still rounded to x's dtype, products in fp32
                w = w.to(tl.float32)
                xj = xj.to(tl.float32)
            if not USE_DOT:
                acc += tl.sum(xj.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
            elif SWAP_AB:
                acc = tl.dot(tl.trans(w), tl.trans(xj), acc)
            else:
                acc = tl.dot(xj, w, acc)

    if SWAP_AB:
        acc = tl.trans(acc)
    y = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
    y_mask = row_mask[:, None] & col_mask[None, :]
    if SPLIT_K == 1:
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        tl.atomic_add(y, acc, mask=y_mask)


# Triton 3.9's interpreter multiplies bf16 operands of tl.dot as their raw uint16 bit patterns:
# there, bf16 dots run in fp32 on bf16-rounded operands.
INTERPRETED = type(packed_matmul_kernel).__name__ == "InterpretedFunction"

# per format id (TWX v1 bits, 4 for MXFP4, 10 + bits for TWX v2): bits per code, codes per unit, bytes per unit
FORMATS = {2: (2, 4, 1), 3: (3, 8, 3), 4: (4, 2, 1), 12: (2, 4, 1), 13: (3, 8, 3)}


def constexprs(fmt: int, config, n: int, k: int, x_dtype: torch.dtype) -> dict:
    """The kernel's compile-time arguments for one launch."""
    bits, per, unit_bytes = FORMATS[fmt]
    return dict(FMT=fmt, BITS=bits, VQ=fmt > 10, PER=per, UNIT_BYTES=unit_bytes,
                BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=config.split_k,
                USE_DOT=config.use_dot, SWAP_AB=config.swap_ab and config.use_dot, LUT=config.lut,
                EVEN_K=k % config.block_k == 0, EVEN_N=n % config.block_n == 0,
                UPCAST_DOT=INTERPRETED and x_dtype == torch.bfloat16)


def launch(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, levels: torch.Tensor, out: torch.Tensor,
           block_expert: torch.Tensor, block_start: torch.Tensor, block_end: torch.Tensor,
           code_offsets: torch.Tensor, n: int, k: int, fmt: int, config) -> None:
    """One grouped launch; `out` must be zeroed float32 when config.split_k > 1."""
    grid = (block_expert.shape[0], triton.cdiv(n, config.block_n), config.split_k)
    packed_matmul_kernel[grid](
        x, codes, scales, levels, out, block_expert, block_start, block_end, code_offsets,
        n, k, x.stride(0), out.stride(0), **constexprs(fmt, config, n, k, x.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages)
