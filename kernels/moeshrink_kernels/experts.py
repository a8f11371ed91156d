"""Routed experts computed from packed weights, one expert at a time (CPU, or any torch device).

Never materialises more than one expert's decoded weights: for each expert the tokens chose,
decode its gate/up and down projections, run SiLU-gated MLP on those tokens, weight by the router
and accumulate. Numbers follow the reference decoders in `moeshrink.twx` and `moeshrink.mxfp4`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeshrink import mxfp4, twx


@dataclass(frozen=True)
class TWXLayout:
    """Where each expert's codes lie in a layer's flat code buffers. TWX2.5 mixes 2- and 3-bit
    experts, so codes are packed back to back at each expert's own width."""
    bits: tuple[int, ...]
    w13_offsets: tuple[int, ...]
    w2_offsets: tuple[int, ...]
    w13_bytes: int
    w2_bytes: int

    @staticmethod
    def of(bits: list[int], hidden: int, intermediate: int) -> "TWXLayout":
        w13_sizes = [2 * intermediate * hidden * b // 8 for b in bits]
        w2_sizes = [hidden * intermediate * b // 8 for b in bits]
        w13_offsets = [sum(w13_sizes[:e]) for e in range(len(bits))]
        w2_offsets = [sum(w2_sizes[:e]) for e in range(len(bits))]
        return TWXLayout(tuple(bits), tuple(w13_offsets), tuple(w2_offsets), sum(w13_sizes), sum(w2_sizes))

    def as_tensor(self) -> torch.Tensor:
        """[E, 3] int64: bits, w13 offset, w2 offset (what the custom op receives)."""
        return torch.tensor(list(zip(self.bits, self.w13_offsets, self.w2_offsets)), dtype=torch.int64)


def twx_expert(codes_flat: torch.Tensor, offset: int, bits: int, scales: torch.Tensor, dtype: torch.dtype
               ) -> torch.Tensor:
    """Decode one expert's projection: scales [rows, K/32] tell rows and K."""
    rows, k = scales.shape[0], scales.shape[1] * twx.GROUP
    width = k * bits // 8
    codes = codes_flat[offset:offset + rows * width].view(rows, width)
    return twx.decode(codes, scales, dtype)


def routed_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, decode_w13, decode_w2,
                   compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """sum_k w_k * down_e(silu(gate_e(x)) * up_e(x)) over each token's chosen experts; decode_w13(e)
    -> [2I, H] (gate rows first), decode_w2(e) -> [H, I]."""
    tokens = x.reshape(-1, x.shape[-1])
    out = torch.zeros(tokens.shape, dtype=torch.float32, device=x.device)
    ids = topk_ids.reshape(tokens.shape[0], -1)
    weights = topk_weights.reshape(tokens.shape[0], -1).to(torch.float32)
    for expert in torch.unique(ids).tolist():
        if expert < 0:
            continue
        token_index, slot = torch.where(ids == expert)
        chosen = tokens[token_index].to(compute_dtype)
        gate_up = chosen @ decode_w13(expert).to(compute_dtype).T
        intermediate = gate_up.shape[1] // 2
        hidden = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        y = hidden @ decode_w2(expert).to(compute_dtype).T
        out.index_add_(0, token_index, y.to(torch.float32) * weights[token_index, slot, None])
    return out.to(x.dtype).reshape(x.shape)


def twx_routed_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       w13_codes: torch.Tensor, w13_scales: torch.Tensor, w2_codes: torch.Tensor,
                       w2_scales: torch.Tensor, layout: torch.Tensor) -> torch.Tensor:
    table = layout.tolist()

    # decoded to bf16, as a bf16 model holds its weights (TWX values times UE5M3 scales need rounding)
    def w13(e: int) -> torch.Tensor:
        return twx_expert(w13_codes, table[e][1], table[e][0], w13_scales[e], torch.bfloat16)

    def w2(e: int) -> torch.Tensor:
        return twx_expert(w2_codes, table[e][2], table[e][0], w2_scales[e], torch.bfloat16)

    return routed_experts(x, topk_weights, topk_ids, w13, w2)


def mxfp4_routed_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                         w13_packed: torch.Tensor, w13_scales: torch.Tensor, w2_packed: torch.Tensor,
                         w2_scales: torch.Tensor) -> torch.Tensor:
    def w13(e: int) -> torch.Tensor:
        return mxfp4.decode(w13_packed[e], w13_scales[e], torch.float32)

    def w2(e: int) -> torch.Tensor:
        return mxfp4.decode(w2_packed[e], w2_scales[e], torch.float32)

    return routed_experts(x, topk_weights, topk_ids, w13, w2)
