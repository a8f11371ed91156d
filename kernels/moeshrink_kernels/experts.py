"""Routed experts computed from packed weights (CPU, or any torch device).

Two paths:
- `grouped_kernel_experts` (vLLM on CPU): the experts decoded to the activations' dtype and handed to
  vLLM's own CPU MoE kernel (`cpu_fused_moe`), so a packed build computes exactly what its decoded twin
  computes when served plainly. A layer whose decoded experts fit what is left of the decoded-layer
  budget (`MOESHRINK_DECODED_LAYERS_MIB`) is decoded and prepacked once, on its first call, and kept:
  decoding every step cost three quarters of the expert op and a third of a served step on the organism.
  Other layers decode only the experts a batch chose, in groups within `MOESHRINK_DECODE_BUDGET_MIB`;
- `routed_experts` (anywhere torch runs): one expert at a time, float32 matmuls.
Numbers follow the reference decoders in `moeshrink.formats.twx` and `moeshrink.formats.mxfp4`.
"""
from __future__ import annotations

import json
import logging
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeshrink.formats import mxfp4, twx, twx_vq
from moeshrink_kernels import DECODED_LAYERS_LINE

# TWX's reference codec by format_version
TWX_CODECS = {1: twx, 2: twx_vq}


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
    def of(bits: list[int], hidden: int, intermediate: int) -> TWXLayout:
        w13_sizes = [2 * intermediate * hidden * b // 8 for b in bits]
        w2_sizes = [hidden * intermediate * b // 8 for b in bits]
        w13_offsets = [sum(w13_sizes[:e]) for e in range(len(bits))]
        w2_offsets = [sum(w2_sizes[:e]) for e in range(len(bits))]
        return TWXLayout(tuple(bits), tuple(w13_offsets), tuple(w2_offsets), sum(w13_sizes), sum(w2_sizes))

    def as_tensor(self) -> torch.Tensor:
        """[E, 3] int64: bits, w13 offset, w2 offset (what the custom op receives)."""
        return torch.tensor(list(zip(self.bits, self.w13_offsets, self.w2_offsets)), dtype=torch.int64)


def twx_expert(codes_flat: torch.Tensor, offset: int, bits: int, scales: torch.Tensor, dtype: torch.dtype,
               version: int = 1) -> torch.Tensor:
    """Decode one expert's projection: scales [rows, K/32] tell rows and K."""
    rows, k = scales.shape[0], scales.shape[1] * twx.GROUP
    width = k * bits // 8
    codes = codes_flat[offset:offset + rows * width].view(rows, width)
    return TWX_CODECS[version].decode(codes, scales, dtype)


Decoder = Callable[[int], torch.Tensor]
DECODE_BUDGET_ENV = "MOESHRINK_DECODE_BUDGET_MIB"
DEFAULT_DECODE_BUDGET_MIB = 1024


@dataclass(frozen=True)
class CPUKernel:
    """vLLM's CPU grouped-GEMM MoE kernel as vLLM would pick it for the same unquantized layer: its
    instruction set and the intermediate size it pads experts to. `isa == ""`: no such kernel."""
    isa: str = ""
    padded_intermediate: int = 0


DECODED_LAYERS_ENV = "MOESHRINK_DECODED_LAYERS_MIB"
DEFAULT_DECODED_LAYERS_MIB = 256
log = logging.getLogger("vllm.moeshrink")  # vLLM shows only loggers under its own name


_amx_allowed = False


def _allow_amx(isa: str) -> None:
    """Ask Linux for the AMX tile state before vLLM's AMX kernel runs: a process whose first AMX
    instruction comes from that kernel (not from a oneDNN matmul, which asks itself) dies of SIGILL."""
    global _amx_allowed
    if isa == "amx" and not _amx_allowed:
        _amx_allowed = bool(torch._C._cpu._init_amx())


def decode_budget_bytes() -> int:
    return int(float(os.environ.get(DECODE_BUDGET_ENV, DEFAULT_DECODE_BUDGET_MIB)) * 2**20)


def decoded_layers_budget_bytes() -> int:
    return int(float(os.environ.get(DECODED_LAYERS_ENV, DEFAULT_DECODED_LAYERS_MIB)) * 2**20)


@dataclass
class DecodedLayer:
    """One layer's experts decoded and prepacked for the kernel, kept while its packed codes live."""
    codes: weakref.ref
    w13: torch.Tensor
    w2: torch.Tensor
    nbytes: int


_decoded_layers: dict[tuple, DecodedLayer] = {}


def decoded_layers_bytes() -> int:
    """What the kept decoded layers hold (live ones; a layer whose codes are gone is dropped)."""
    for key in [k for k, layer in _decoded_layers.items() if layer.codes() is None]:
        del _decoded_layers[key]
    return sum(layer.nbytes for layer in _decoded_layers.values())


def _kept_layer(codes: torch.Tensor, experts: int, decode_w13: Decoder, decode_w2: Decoder, hidden: int,
                kernel: CPUKernel, dtype: torch.dtype) -> DecodedLayer | None:
    """The layer whose packed codes are `codes`, decoded and prepacked once; None where it does not fit."""
    key = (codes.data_ptr(), dtype, kernel.isa)
    layer = _decoded_layers.get(key)
    if layer is not None and layer.codes() is codes:
        return layer
    nbytes = experts * 3 * kernel.padded_intermediate * hidden * torch.finfo(dtype).bits // 8
    if decoded_layers_bytes() + nbytes > decoded_layers_budget_bytes():
        return None
    from vllm._custom_ops import cpu_prepack_moe_weight

    w13, w2 = (cpu_prepack_moe_weight(w, kernel.isa) for w in _decoded_group(
        list(range(experts)), decode_w13, decode_w2, hidden, kernel.padded_intermediate, dtype))
    layer = DecodedLayer(weakref.ref(codes), w13, w2, sum(w.numel() * w.element_size() for w in (w13, w2)))
    _decoded_layers[key] = layer
    log.info("%s %s", DECODED_LAYERS_LINE, json.dumps({"layers": len(_decoded_layers), "bytes": decoded_layers_bytes(),
                                                      "budget_bytes": decoded_layers_budget_bytes()}))
    return layer


def _decoded_group(experts: list[int], decode_w13: Decoder, decode_w2: Decoder, hidden: int, padded: int,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, 2P, H] (gate rows at 0, up rows at P) and [n, H, P], zero beyond each expert's I."""
    w13 = torch.zeros(len(experts), 2 * padded, hidden, dtype=dtype)
    w2 = torch.zeros(len(experts), hidden, padded, dtype=dtype)
    for slot, expert in enumerate(experts):
        gate_up = decode_w13(expert)
        intermediate = gate_up.shape[0] // 2
        w13[slot, :intermediate] = gate_up[:intermediate]
        w13[slot, padded:padded + intermediate] = gate_up[intermediate:]
        w2[slot, :, :intermediate] = decode_w2(expert)
    return w13, w2


def grouped_kernel_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                           decode_w13: Decoder, decode_w2: Decoder, kernel: CPUKernel,
                           budget_bytes: int | None = None, codes: torch.Tensor | None = None,
                           experts: int = 0) -> torch.Tensor:
    """Through vLLM's `cpu_fused_moe`: the layer kept decoded (`codes`, the layer's packed codes, and its
    `experts` count name it) where it fits the decoded-layer budget, else the chosen experts decoded a
    group at a time (each group's decoded bytes within the decode budget). The kept layer and a single
    group (every organism batch) give the kernel's own bits; several groups are summed in float32."""
    from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight

    _allow_amx(kernel.isa)
    hidden = x.shape[-1]
    tokens = x.reshape(-1, hidden)
    ids = topk_ids.reshape(tokens.shape[0], -1).to(torch.int64)
    weights = topk_weights.reshape(tokens.shape[0], -1).to(torch.float32)
    kept = _kept_layer(codes, experts, decode_w13, decode_w2, hidden, kernel, x.dtype) if codes is not None else None
    if kept is not None:
        out = torch.empty_like(tokens)
        cpu_fused_moe(out, tokens.contiguous(), kept.w13, kept.w2, None, None,
                      torch.where(ids >= 0, weights, 0.0).contiguous(), ids.clamp(min=0).to(torch.int32).contiguous(),
                      "silu", kernel.isa)
        return out.reshape(x.shape)
    active = [e for e in torch.unique(ids).tolist() if e >= 0]
    per_expert = 3 * kernel.padded_intermediate * hidden * x.element_size()
    group_size = max(1, (budget_bytes or decode_budget_bytes()) // per_expert)
    groups = [active[i:i + group_size] for i in range(0, len(active), group_size)]
    total = torch.zeros(tokens.shape, dtype=torch.float32) if len(groups) > 1 else None
    out = torch.zeros_like(tokens)
    for experts in groups:
        local = torch.full((int(ids.max()) + 1,), -1, dtype=torch.int64)
        local[experts] = torch.arange(len(experts))
        mapped = local[ids.clamp(min=0)].masked_fill(ids < 0, -1)
        inside = mapped >= 0
        rows = torch.nonzero(inside.any(dim=1)).squeeze(1)
        w13, w2 = _decoded_group(experts, decode_w13, decode_w2, hidden, kernel.padded_intermediate, x.dtype)
        part = torch.empty((rows.numel(), hidden), dtype=x.dtype)
        cpu_fused_moe(part, tokens[rows].contiguous(), cpu_prepack_moe_weight(w13, kernel.isa),
                      cpu_prepack_moe_weight(w2, kernel.isa), None, None,
                      torch.where(inside[rows], weights[rows], 0.0).contiguous(),
                      mapped[rows].clamp(min=0).to(torch.int32).contiguous(), "silu", kernel.isa)
        if total is None:
            out[rows] = part
        else:
            total[rows] += part.to(torch.float32)
    return (out if total is None else total.to(x.dtype)).reshape(x.shape)


def expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One routed expert, down(silu(gate(x)) * up(x)): w13 [2I, H] (gate rows first), w2 [H, I]."""
    gate_up = x @ w13.T
    intermediate = gate_up.shape[1] // 2
    return (F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]) @ w2.T


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
        y = expert_mlp(chosen, decode_w13(expert).to(compute_dtype), decode_w2(expert).to(compute_dtype))
        out.index_add_(0, token_index, y.to(torch.float32) * weights[token_index, slot, None])
    return out.to(x.dtype).reshape(x.shape)


def _compute(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, decode_w13: Decoder,
             decode_w2: Decoder, kernel: CPUKernel, codes: torch.Tensor, experts: int) -> torch.Tensor:
    if kernel.isa:
        return grouped_kernel_experts(x, topk_weights, topk_ids, decode_w13, decode_w2, kernel, codes=codes,
                                      experts=experts)
    return routed_experts(x, topk_weights, topk_ids, decode_w13, decode_w2)


def twx_routed_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       w13_codes: torch.Tensor, w13_scales: torch.Tensor, w2_codes: torch.Tensor,
                       w2_scales: torch.Tensor, layout: torch.Tensor, kernel: CPUKernel = CPUKernel(),
                       version: int = 1) -> torch.Tensor:
    table = layout.tolist()

    # decoded to bf16, as a bf16 model holds its weights (TWX values times UE5M3 scales need rounding)
    def w13(e: int) -> torch.Tensor:
        return twx_expert(w13_codes, table[e][1], table[e][0], w13_scales[e], torch.bfloat16, version)

    def w2(e: int) -> torch.Tensor:
        return twx_expert(w2_codes, table[e][2], table[e][0], w2_scales[e], torch.bfloat16, version)

    return _compute(x, topk_weights, topk_ids, w13, w2, kernel, w13_codes, len(table))


def mxfp4_routed_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                         w13_packed: torch.Tensor, w13_scales: torch.Tensor, w2_packed: torch.Tensor,
                         w2_scales: torch.Tensor, kernel: CPUKernel = CPUKernel()) -> torch.Tensor:
    def w13(e: int) -> torch.Tensor:
        return mxfp4.decode(w13_packed[e], w13_scales[e], torch.float32)

    def w2(e: int) -> torch.Tensor:
        return mxfp4.decode(w2_packed[e], w2_scales[e], torch.float32)

    return _compute(x, topk_weights, topk_ids, w13, w2, kernel, w13_packed, w13_packed.shape[0])
