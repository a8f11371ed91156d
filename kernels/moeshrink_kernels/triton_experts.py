"""Packed-expert matmuls for CUDA GPUs with Triton: codes and scales are decoded inside the matmul's K
loop, never materialised. Same numbers as the reference decoders (`moeshrink.formats.twx`, `moeshrink.formats.mxfp4`)
up to the rounding of decoded weights to x's dtype in the dot (float32 x: tf32 on the GPU).

Triton is imported only when a kernel runs: this module imports without it. `triton_available()`
says whether the kernels can run here: triton importable and a CUDA GPU present, or the Triton
interpreter switched on (TRITON_INTERPRET=1 before the first kernel call; CPU tensors, slow).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from moeshrink.core.errors import MoeshrinkError
from moeshrink.formats import mxfp4, twx, twx_vq

MXFP4 = 4  # format id of MXFP4; TWX v1 formats are identified by their bits (2, 3), TWX v2 by 10 + bits
TWX_V2 = 10
CODE_BITS = {2: 2, 3: 3, MXFP4: 4, TWX_V2 + 2: 2, TWX_V2 + 3: 3}
CODES_PER_UNIT = {2: 4, 3: 8, MXFP4: 2, TWX_V2 + 2: 4, TWX_V2 + 3: 8}


class TritonUnavailable(MoeshrinkError, RuntimeError):
    pass


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return interpreter_on() or torch.cuda.is_available()


def _kernels():
    if not triton_available():
        raise TritonUnavailable("the Triton packed-expert kernels need triton and a CUDA GPU "
                                "(or TRITON_INTERPRET=1 for the CPU interpreter)")
    from moeshrink_kernels import _triton_packed

    return _triton_packed


@dataclass(frozen=True)
class KernelConfig:
    block_m: int = 16
    block_n: int = 64
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    use_dot: bool = True  # tensor-core tl.dot; False: broadcast-multiply and sum (for block_m <= 4)
    swap_ab: bool = True  # with tl.dot: y^T = W x^T, the decoded weights as the dot's first operand
    lut: bool = False  # levels gathered from a small table in memory; False: computed (selects, bit tricks)

    def check(self, fmt: int) -> None:
        units = self.block_k // CODES_PER_UNIT[fmt]
        for name in ("block_m", "block_n", "block_k", "split_k"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
        if self.block_k % 32:
            raise ValueError(f"block_k must be a multiple of 32, got {self.block_k}")
        if self.use_dot and (self.block_m < 16 or self.block_n < 16 or units < 16):
            raise ValueError(f"tl.dot needs block_m, block_n and block_k / {CODES_PER_UNIT[fmt]} >= 16, got {self}")


def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def default_config(fmt: int, rows: int, n: int, k: int, blocks_m: int = 1,
                   device: torch.device | None = None) -> KernelConfig:
    """A config by rows per expert: small batches stream weights with wide K steps (and split K when
    the grid would not fill the GPU), large ones use bigger row blocks to reuse each decoded tile.
    The same for every format for now (`fmt` is there for per-format tuning); untuned guesses until
    bench/triton_bandwidth.py has run on a GPU."""
    if rows <= 16:
        config = KernelConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
    elif rows <= 32:
        config = KernelConfig(block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=3)
    else:
        config = KernelConfig(block_m=64, block_n=128, block_k=128, num_warps=8, num_stages=3)
    return with_split_k(config, blocks_m, n, k, device)


def with_split_k(config: KernelConfig, blocks_m: int, n: int, k: int, device: torch.device | None = None,
                 waves: int = 2, most: int = 8) -> KernelConfig:
    """Split K (partial sums added atomically) until the grid has `waves` programs per multiprocessor."""
    programs = blocks_m * -(-n // config.block_n)
    k_steps = -(-k // config.block_k)
    split = 1
    target = waves * _multiprocessors(device or torch.device("cpu"))
    while programs * split < target and split * 2 <= min(k_steps, most):
        split *= 2
    return replace(config, split_k=split)


_LEVELS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _levels(fmt: int, device: torch.device) -> torch.Tensor:
    """The table the kernel gathers from: TWX levels, E2M1 values by code (sign bit 3), or TWX v2's
    codebook (flat, 4 values per entry)."""
    if (fmt, device) not in _LEVELS:
        if fmt > TWX_V2:
            table = twx_vq.codebooks()[fmt - TWX_V2].reshape(-1)
        else:
            table = torch.cat([mxfp4.E2M1_VALUES, -mxfp4.E2M1_VALUES]) if fmt == MXFP4 else twx.LEVELS[fmt]
        _LEVELS[fmt, device] = table.to(device)
    return _LEVELS[fmt, device]


def _block_table(counts: list[int], block_m: int, selected: list[bool], device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks of up to block_m rows, each of one expert, over rows sorted by expert (counts[e] rows
    of expert e, back to back); only experts with selected[e]. -> (expert, first row, end row)."""
    blocks = []
    segment = 0
    for e, count in enumerate(counts):
        if selected[e]:
            blocks += [(e, start, segment + count) for start in range(segment, segment + count, block_m)]
        segment += count
    table = torch.tensor(blocks, dtype=torch.int32).reshape(-1, 3).T.contiguous().to(device)
    return table[0], table[1], table[2]


