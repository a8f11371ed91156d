"""What the TWX formats' weight error does to the organism's outputs, version 1 against version 2,
measured offline (float32 torch, the decoded weights rounded to bf16 as vLLM holds them):

- per MoE layer, on clean inputs: the relative squared error of the routed experts' combined output
  (each token's chosen experts, gate weights applied) on the hidden states and routing the original
  model produces for the passages;
- end to end: the mean KL(original || build) of next-token distributions over every position of the
  passages, and top-1 agreement, with every MoE layer's experts decoded (twx3: all 3-bit; twx2.5: the
  2/3-bit plan of a finished run's twx2_5 build);
- top-1 agreement by how far the original's top token leads its runner-up (the agreement eval's
  decided margin is 0.1 nats): where the original hardly prefers one token, every build's top-1 is
  close to a coin toss;
- where the weight error lies, by weight size within its block of 32: the share of a code's squared
  error on each class, and the class's own relative squared error.

    python bench/output_error.py --workdir . [--passages 100] [--json bench/results/output_error.json]

Needs a finished run of the embedded default in --workdir (results/organism/upstream-bf16, the
original's agreement passages, results/organism/builds/twx2_5/plan.json).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from moeshrink.core.ioutil import atomic_write_json, read_json
from moeshrink.core.provenance import Provenance
from moeshrink.formats import twx, twx_vq

CODECS = {"v1": twx, "v2": twx_vq}


def routed_output(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    for expert in range(w13.shape[0]):
        token, slot = torch.where(ids == expert)
        if token.numel():
            gate, up = F.linear(x[token], w13[expert]).chunk(2, dim=-1)
            out.index_add_(0, token, F.linear(F.silu(gate) * up, w2[expert]) * weights[token, slot, None])
    return out


def decoded(weights: torch.Tensor, codec, bits_of) -> torch.Tensor:
    """[E, rows, K] -> the same, each expert through `codec` at bits_of(expert), bf16-rounded."""
    return torch.stack([codec.decode(*codec.encode(w, bits_of(e)), torch.bfloat16).float()
                        for e, w in enumerate(weights)])


MARGIN_BINS = [(0.0, 0.01), (0.01, 0.05), (0.05, 0.1), (0.1, 0.3), (0.3, 1.0), (1.0, float("inf"))]

SIZE_CLASSES = {"exact zero": (0.0, 0.0), "below 1/4 of the block maximum": (0.0, 0.25),
                "1/4 up to the maximum": (0.25, 1.0), "the block maximum": (1.0, 1.0)}


def error_by_size(weights: list[torch.Tensor], codec, bits: int) -> dict:
    squared = dict.fromkeys(SIZE_CLASSES, 0.0)
    norm = dict.fromkeys(SIZE_CLASSES, 0.0)
    for weight in weights:
        for expert in weight:
            blocks = expert.reshape(-1, 32)
            error = (codec.decode(*codec.encode(expert, bits), torch.float32).reshape(-1, 32) - blocks).square()
            size = blocks.abs() / blocks.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
            masks = {"exact zero": blocks == 0, "below 1/4 of the block maximum": (blocks != 0) & (size < 0.25),
                     "1/4 up to the maximum": (size >= 0.25) & (size < 1), "the block maximum": size == 1}
            for name, mask in masks.items():
                squared[name] += float(error[mask].sum())
                norm[name] += float(blocks[mask].square().sum())
    total = sum(squared.values())
    return {name: {"share_of_error": squared[name] / total,
                   "relative_error": squared[name] / norm[name] if norm[name] else None} for name in SIZE_CLASSES}


@dataclass
class Study:
    """The organism in float32 with the original's log-probabilities on the passages, and each MoE layer's
    experts (the module and its exact [gate_up, down] weights) and the inputs it saw."""
    model: torch.nn.Module
    passages: list[torch.Tensor]
    original: list[torch.Tensor]
    moe: dict[int, torch.nn.Module]
    kept: dict[int, tuple[torch.Tensor, torch.Tensor]]
    captured: dict[int, list]


def load_study(results: Path, passage_count: int) -> Study:
    """`passage_count` of the agreement eval's passages, evenly spread, through the original in float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(results / "upstream-bf16"), dtype=torch.float32)
    reference = np.load(results / "evals/original/agreement_reference.npz")
    offsets = np.cumsum([0, *reference["lengths"].tolist()])
    stride = max(1, (offsets.size - 1) // passage_count)
    passages = [torch.tensor(reference["token_ids"][offsets[p]:offsets[p + 1]])[None]
                for p in range(0, offsets.size - 1, stride)][:passage_count]
    moe = {i: layer.mlp.experts for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")}
    captured: dict[int, list] = {i: [] for i in moe}
    hooks = [experts.register_forward_pre_hook(lambda _, inputs, i=i: captured[i].append([t.detach() for t in inputs]))
             for i, experts in moe.items()]
    with torch.no_grad():
        original = [F.log_softmax(model(ids).logits[0, :-1], dim=-1) for ids in passages]
    for hook in hooks:
        hook.remove()
    kept = {i: (experts.gate_up_proj.detach().clone(), experts.down_proj.detach().clone()) for i, experts in moe.items()}
    return Study(model, passages, original, moe, kept, captured)


@torch.no_grad()
def end_to_end(study: Study, weights: dict[int, tuple[torch.Tensor, torch.Tensor]]
               ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """With each MoE layer's experts replaced by `weights` ([gate_up, down] per layer): KL(original ||
    build) at every position, per passage, and whether the top-1 tokens agree, all positions in order."""
    for i, (w13, w2) in weights.items():
        study.moe[i].gate_up_proj.copy_(w13)
        study.moe[i].down_proj.copy_(w2)
    kl, agreeing = [], []
    for ids, log_p in zip(study.passages, study.original):
        log_q = F.log_softmax(study.model(ids).logits[0, :-1], dim=-1)
        kl.append((log_p.exp() * (log_p - log_q)).sum(dim=-1))
        agreeing.append(log_p.argmax(-1) == log_q.argmax(-1))
    for i, experts in study.moe.items():
        experts.gate_up_proj.copy_(study.kept[i][0])
        experts.down_proj.copy_(study.kept[i][1])
    return kl, torch.cat(agreeing)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("."))
    parser.add_argument("--passages", type=int, default=100, help="of the agreement eval's, evenly spread")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    results = args.workdir / "results/organism"
    prov = Provenance("bench_output_error", {"passages": args.passages},
                      inputs=[str(results / "upstream-bf16"), str(results / "builds/twx2_5/plan.json")])
    study = load_study(results, args.passages)
    plan = read_json(results / "builds/twx2_5/plan.json")["quantize"]["expert_bits"]
    top_two = torch.cat(study.original).topk(2, dim=-1).values
    margin = (top_two[:, 0] - top_two[:, 1]).numpy()
    bins = [(low, high, (margin >= low) & (margin < high)) for low, high in MARGIN_BINS]
    figures: dict = {"layers": {}, "end_to_end": {}, "positions": int(margin.size),
                     "margin_bins": {f"{low:g}-{high:g}": int(inside.sum()) for low, high, inside in bins}}
    widths = {"twx3": lambda layer: lambda expert: 3,
              "twx2.5": lambda layer: lambda expert: plan[str(layer)][str(expert)]}
    for build, bits_of in widths.items():
        for version, codec in CODECS.items():
            key = f"{build} {version}"
            with torch.no_grad():
                layer_errors, replaced = {}, {}
                for i in study.moe:
                    w13, w2 = (decoded(w, codec, bits_of(i)) for w in study.kept[i])
                    x, ids, weights = (torch.cat(parts) for parts in zip(*study.captured[i]))
                    clean = routed_output(x, ids, weights, *study.kept[i])
                    layer_errors[i] = float((routed_output(x, ids, weights, w13, w2) - clean).pow(2).sum()
                                            / clean.pow(2).sum())
                    replaced[i] = (w13, w2)
            kl_per_passage, agreeing = end_to_end(study, replaced)
            kl = float(torch.cat(kl_per_passage).sum())
            agreeing = agreeing.numpy()
            agree = float(agreeing.sum())
            figures["layers"][key] = layer_errors
            by_margin = {f"{low:g}-{high:g}": float(agreeing[inside].mean()) for low, high, inside in bins}
            figures["end_to_end"][key] = {"mean_kl": kl / figures["positions"],
                                          "top1_agreement": agree / figures["positions"],
                                          "top1_agreement_by_margin": by_margin}
            print(f"{key:12s} MoE output error per layer " + " ".join(f"{e:.4f}" for e in layer_errors.values())
                  + f" (mean {np.mean(list(layer_errors.values())):.4f}); end to end: mean KL "
                  f"{kl / figures['positions']:.5f}, top-1 agreement {agree / figures['positions']:.4f}; by the original's "
                  "margin (nats): " + ", ".join(f"{name} {value:.3f} ({figures['margin_bins'][name]})"
                                               for name, value in by_margin.items()), flush=True)
    figures["by_weight_size"] = {}
    for bits in (3, 2):
        for version, codec in CODECS.items():
            split = error_by_size([w for pair in study.kept.values() for w in pair], codec, bits)
            figures["by_weight_size"][f"{bits}-bit {version}"] = split
            print(f"{bits}-bit {version}: " + "; ".join(
                f"{name} {v['share_of_error']:.1%} of the error"
                + (f" (relative {v['relative_error']:.3f})" if v["relative_error"] is not None else "")
                for name, v in split.items()), flush=True)
    if args.json:
        atomic_write_json(args.json, {**figures, "provenance": prov.record()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
