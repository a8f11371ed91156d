"""CPU speed of the plugin's expert computation (decode one expert, then its SiLU-gated MLP) against
a dense bf16 expert MLP of the same shape, both with torch on one thread, in the same run.

    python bench/kernel_speed.py [--json bench/results/kernel_speed.json]

Shapes: the organism's expert (hidden 128, intermediate 128) and a DeepSeek-V3-sized one
(7168 x 2048). Tokens per expert: 1, 16, 128. Prints microseconds per expert call and the ratio
packed / dense (above 1: the packed path is slower by that factor).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from moeshrink.core.ioutil import atomic_write_json
from moeshrink.core.provenance import Provenance
from moeshrink.formats import mxfp4, twx
from moeshrink_kernels.experts import TWXLayout, mxfp4_routed_experts, twx_routed_experts

SHAPES = {"organism": (128, 128), "deepseek_v3": (7168, 2048)}
TOKENS = (1, 16, 128)


def best_of(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(hidden: int, inter: int, tokens: int, repeats: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    w13 = torch.randn(2 * inter, hidden, generator=generator) * 0.02
    w2 = torch.randn(hidden, inter, generator=generator) * 0.02
    x = torch.randn(tokens, hidden, generator=generator).to(torch.bfloat16)
    ids = torch.zeros(tokens, 1, dtype=torch.int32)
    weights = torch.ones(tokens, 1)
    dense13, dense2 = w13.to(torch.bfloat16), w2.to(torch.bfloat16)

    def dense() -> torch.Tensor:
        gate_up = x @ dense13.T
        return (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ dense2.T

    figures = {"dense_us": best_of(dense, repeats) * 1e6}
    for bits in (3, 2):
        c13, s13 = twx.encode(w13, bits)
        c2, s2 = twx.encode(w2, bits)
        layout = TWXLayout.of([bits], hidden, inter).as_tensor()
        figures[f"twx{bits}_us"] = best_of(lambda: twx_routed_experts(
            x, weights, ids, c13.reshape(-1), s13[None], c2.reshape(-1), s2[None], layout), repeats) * 1e6
    p13, q13 = mxfp4.encode(w13)
    p2, q2 = mxfp4.encode(w2)
    figures["mxfp4_us"] = best_of(lambda: mxfp4_routed_experts(x, weights, ids, p13[None], q13[None], p2[None],
                                                               q2[None]), repeats) * 1e6
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    prov = Provenance("bench_kernel_speed", {"shapes": SHAPES, "tokens": TOKENS, "repeats": args.repeats})
    rows = []
    for shape_name, (hidden, inter) in SHAPES.items():
        for tokens in TOKENS:
            figures = measure(hidden, inter, tokens, args.repeats)
            rows.append({"shape": shape_name, "hidden": hidden, "intermediate": inter, "tokens": tokens, **figures})
            ratios = "  ".join(f"{k[:-3]} {figures[k]:9.0f} us ({figures[k] / figures['dense_us']:5.1f}x)"
                               for k in ("twx3_us", "twx2_us", "mxfp4_us"))
            print(f"{shape_name:12s} tokens {tokens:4d}: dense bf16 {figures['dense_us']:9.0f} us  {ratios}")
    if args.json:
        atomic_write_json(args.json, {"rows": rows, "provenance": prov.record()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