def grouped_packed_matmul(x: torch.Tensor, counts: list[int], codes: torch.Tensor, scales: torch.Tensor,
                          code_offsets: torch.Tensor, fmts: list[int], out_dtype: torch.dtype = torch.float32,
                          config: KernelConfig | None = None) -> torch.Tensor:
    """y[P, N] for x[P, K] whose rows are sorted by expert (counts[e] rows of expert e); expert e's
    weight [N, K] is packed in format fmts[e] (TWX bits or MXFP4), its codes starting at byte
    code_offsets[e] of the flat uint8 `codes`, its scales at scales[e] ([E, N, K/32] uint8).
    One launch per format present."""
    kernels = _kernels()
    n, k = scales.shape[1], scales.shape[2] * twx.GROUP
    if x.dim() != 2 or x.shape[1] != k or sum(counts) != x.shape[0]:
        raise ValueError(f"x {tuple(x.shape)} does not fit weights [{n}, {k}] and {sum(counts)} routed rows")
    if codes.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"codes and scales must be uint8, got {codes.dtype} and {scales.dtype}")
    if not len(counts) == len(fmts) == code_offsets.shape[0] <= scales.shape[0]:
        raise ValueError(f"{len(counts)} experts' rows, {len(fmts)} formats, {code_offsets.shape[0]} offsets "
                         f"and {scales.shape[0]} experts' scales do not match")
    if any(f not in CODE_BITS for f in fmts):
        raise ValueError(f"formats must be TWX bits 2, 3, {MXFP4} (MXFP4) or TWX v2's 12, 13, got {sorted(set(fmts))}")
    for e, offset in enumerate(code_offsets.tolist()):  # the kernel does not bound-check its reads
        if counts[e] and not 0 <= offset <= codes.numel() - n * k * CODE_BITS[fmts[e]] // 8:
            raise ValueError(f"expert {e}: codes at byte {offset} run past the {codes.numel()}-byte buffer")
    x = x.contiguous()
    codes, scales = codes.reshape(-1).contiguous(), scales.contiguous()
    code_offsets = code_offsets.to(device=x.device, dtype=torch.int64).contiguous()
    present = sorted({f for f, c in zip(fmts, counts) if c})
    if not present:
        return torch.zeros(x.shape[0], n, dtype=out_dtype, device=x.device)
    configs = {}
    for f in present:
        active = [c for fe, c in zip(fmts, counts) if fe == f and c]
        blocks = sum(-(-c // 16) for c in active)
        configs[f] = config or default_config(f, max(active), n, k, blocks, x.device)
        configs[f].check(f)
    atomic = any(c.split_k > 1 for c in configs.values())  # formats write disjoint rows: plain stores
    out = (torch.zeros if atomic else torch.empty)(x.shape[0], n, dtype=torch.float32 if atomic else out_dtype,
                                                   device=x.device)
    for f in present:
        table = _block_table(counts, configs[f].block_m, [fe == f for fe in fmts], x.device)
        kernels.launch(x, codes, scales, _levels(f, x.device), out, *table, code_offsets, n, k, f, configs[f])
    return out.to(out_dtype)


def _check_x(x: torch.Tensor) -> None:
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bf16, fp16 or fp32, got {x.dtype}")


def twx_format_id(bits: int, version: int) -> int:
    return bits + (TWX_V2 if version == 2 else 0)


def twx_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bits: int,
               out_dtype: torch.dtype | None = None, config: KernelConfig | None = None, version: int = 1
               ) -> torch.Tensor:
    """x [..., K] @ W^T for W [N, K] in TWX (codes [N, K*bits/8], scales [N, K/32]), format version 1 or 2."""
    _check_x(x)
    if bits not in (2, 3) or twx.code_bits(codes, scales) != bits:
        raise ValueError(f"codes {tuple(codes.shape)} and scales {tuple(scales.shape)} are not {bits}-bit TWX")
    return _linear(x, codes, scales, twx_format_id(bits, version), out_dtype, config)


def mxfp4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                 out_dtype: torch.dtype | None = None, config: KernelConfig | None = None) -> torch.Tensor:
    """x [..., K] @ W^T for W [N, K] in MXFP4 (packed [N, K/2], E8M0 scales [N, K/32])."""
    _check_x(x)
    if packed.dim() != 2 or packed.shape[1] * 2 != scales.shape[1] * mxfp4.BLOCK:
        raise ValueError(f"packed {tuple(packed.shape)} and scales {tuple(scales.shape)} do not pair up")
    return _linear(x, packed, scales, MXFP4, out_dtype, config)


