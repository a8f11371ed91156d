"""Candidate codes for TWX format version 2 (issue 19), measured on bench/quality.py's test sets
against TWX v1 and ggml's peers in the same run. None of these candidates is a format yet: this
script is the design study that chooses one.

    python bench/twx_v2_study.py --upstream results/organism/upstream --ggml PATH/libggml-base.so \
        --json bench/results/twx_v2_study.json

Candidates (relative squared error as in bench/quality.py; bits per weight include every scale):
  scalar-g32     v1's layout (one UE5M3 scale per 32), the scale refitted by least squares after
                 each assignment (from each of v1's 11 starting scales), levels refitted to the
                 tensor's own weights (Lloyd, 4 rounds; a table per tensor, a few bytes)
  scalar-g16s4   the same codes, one 4-bit scale per 16 weights as a multiple of a float16 scale per
                 256 weights (as ggml's K-quants): 2 bits -> 2.31 bpw
  scalar-g32s6   one 6-bit scale per 32 weights under a float16 scale per 256: 3 bits -> 3.22 bpw
  vq4            4 weights share one index into a fixed codebook of 4-vectors (256 entries: 2 bits
                 per weight; 4,096: 3 bits), one UE5M3 scale per 32 chosen among 9 steps of 1/8
                 octave; the codebook is k-means on block-normalised MXFP4 Gaussian weights, then
                 refined through this encoder (a format constant, like v1's levels)
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from quality import GGML_TYPES, SETS, dsv3_experts, load_ggml, organism_experts

from moeshrink.core.ioutil import atomic_write_json
from moeshrink.core.provenance import Provenance
from moeshrink.formats import twx

Codec = Callable[[torch.Tensor], torch.Tensor]
GROUP = 32
SUPER = 256


def ue5m3_nearest(scale: torch.Tensor) -> torch.Tensor:
    below = twx.nearest_scale_bytes(scale)
    low, high = twx.decode_scales(below), twx.decode_scales((below + 1).clamp(max=255))
    return torch.where(scale - low <= high - scale, low, high)


def nearest_level(x: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    return torch.bucketize(x.contiguous(), (levels[1:] + levels[:-1]) / 2)


def scalar_codec(bits: int, group: int, sub_scale_bits: int | None) -> Codec:
    """Scalar codes with refitted scales and per-tensor levels; the scale stored in UE5M3 per group,
    or (sub_scale_bits) as a multiple of a float16 scale per 256 weights."""
    def roundtrip(weight: torch.Tensor) -> torch.Tensor:
        blocks = weight.reshape(-1, group)
        amax = blocks.abs().amax(1, keepdim=True).clamp(min=1e-30)
        levels = twx.LEVELS[bits].clone()
        for _ in range(4):
            best_error = torch.full((blocks.shape[0], 1), float("inf"))
            best_scale = amax.clone()
            for step in twx.SEARCH_STEPS:
                scale = amax * 2 ** (step / 8) / levels.abs().max()
                for _ in range(3):
                    q = levels[nearest_level(blocks / scale, levels)]
                    error = (q * scale - blocks).pow(2).sum(1, keepdim=True)
                    better = error < best_error
                    best_error, best_scale = torch.where(better, error, best_error), torch.where(better, scale, best_scale)
                    qq = q.pow(2).sum(1, keepdim=True)
                    scale = torch.where(qq > 0, (blocks * q).sum(1, keepdim=True) / qq.clamp(min=1e-30), scale)
                    scale = scale.clamp(min=1e-30)
            codes = nearest_level(blocks / best_scale, levels).reshape(-1)
            weights = best_scale.pow(2).expand_as(blocks).reshape(-1)
            total = torch.zeros_like(levels).index_add_(0, codes, (blocks / best_scale).reshape(-1) * weights)
            count = torch.zeros_like(levels).index_add_(0, codes, weights)
            levels = torch.where(count > 0, total / count.clamp(min=1e-30), levels)
            levels = (levels / levels.abs().max()).sort().values
        if sub_scale_bits is None:
            stored = ue5m3_nearest(best_scale)
        else:
            per_super = best_scale.reshape(-1, SUPER // group)
            top = 2 ** sub_scale_bits - 1
            unit = (per_super.amax(1, keepdim=True) / top).half().float()
            stored = (torch.round(per_super / unit).clamp(1, top) * unit).reshape(-1, 1)
        return (levels[nearest_level(blocks / stored, levels)] * stored).reshape(weight.shape)
    return roundtrip


def nearest_codeword(vectors: torch.Tensor, codebook: torch.Tensor, chunk: int = 1 << 15) -> torch.Tensor:
    norms = codebook.pow(2).sum(1)
    return torch.cat([(norms - 2 * vectors[i:i + chunk] @ codebook.T).argmin(1)
                      for i in range(0, vectors.shape[0], chunk)])


def vq_encode(blocks: torch.Tensor, codebook: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per block of 32: the UE5M3 scale among 9 steps around the block's maximum whose nearest
    codewords leave the least squared error. Returns decoded blocks, indices and scales."""
    dim = codebook.shape[1]
    start = blocks.abs().amax(1, keepdim=True).clamp(min=1e-30) / codebook.abs().max()
    best_error = torch.full((blocks.shape[0],), float("inf"))
    best = torch.zeros_like(blocks)
    best_index = torch.zeros(blocks.numel() // dim, dtype=torch.long)
    best_scale = start.clone()
    for step in range(-4, 5):
        scale = ue5m3_nearest(start * 2 ** (step / 8))
        index = nearest_codeword((blocks / scale).reshape(-1, dim), codebook)
        decoded = codebook[index].reshape(blocks.shape) * scale
        error = (decoded - blocks).pow(2).sum(1)
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best = torch.where(better[:, None], decoded, best)
        best_scale = torch.where(better[:, None], scale, best_scale)
        best_index = torch.where(better.repeat_interleave(GROUP // dim), index, best_index)
    return best, best_index, best_scale


def train_codebook(entries: int, dim: int = 4, seed: int = 0) -> torch.Tensor:
    """k-means on block-normalised MXFP4 Gaussian weights (a seeded draw apart from the test sets),
    then 6 rounds of refinement through vq_encode."""
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.cat([w.reshape(-1, GROUP) for _, w in dsv3_experts("gauss", 4, 64, seed=99)])
    vectors = (blocks / ue5m3_nearest(blocks.abs().amax(1, keepdim=True) / 2.5)).reshape(-1, dim)
    codebook = vectors[torch.randperm(vectors.shape[0], generator=generator)[:entries]].clone()

    def update(vectors: torch.Tensor, index: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
        total = torch.zeros_like(codebook).index_add_(0, index, vectors)
        count = torch.zeros(entries).index_add_(0, index, torch.ones(vectors.shape[0]))
        return torch.where(count[:, None] > 0, total / count.clamp(min=1)[:, None], codebook)

    for _ in range(10):
        codebook = update(vectors, nearest_codeword(vectors, codebook), codebook)
    for _ in range(6):
        _, index, scale = vq_encode(blocks, codebook)
        codebook = update((blocks / scale).reshape(-1, dim), index, codebook)
    return codebook


def vq_codec(codebook: torch.Tensor) -> Codec:
    return lambda weight: vq_encode(weight.reshape(-1, GROUP), codebook)[0].reshape(weight.shape)


def v1_codec(bits: int) -> Codec:
    return lambda weight: twx.decode(*twx.encode(weight, bits), torch.float32)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--upstream", default="results/organism/upstream", type=Path)
    parser.add_argument("--dsv3-experts", type=int, default=2)
    parser.add_argument("--dsv3-rows", type=int, default=128)
    parser.add_argument("--ggml", default=os.environ.get("MOESHRINK_GGML_LIB"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    ggml = load_ggml(args.ggml)
    prov = Provenance("bench_twx_v2_study", {k: str(v) for k, v in vars(args).items()}, inputs=[str(args.upstream)])
    started = time.perf_counter()
    codebooks = {entries: train_codebook(entries) for entries in (256, 4096)}
    codebook_seconds = time.perf_counter() - started
    candidates: dict[str, tuple[float, Codec]] = {
        "v1 2-bit": (2.25, v1_codec(2)), "v1 3-bit": (3.25, v1_codec(3)),
        "scalar-g32 2-bit": (2.25, scalar_codec(2, 32, None)), "scalar-g32 3-bit": (3.25, scalar_codec(3, 32, None)),
        "scalar-g16s4 2-bit": (2 + 4 / 16 + 16 / SUPER, scalar_codec(2, 16, 4)),
        "scalar-g32s6 3-bit": (3 + 6 / 32 + 16 / SUPER, scalar_codec(3, 32, 6)),
        "vq4x256 2-bit": (2.25, vq_codec(codebooks[256])), "vq4x4096 3-bit": (3.25, vq_codec(codebooks[4096])),
    }
    if ggml:
        for peer in GGML_TYPES:
            candidates[f"ggml {peer}"] = (ggml.bits_per_weight(peer), lambda w, peer=peer: ggml.roundtrip(w, peer))
    sources = {"organism": lambda: organism_experts(args.upstream),
               "dsv3-gauss": lambda: dsv3_experts("gauss", args.dsv3_experts, args.dsv3_rows),
               "dsv3-laplace": lambda: dsv3_experts("laplace", args.dsv3_experts, args.dsv3_rows)}
    table: dict[str, dict] = {}
    for name, (bits, codec) in candidates.items():
        row: dict = {"bits_per_weight": bits, "seconds": 0.0, "weights": 0}
        for set_name in SETS:
            squared_error = total = 0.0
            for _, weight in sources[set_name]():
                start = time.perf_counter()
                decoded = codec(weight)
                row["seconds"] += time.perf_counter() - start
                row["weights"] += weight.numel()
                squared_error += float((decoded - weight).double().pow(2).sum())
                total += float(weight.double().pow(2).sum())
            row[set_name] = squared_error / total
        row["weights_per_second"] = row["weights"] / row["seconds"]
        table[name] = row
        print(f"{name:22s} {bits:5.3f} bpw  " + "  ".join(f"{s} {row[s]:.4f}" for s in SETS)
              + f"  {row['weights_per_second'] / 1e6:6.2f} M weights/s", flush=True)
    if args.json:
        atomic_write_json(args.json, {"candidates": table, "codebook_training_seconds": codebook_seconds,
                                      "codebook_rms": {k: float(v.pow(2).mean().sqrt()) for k, v in codebooks.items()},
                                      "threads": torch.get_num_threads(), "provenance": prov.record()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
