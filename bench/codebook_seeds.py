"""How much TWX v2's end-to-end drift on the organism depends on which codebook, not only on the recipe:
codebooks trained with the format's recipe (odd: entry k + N/2 is entry k negated, entry 0 zero) and
with the first books' recipe (no such structure) from several seeds, each organism build encoded with
them, measured offline against the original (float32 torch, decoded weights rounded to bf16), beside
version 1 (whose levels are fixed, so it has no seed) and the format's committed books (seed 0, 4 M
weights, 4 encoder rounds).

    python bench/codebook_seeds.py --workdir . [--seeds 1,2,3] [--weights 2097152] [--encoder-rounds 3]
        [--passages 300] [--json bench/results/codebook_seeds.json]

Per build (twx3: every expert 3-bit; twx2.5: the plan of the run's twx2_5 build) and codebook: mean KL
over every position, the median passage's mean KL, top-1 agreement, and agreement where the original
decides (its top token at least 0.1 nats above the runner-up). The encoder searches every codeword
(the run's tables hold the committed books' choices only): about 8 minutes per seed on 2 cores.
Needs a finished run of the embedded default in --workdir, as bench/output_error.py does.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from output_error import decoded, end_to_end, load_study

from moeshrink.core.ioutil import atomic_write_json, read_json
from moeshrink.core.provenance import Provenance
from moeshrink.formats import twx, twx_vq
from moeshrink.formats.twx import GROUP, decode_scales

DECIDED_MARGIN = 0.1


def decoded_with(book: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One expert's weight [rows, K] through the v2 encoder's search with `book`, decoded and bf16-rounded."""
    blocks = weight.reshape(-1, GROUP).float()
    scale_bytes, index = twx_vq._search(blocks, book)
    values = book[index].reshape(blocks.shape[0], GROUP) * decode_scales(scale_bytes)[:, None]
    return values.reshape(weight.shape).to(torch.bfloat16).float()


def figures(kl_per_passage: list[torch.Tensor], agreeing: torch.Tensor, decided: torch.Tensor) -> dict:
    passage_means = torch.stack([kl.mean() for kl in kl_per_passage])
    return {"mean_kl": float(torch.cat(kl_per_passage).mean()), "median_passage_kl": float(passage_means.median()),
            "top1_agreement": float(agreeing.float().mean()),
            "decided_top1_agreement": float(agreeing[decided].float().mean())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("."))
    parser.add_argument("--seeds", default="1,2,3", help="comma-separated; empty: only v1 and the committed books")
    parser.add_argument("--weights", type=int, default=1 << 21, help="Gaussian weights each codebook is trained on")
    parser.add_argument("--encoder-rounds", type=int, default=3)
    parser.add_argument("--passages", type=int, default=300)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    seeds = [int(seed) for seed in args.seeds.split(",") if seed]
    results = args.workdir / "results/organism"
    prov = Provenance("bench_codebook_seeds", {"seeds": seeds, "weights": args.weights,
                                               "encoder_rounds": args.encoder_rounds, "passages": args.passages},
                      inputs=[str(results / "upstream-bf16"), str(results / "builds/twx2_5/plan.json")])
    study = load_study(results, args.passages)
    top_two = torch.cat(study.original).topk(2, dim=-1).values
    decided = (top_two[:, 0] - top_two[:, 1]) >= DECIDED_MARGIN
    plan = read_json(results / "builds/twx2_5/plan.json")["quantize"]["expert_bits"]
    widths = {"twx3": lambda layer, expert: 3, "twx2.5": lambda layer, expert: plan[str(layer)][str(expert)]}
    out: dict = {"positions": int(decided.numel()), "decided_positions": int(decided.sum()), "runs": []}

    def record(build: str, recipe: str, seed: int | None, replaced: dict) -> None:
        row = {"build": build, "recipe": recipe, "seed": seed, **figures(*end_to_end(study, replaced), decided)}
        out["runs"].append(row)
        print(f"{build:6s} {recipe:18s} seed {seed!s:4s} mean KL {row['mean_kl']:.5f}, median passage "
              f"{row['median_passage_kl']:.5f}, top-1 agreement {row['top1_agreement']:.4f}, where the original "
              f"decides {row['decided_top1_agreement']:.4f}", flush=True)

    for build, bits_of in widths.items():
        for recipe, codec in (("v1", twx), ("v2 as committed", twx_vq)):
            record(build, recipe, None, {i: tuple(decoded(w, codec, lambda e, i=i: bits_of(i, e)) for w in study.kept[i])
                                         for i in study.moe})
    for seed in seeds:
        for recipe, odd in (("v2 odd", True), ("v2 first books", False)):
            books = {bits: twx_vq.train_codebook(bits, args.weights, encoder_rounds=args.encoder_rounds, seed=seed, odd=odd)
                     for bits in twx_vq.ENTRIES}
            for build, bits_of in widths.items():
                record(build, recipe, seed, {i: tuple(torch.stack([decoded_with(books[bits_of(i, e)], w[e])
                                                                    for e in range(w.shape[0])]) for w in study.kept[i])
                                             for i in study.moe})
    if args.json:
        atomic_write_json(args.json, {**out, "provenance": prov.record()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
