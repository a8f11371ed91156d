"""Two builds' agreement with the original, paired over passages: the agreement eval's per-passage
records (`results/<run>/evals/<build>/agreement.jsonl`) of build B minus those of build A, for mean KL,
top-1 agreement and agreement where the original decides, each with a percentile bootstrap interval
over passages (2,000 resamples, `core.stats.bootstrap_ratio_ci`); and each build's median passage KL,
and on how many passages B's KL is lower or higher.

    python bench/paired_agreement.py --workdir . --pairs twx3:twx3_v2,twx2_5:twx2_5_v2 [--json FILE]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from moeshrink.core.ioutil import atomic_write_json, read_jsonl
from moeshrink.core.provenance import Provenance
from moeshrink.core.stats import bootstrap_ratio_ci

FIGURES = {"mean_kl": ("kl_sum", "positions"), "top1_agreement": ("top1_agree", "positions"),
           "decided_top1_agreement": ("decided_top1_agree", "decided_positions")}


def paired(records_a: list[dict], records_b: list[dict]) -> dict:
    by_id = {record["id"]: record for record in records_b}
    if sorted(by_id) != sorted(record["id"] for record in records_a):
        raise SystemExit("the two builds' agreement records are not over the same passages")
    pairs = [(record, by_id[record["id"]]) for record in records_a]
    out: dict = {}
    for name, (numerator, denominator) in FIGURES.items():
        differences = [b[numerator] - a[numerator] for a, b in pairs]
        totals = [a[denominator] for a, _ in pairs]
        low, high = bootstrap_ratio_ci(differences, totals)
        out[f"{name}_difference"] = {"value": sum(differences) / sum(totals), "ci95": [low, high]}
    out["median_passage_kl"] = {side: statistics.median(record["kl_mean"] for record in records)
                                for side, records in (("a", records_a), ("b", records_b))}
    lower = sum(b["kl_sum"] < a["kl_sum"] for a, b in pairs)
    out["passages_b_lower_kl"], out["passages_b_higher_kl"] = lower, sum(b["kl_sum"] > a["kl_sum"] for a, b in pairs)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("."))
    parser.add_argument("--run", default="organism")
    parser.add_argument("--pairs", required=True, help="A:B,... (B minus A)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    evals = args.workdir / "results" / args.run / "evals"
    pairs = [tuple(pair.split(":")) for pair in args.pairs.split(",")]
    prov = Provenance("bench_paired_agreement", {"pairs": args.pairs},
                      inputs=[str(evals / build / "agreement.jsonl") for pair in pairs for build in pair])
    results = {}
    for a, b in pairs:
        figures = paired(read_jsonl(evals / a / "agreement.jsonl"), read_jsonl(evals / b / "agreement.jsonl"))
        results[f"{b} - {a}"] = figures
        print(f"{b} - {a}: " + "; ".join(f"{name} {v['value']:+.5f} [{v['ci95'][0]:+.5f}, {v['ci95'][1]:+.5f}]"
                                         for name, v in figures.items() if name.endswith("_difference"))
              + f"; median passage KL {figures['median_passage_kl']['a']:.5f} -> {figures['median_passage_kl']['b']:.5f}"
              f"; passages with lower / higher KL {figures['passages_b_lower_kl']} / {figures['passages_b_higher_kl']}")
    if args.json:
        atomic_write_json(args.json, {**results, "provenance": prov.record()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
