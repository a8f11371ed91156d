"""Reconstruction error of the TWX formats against round-to-nearest at the same bits per weight,
on a checkpoint's routed experts (by default the organism the workflow published).

    python bench/quality.py --upstream results/upstream [--json bench/results/quality.json]

Every weight counts the same: the error of a format is sum((decoded - W)^2) / sum(W^2) over all
routed-expert weights W, decoded exactly from their upstream encoding (MXFP4 -> float32).
Baselines: round-to-nearest per 32-weight block with the block's absolute maximum as scale.
  RTN-b   uniform 2^b levels spanning [-absmax, absmax];
  INT-b   symmetric integers -(2^(b-1)-1) .. 2^(b-1)-1 times absmax / (2^(b-1)-1).
Each comes twice: with its scale in 8 bits (UE5M3, rounded up so that nothing clips), i.e. at
TWX's own bits per weight, which is what the targets compare with; and with its scale in full
precision, a stricter baseline that spends more bits than TWX, shown beside it. The best of each
kind is the baseline. TWX2.5 is compared with the same 2/3-bit mix of the baseline: each expert
gets the bits the TWX2.5 plan gives it.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from moeshrink.compress.builder import allocate_bits, expert_norms, expert_weights, relative_error
from moeshrink.core import expert_formats
from moeshrink.core.arch import adapter_for
from moeshrink.core.ioutil import atomic_write_json, read_json
from moeshrink.core.provenance import Provenance
from moeshrink.formats import twx
from moeshrink.formats.source_experts import source_format

TARGET_RATIO = 0.7


def block_absmax(weight: torch.Tensor, scale_in_8_bits: bool) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = weight.reshape(-1, twx.GROUP)
    amax = blocks.abs().amax(1, keepdim=True).clamp(min=1e-30)
    if scale_in_8_bits:
        byte = twx.nearest_scale_bytes(amax)
        byte = torch.where(twx.decode_scales(byte) < amax, byte + 1, byte).clamp(max=255)
        amax = twx.decode_scales(byte)
    return blocks, amax


def rtn_uniform(weight: torch.Tensor, bits: int, scale_in_8_bits: bool) -> torch.Tensor:
    blocks, amax = block_absmax(weight, scale_in_8_bits)
    steps = 2 ** bits - 1
    codes = torch.round((blocks / amax + 1) / 2 * steps).clamp(0, steps)
    return ((codes * 2 / steps - 1) * amax).reshape(weight.shape)


def rtn_int(weight: torch.Tensor, bits: int, scale_in_8_bits: bool) -> torch.Tensor:
    blocks, amax = block_absmax(weight, scale_in_8_bits)
    top = 2 ** (bits - 1) - 1
    scale = amax / top
    return (torch.round(blocks / scale).clamp(-top, top) * scale).reshape(weight.shape)


def twx_roundtrip(weight: torch.Tensor, bits: int) -> torch.Tensor:
    codes, scales = twx.encode(weight, bits)
    return twx.decode(codes, scales, torch.float32)


METHODS = {
    "twx": twx_roundtrip,
    "rtn": lambda w, b: rtn_uniform(w, b, True), "int": lambda w, b: rtn_int(w, b, True),
    "rtn_fullscale": lambda w, b: rtn_uniform(w, b, False), "int_fullscale": lambda w, b: rtn_int(w, b, False),
}
BASELINES = {"8-bit scale": ("rtn", "int"), "full-precision scale": ("rtn_fullscale", "int_fullscale")}


def measure(upstream: Path) -> dict:
    config = read_json(upstream / "config.json")
    adapter = adapter_for(config)
    fmt = source_format(config)
    layers = adapter.moe_layers(config)
    kept = {layer: list(range(adapter.num_experts(config))) for layer in layers}
    twx2_5 = expert_formats.get("twx2.5", "bench")
    plan_bits = allocate_bits(expert_norms(upstream, adapter, fmt, kept),
                              relative_error(twx2_5, 2) - relative_error(twx2_5, 3), twx2_5.default_budget, twx2_5)
    squared_error = {f"{m}{b}": 0.0 for m in METHODS for b in (2, 3)}
    squared_error.update({f"{m}_mix": 0.0 for m in METHODS})
    total, weights = 0.0, 0
    seconds = {m: 0.0 for m in METHODS}
    for ref, weight in expert_weights(upstream, adapter, fmt):
        total += float(weight.double().pow(2).sum())
        weights += weight.numel()
        mix_bits = plan_bits[ref.layer][ref.expert]
        for method, roundtrip in METHODS.items():
            for bits in (2, 3):
                start = time.perf_counter()
                error = float((roundtrip(weight, bits) - weight).double().pow(2).sum())
                seconds[method] += time.perf_counter() - start
                squared_error[f"{method}{bits}"] += error
                if bits == mix_bits:
                    squared_error[f"{method}_mix"] += error
    relative = {k: v / total for k, v in squared_error.items()}

    def ratio(twx_key: str, suffix: str, kinds: tuple[str, ...]) -> float:
        return relative[twx_key] / min(relative[f"{kind}{suffix}"] for kind in kinds)

    three_bit_share = sum(b == 3 for layer in plan_bits.values() for b in layer.values()) / sum(
        len(layer) for layer in plan_bits.values())
    return {
        "weights": weights,
        "relative_squared_error": relative,
        "ratios": {name: {"twx3_over_rtn3": ratio("twx3", "3", kinds),
                          "twx2_5_over_rtn_mix": ratio("twx_mix", "_mix", kinds),
                          "twx2_over_rtn2": ratio("twx2", "2", kinds)} for name, kinds in BASELINES.items()},
        "twx2_5_three_bit_expert_share": three_bit_share,
        "target_ratio": TARGET_RATIO,
        "seconds": seconds,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--upstream", default="results/organism/upstream", type=Path)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    prov = Provenance("bench_quality", {"upstream": str(args.upstream)}, inputs=[str(args.upstream)])
    result = measure(args.upstream)
    e = result["relative_squared_error"]
    print(f"routed-expert weights: {result['weights']:,}; relative squared error:")
    for label, suffix in (("3-bit", "3"), ("2-bit", "2"),
                          (f"2/3 mix ({result['twx2_5_three_bit_expert_share']:.0%} of experts at 3 bits)", "_mix")):
        print(f"  {label}: TWX {e['twx' + suffix]:.4f}  " + "  ".join(
            f"{kind.upper()} {e[kind + suffix]:.4f}" for kind in METHODS if kind != "twx"))
    for name, ratios in result["ratios"].items():
        print(f"against round-to-nearest, {name}: TWX3/RTN3 = {ratios['twx3_over_rtn3']:.3f}, "
              f"TWX2.5/RTN mix = {ratios['twx2_5_over_rtn_mix']:.3f}, TWX2/RTN2 = {ratios['twx2_over_rtn2']:.3f}")
    target = result["ratios"]["8-bit scale"]
    ok3, ok25 = target["twx3_over_rtn3"] <= TARGET_RATIO, target["twx2_5_over_rtn_mix"] <= TARGET_RATIO
    print(f"targets (same bits per weight, <= {TARGET_RATIO}): TWX3 {'met' if ok3 else 'MISSED'}, "
          f"TWX2.5 {'met' if ok25 else 'MISSED'}")
    if args.json:
        atomic_write_json(args.json, {**result, "provenance": prov.record()})
    return 0 if ok3 and ok25 else 1


if __name__ == "__main__":
    sys.exit(main())