def _linear(x, codes, scales, fmt, out_dtype, config) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    offsets = torch.zeros(1, dtype=torch.int64)
    y = grouped_packed_matmul(rows, [rows.shape[0]], codes, scales[None], offsets, [fmt],
                              out_dtype or x.dtype, config)
    return y.reshape(*x.shape[:-1], scales.shape[0])


def _routed(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
            w13, w2) -> torch.Tensor:
    """sum_k w_k * down_e(silu(gate_e(x)) * up_e(x)); w13(xs, counts) and w2(hs, counts) run the
    grouped matmuls on rows sorted by expert."""
    tokens = x.reshape(-1, x.shape[-1])
    ids = topk_ids.reshape(tokens.shape[0], -1).to(torch.int64)
    flat = ids.reshape(-1)
    chosen = torch.nonzero(flat >= 0).squeeze(1)
    order = chosen[torch.argsort(flat[chosen], stable=True)]
    counts = torch.bincount(flat[order], minlength=num_experts).tolist()
    token_of = order // ids.shape[1]
    out = torch.zeros(tokens.shape, dtype=torch.float32, device=x.device)
    if order.numel():
        gate_up = w13(tokens[token_of], counts)
        inter = gate_up.shape[1] // 2
        hidden = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype)
        y = w2(hidden, counts)
        weights = topk_weights.reshape(-1).to(torch.float32)[order]
        out.index_add_(0, token_of, y * weights[:, None])
    return out.to(x.dtype).reshape(x.shape)


def triton_twx_routed_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                              w13_codes: torch.Tensor, w13_scales: torch.Tensor, w2_codes: torch.Tensor,
                              w2_scales: torch.Tensor, layout: torch.Tensor, version: int = 1) -> torch.Tensor:
    """`experts.twx_routed_experts` on the GPU: one launch per code width and projection."""
    _check_x(x)
    table = layout.cpu()  # offsets are bound-checked on the host, then copied to x's device
    bits = [twx_format_id(b, version) for b in table[:, 0].tolist()]
    offsets13, offsets2 = table[:, 1], table[:, 2]

    def w13(xs, counts):
        return grouped_packed_matmul(xs, counts, w13_codes, w13_scales, offsets13, bits)

    def w2(hs, counts):
        return grouped_packed_matmul(hs, counts, w2_codes, w2_scales, offsets2, bits)

    return _routed(x, topk_weights, topk_ids, len(bits), w13, w2)


def triton_mxfp4_routed_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                                w13_packed: torch.Tensor, w13_scales: torch.Tensor, w2_packed: torch.Tensor,
                                w2_scales: torch.Tensor) -> torch.Tensor:
    """`experts.mxfp4_routed_experts` on the GPU: packed [E, N, K/2], scales [E, N, K/32]."""
    _check_x(x)
    experts = w13_packed.shape[0]
    stride13 = w13_packed[0].numel()
    stride2 = w2_packed[0].numel()
    offsets13 = torch.arange(experts, dtype=torch.int64) * stride13
    offsets2 = torch.arange(experts, dtype=torch.int64) * stride2
    fmts = [MXFP4] * experts

    def w13(xs, counts):
        return grouped_packed_matmul(xs, counts, w13_packed, w13_scales, offsets13, fmts)

    def w2(hs, counts):
        return grouped_packed_matmul(hs, counts, w2_packed, w2_scales, offsets2, fmts)

    return _routed(x, topk_weights, topk_ids, experts, w13, w2)
