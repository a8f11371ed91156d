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

Test sets (`--sets`): the organism's routed experts, and DeepSeek-V3-shaped experts made MXFP4-exact
from Gaussian and from Laplace (heavy-tailed) weights (gate and up [rows, 7168], down [rows, 2048]
with `--dsv3-rows` rows each, one seeded draw; each expert's weights scaled by its own factor so that
the TWX2.5 plan has norms to rank).

Peers: ggml's quantizers (the library llama.cpp ships), when a locally built `libggml-base` is named
by `--ggml` or `MOESHRINK_GGML_LIB` (`bench/build_ggml.sh <ggml source folder>` builds one in a
temporary folder; nothing of ggml is kept here). Each tensor is quantized with `ggml_quantize_chunk`
in rows of 256 weights (the super-block of the K-quants and i-quants; the organism's rows are shorter,
so its tensors are read as consecutive 256-weight rows), importance vector of ones, then decoded with
the type's `to_float`. The TWX2.5 peer is IQ3_XXS and IQ2_XS on the same expert plan. Without the
library the peers are skipped with a message.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from moeshrink.compress.builder import allocate_bits, expert_weights, weight_error_gains
from moeshrink.core import expert_formats
from moeshrink.core.arch import adapter_for
from moeshrink.core.ioutil import atomic_write_json, read_json
from moeshrink.core.provenance import Provenance
from moeshrink.formats import mxfp4, twx, twx_vq
from moeshrink.formats.source_experts import source_format

TARGET_RATIO = 0.7
SETS = ("organism", "dsv3-gauss", "dsv3-laplace")
# ggml type ids (ggml.h) of the peers; each peer is compared with the TWX code of its role
GGML_TYPES = {"Q3_K": 11, "IQ3_S": 21, "IQ3_XXS": 18, "Q2_K": 10, "IQ2_S": 22, "IQ2_XS": 17}
GGML_ROW = 256
# issue 19's targets for TWX v2, each against a ggml peer: (TWX code key suffix, peer key, most bits, most ratio)
PEER_TARGETS = {"TWX3 vs IQ3_S": ("3", "IQ3_S", 3.25, 1.0),
                "TWX2.5 vs IQ3_XXS/IQ2_XS mix": ("_mix", "ggml_mix", 2.75, 0.9),
                "TWX2 vs IQ2_XS": ("2", "IQ2_XS", 2.31, 1.0)}
TWX_VERSIONS = {"v1": "twx", "v2": "twx_v2"}  # format version: its key in METHODS


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


def roundtrip(codec) -> Callable[[torch.Tensor, int], torch.Tensor]:
    return lambda weight, bits: codec.decode(*codec.encode(weight, bits), torch.float32)


METHODS = {
    "twx": roundtrip(twx), "twx_v2": roundtrip(twx_vq),
    "rtn": lambda w, b: rtn_uniform(w, b, True), "int": lambda w, b: rtn_int(w, b, True),
    "rtn_fullscale": lambda w, b: rtn_uniform(w, b, False), "int_fullscale": lambda w, b: rtn_int(w, b, False),
}
BASELINES = {"8-bit scale": ("rtn", "int"), "full-precision scale": ("rtn_fullscale", "int_fullscale")}


class GGMLTraits(ctypes.Structure):
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool),
                ("to_float", ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)),
                ("from_float_ref", ctypes.c_void_p)]


class GGML:
    """ggml's quantize and dequantize, through ctypes, from a locally built libggml-base."""

    def __init__(self, library: Path):
        self.library = library
        self.lib = ctypes.CDLL(str(library))
        float_p = ctypes.POINTER(ctypes.c_float)
        self.lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        self.lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, float_p, ctypes.c_void_p, ctypes.c_int64,
                                                 ctypes.c_int64, ctypes.c_int64, float_p]
        self.lib.ggml_row_size.restype = ctypes.c_size_t
        self.lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
        self.lib.ggml_get_type_traits.restype = ctypes.POINTER(GGMLTraits)
        self.lib.ggml_get_type_traits.argtypes = [ctypes.c_int]

    def bits_per_weight(self, type_name: str) -> float:
        return 8 * self.lib.ggml_row_size(GGML_TYPES[type_name], GGML_ROW) / GGML_ROW

    def roundtrip(self, weight: torch.Tensor, type_name: str) -> torch.Tensor:
        type_id = GGML_TYPES[type_name]
        rows = np.ascontiguousarray(weight.reshape(-1, GGML_ROW).numpy(), dtype=np.float32)
        packed = (ctypes.c_uint8 * (self.lib.ggml_row_size(type_id, GGML_ROW) * rows.shape[0]))()
        importance = np.ones(GGML_ROW, np.float32)
        float_p = ctypes.POINTER(ctypes.c_float)
        self.lib.ggml_quantize_chunk(type_id, rows.ctypes.data_as(float_p), packed, 0, rows.shape[0], GGML_ROW,
                                     importance.ctypes.data_as(float_p))
        decoded = np.empty(rows.size, np.float32)
        self.lib.ggml_get_type_traits(type_id).contents.to_float(ctypes.cast(packed, ctypes.c_void_p),
                                                                 decoded.ctypes.data_as(float_p), rows.size)
        return torch.from_numpy(decoded).reshape(weight.shape)


def load_ggml(library: str | None) -> GGML | None:
    if not library:
        print("ggml peers: skipped (no library: pass --ggml PATH/libggml-base.so or set MOESHRINK_GGML_LIB; "
              "bench/build_ggml.sh builds one from a ggml source folder)")
        return None
    if not Path(library).is_file():
        sys.exit(f"--ggml: {library} is not a file")
    return GGML(Path(library))


ExpertKey = tuple[int, int]


def organism_experts(upstream: Path) -> Iterator[tuple[ExpertKey, torch.Tensor]]:
    config = read_json(upstream / "config.json")
    adapter = adapter_for(config)
    for ref, weight in expert_weights(upstream, adapter, source_format(config)):
        yield (ref.layer, ref.expert), weight


def dsv3_experts(distribution: str, experts: int, rows: int, seed: int = 0
                 ) -> Iterator[tuple[ExpertKey, torch.Tensor]]:
    """MXFP4-exact DeepSeek-V3-shaped projections (input dimensions 7168 and 2048), Gaussian or
    Laplace, each expert at its own scale (log-normal, so the TWX2.5 plan has norms to rank)."""
    generator = torch.Generator().manual_seed(seed)
    for expert in range(experts):
        std = 0.02 * float(torch.exp(0.3 * torch.randn((), generator=generator)))
        for shape in ((rows, 7168), (rows, 7168), (rows, 2048)):
            if distribution == "gauss":
                weight = torch.randn(shape, generator=generator)
            else:
                uniform = torch.rand(shape, generator=generator) - 0.5
                weight = -torch.sign(uniform) * torch.log1p(-2 * uniform.abs()) / 2 ** 0.5
            yield (0, expert), mxfp4.quantize_values(weight * std)


def measure(experts: Callable[[], Iterator[tuple[ExpertKey, torch.Tensor]]], ggml: GGML | None) -> dict:
    norms: dict[int, dict[int, float]] = {}
    for (layer, expert), weight in experts():
        norms.setdefault(layer, {}).setdefault(expert, 0.0)
        norms[layer][expert] += float(weight.pow(2).sum())
    twx2_5 = expert_formats.get("twx2.5", "bench")
    plan_bits = allocate_bits(weight_error_gains(norms, twx2_5)[0], twx2_5.default_budget, twx2_5)
    squared_error = {f"{m}{b}": 0.0 for m in METHODS for b in (2, 3)}
    squared_error.update({f"{m}_mix": 0.0 for m in METHODS})
    peers = list(GGML_TYPES) if ggml else []
    squared_error.update({peer: 0.0 for peer in peers})
    if ggml:
        squared_error["ggml_mix"] = 0.0
    total, weights = 0.0, 0
    seconds = {m: 0.0 for m in [*METHODS, *peers]}
    for (layer, expert), weight in experts():
        total += float(weight.double().pow(2).sum())
        weights += weight.numel()
        mix_bits = plan_bits[layer][expert]
        for method, roundtrip in METHODS.items():
            for bits in (2, 3):
                start = time.perf_counter()
                error = float((roundtrip(weight, bits) - weight).double().pow(2).sum())
                seconds[method] += time.perf_counter() - start
                squared_error[f"{method}{bits}"] += error
                if bits == mix_bits:
                    squared_error[f"{method}_mix"] += error
        for peer in peers:
            start = time.perf_counter()
            error = float((ggml.roundtrip(weight, peer) - weight).double().pow(2).sum())
            seconds[peer] += time.perf_counter() - start
            squared_error[peer] += error
            if peer == {3: "IQ3_XXS", 2: "IQ2_XS"}[mix_bits]:
                squared_error["ggml_mix"] += error
    relative = {k: v / total for k, v in squared_error.items()}

    def ratio(twx_key: str, suffix: str, kinds: tuple[str, ...]) -> float:
        return relative[twx_key] / min(relative[f"{kind}{suffix}"] for kind in kinds)

    three_bit_share = sum(b == 3 for layer in plan_bits.values() for b in layer.values()) / sum(
        len(layer) for layer in plan_bits.values())
    result = {
        "weights": weights,
        "relative_squared_error": relative,
        "ratios": {name: {"twx3_over_rtn3": ratio("twx3", "3", kinds),
                          "twx2_5_over_rtn_mix": ratio("twx_mix", "_mix", kinds),
                          "twx2_over_rtn2": ratio("twx2", "2", kinds)} for name, kinds in BASELINES.items()},
        "twx2_5_three_bit_expert_share": three_bit_share,
        "target_ratio": TARGET_RATIO,
        "seconds": seconds,
    }
    if ggml:
        bits = {peer: ggml.bits_per_weight(peer) for peer in peers}
        bits["ggml_mix"] = three_bit_share * bits["IQ3_XXS"] + (1 - three_bit_share) * bits["IQ2_XS"]
        wide, narrow = twx2_5.bits_per_weight(3), twx2_5.bits_per_weight(2)
        twx_bits = {"3": wide, "2": narrow, "_mix": three_bit_share * wide + (1 - three_bit_share) * narrow}
        targets = {}
        for version, method in TWX_VERSIONS.items():
            for name, (suffix, peer, most_bits, most_ratio) in PEER_TARGETS.items():
                ratio_to_peer = relative[method + suffix] / relative[peer]
                targets[f"{name}, {version}"] = {
                    "twx_bits_per_weight": twx_bits[suffix], "peer_bits_per_weight": bits[peer], "ratio": ratio_to_peer,
                    "most_ratio": most_ratio, "most_bits": most_bits,
                    "met": twx_bits[suffix] <= most_bits and ratio_to_peer <= most_ratio}
        result["ggml"] = {"library": str(ggml.library), "bits_per_weight": bits, "row": GGML_ROW, "targets": targets}
    return result


def report(set_name: str, result: dict) -> bool:
    e = result["relative_squared_error"]
    print(f"[{set_name}] routed-expert weights: {result['weights']:,}; relative squared error:")
    for label, suffix in (("3-bit", "3"), ("2-bit", "2"),
                          (f"2/3 mix ({result['twx2_5_three_bit_expert_share']:.0%} of experts at 3 bits)", "_mix")):
        print(f"  {label}: TWX {e['twx' + suffix]:.4f}  TWX v2 {e['twx_v2' + suffix]:.4f}  " + "  ".join(
            f"{kind.upper()} {e[kind + suffix]:.4f}" for kind in METHODS if not kind.startswith("twx")))
    for name, ratios in result["ratios"].items():
        print(f"  against round-to-nearest, {name}: TWX3/RTN3 = {ratios['twx3_over_rtn3']:.3f}, "
              f"TWX2.5/RTN mix = {ratios['twx2_5_over_rtn_mix']:.3f}, TWX2/RTN2 = {ratios['twx2_over_rtn2']:.3f}")
    target = result["ratios"]["8-bit scale"]
    ok3, ok25 = target["twx3_over_rtn3"] <= TARGET_RATIO, target["twx2_5_over_rtn_mix"] <= TARGET_RATIO
    print(f"  targets against round-to-nearest (same bits per weight, <= {TARGET_RATIO}): "
          f"TWX3 {'met' if ok3 else 'MISSED'}, TWX2.5 {'met' if ok25 else 'MISSED'}")
    if "ggml" in result:
        bits = result["ggml"]["bits_per_weight"]
        print("  ggml: " + "  ".join(f"{peer} {e[peer]:.4f} ({bits[peer]:.2f} bpw)" for peer in GGML_TYPES)
              + f"  IQ3_XXS/IQ2_XS mix {e['ggml_mix']:.4f} ({bits['ggml_mix']:.2f} bpw)")
        for name, t in result["ggml"]["targets"].items():
            print(f"  issue 19 target {name}: {t['ratio']:.3f} at {t['twx_bits_per_weight']:.2f} bpw "
                  f"(needs <= {t['most_ratio']} at <= {t['most_bits']} bpw) {'met' if t['met'] else 'MISSED'}")
    return ok3 and ok25


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--upstream", default="results/organism/upstream", type=Path)
    parser.add_argument("--sets", default=",".join(SETS), help=f"comma-separated, of {', '.join(SETS)}")
    parser.add_argument("--dsv3-experts", type=int, default=8)
    parser.add_argument("--dsv3-rows", type=int, default=256, help="rows of each DeepSeek-V3-shaped projection")
    parser.add_argument("--ggml", default=os.environ.get("MOESHRINK_GGML_LIB"),
                        help="a locally built libggml-base shared library (peers skipped without it)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    sets = args.sets.split(",")
    if unknown := sorted(set(sets) - set(SETS)):
        parser.error(f"--sets: unknown {', '.join(unknown)} (known: {', '.join(SETS)})")
    ggml = load_ggml(args.ggml)
    prov = Provenance("bench_quality", {"upstream": str(args.upstream), "sets": sets, "ggml": args.ggml,
                                        "dsv3_experts": args.dsv3_experts, "dsv3_rows": args.dsv3_rows},
                      inputs=[str(args.upstream)] if "organism" in sets else [])
    sources = {"organism": lambda: organism_experts(args.upstream),
               "dsv3-gauss": lambda: dsv3_experts("gauss", args.dsv3_experts, args.dsv3_rows),
               "dsv3-laplace": lambda: dsv3_experts("laplace", args.dsv3_experts, args.dsv3_rows)}
    results = {name: measure(sources[name], ggml) for name in sets}
    met = [report(name, result) for name, result in results.items()]
    if args.json:
        atomic_write_json(args.json, {"sets": results, "provenance": prov.record()})
    return 0 if all(met) else 1


if __name__ == "__main__":
    sys.exit(main())
