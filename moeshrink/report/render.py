"""Render report/<run>/r013.html from the JSON files rules wrote, and nothing else: `load` reads them,
`Page` lays out its sections (tables are pandas frames built from those files, charts inline SVG;
"which build" is the compare stage's summary), `text` writes each figure; the page is one
self-contained file. A build config declares without its files is an error naming the file, never a
blank row."""
from __future__ import annotations

import csv
import re
from pathlib import Path

import pandas as pd
from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup

from moeshrink.core import eval_kinds
from moeshrink.core.ioutil import atomic_write_text
from moeshrink.core.layout import benchmarks_dir
from moeshrink.core.provenance import Provenance, config_hash
from moeshrink.core.sweeps import method_label
from moeshrink.report import charts
from moeshrink.report.load import ReportError, Results, load  # noqa: F401 (ReportError: what render raises)
from moeshrink.report.report_inputs import input_files  # noqa: F401 (the report rule's inputs)
from moeshrink.report.text import (
    below,
    decimal_size,
    html_table,
    made_by,
    memory_checks_text,
    p_text,
    pct,
    points,
    rate_text,
    ratio_text,
)

FRONTIER_CAPTIONS = {
    "size_agreement": "Size against next-word agreement where the original decides (its top token leads by the decided "
                      "margin): up and left is better.",
    "size_kl": "Size against drift (mean KL from the original's next-token distribution): down and left is better.",
    "size_mmlu": "Size against the MMLU drop, a bar up to its at-worst bound, the dashed line at the pass mark: down and "
                 "left is better.",
    "kv_agreement": "KV-cache room (tokens per card) against next-word agreement: up and right is better.",
}
SHARD_FILE = re.compile(r"model-\d+-of-\d+(\.safetensors)?$")


class Page:
    """The page's sections, each from the loaded results."""

    def __init__(self, results: Results, config: dict):
        self.results = results
        self.config = config
        self.reference = config["reference_build"]
        self.builds = list(config["builds"])
        self.labels = {build_id: build["label"] for build_id, build in config["builds"].items()}
        self.others = [b for b in self.builds if b != self.reference]
        self.judging = config["compare"]

    def label(self, build_id: str) -> str:
        return self.labels[build_id]

    def bytes_of(self, build_id: str) -> int:
        return self.results.manifests[build_id]["total_bytes"]

    def setup_table(self) -> Markup:
        reference_bytes = self.bytes_of(self.reference)
        rows = []
        for build_id in self.builds:
            manifest = self.results.manifests[build_id]
            rows.append({"Build": self.label(build_id), "Made by": made_by(self.config["builds"][build_id]),
                         "Routed experts per layer": manifest["num_experts"],
                         "Routed-expert bits per weight": f"{manifest['routed_expert_bits_per_weight']:.3f}",
                         "Weights": decimal_size(manifest["total_bytes"]),
                         "Against the original": ratio_text(manifest["total_bytes"], reference_bytes)})
        return html_table(pd.DataFrame(rows))

    def paired(self, build_id: str, eval_id: str) -> dict | None:
        return self.results.compare.get(build_id, {}).get("evals", {}).get(eval_id)

    def accuracy(self, build_id: str, eval_id: str) -> dict | None:
        result = self.results.evals.get(build_id, {}).get(eval_id)
        if not result:
            return None
        return result["metrics"][eval_kinds.get(eval_id).metric]

    def quality_table(self, eval_id: str) -> Markup | None:
        builds = [b for b in self.builds if self.accuracy(b, eval_id)]
        if not builds:
            return None
        rows = []
        for build_id in builds:
            paired = self.paired(build_id, eval_id)
            row = {"Build": self.label(build_id), "Accuracy [95% CI]": rate_text(self.accuracy(build_id, eval_id))}
            if paired:
                row.update({"Against the original (points)": points(-paired["drop_points"]),
                            "At worst (points)": points(-paired["at_worst_points"]),
                            "Right only for the original": str(paired["only_a"]),
                            "Right only for the build": str(paired["only_b"]),
                            "McNemar p": p_text(paired["p_value"]),
                            "Could detect a loss of (points)": f"{paired['minimum_detectable_drop_points']:.1f}",
                            f"Pass mark ({self.judging['pass_mark_points']:g} point, on {self.judging['pass_on']})":
                                f"{paired['verdict']}: {paired['verdict_reason']}"})
            rows.append(row)
        return html_table(pd.DataFrame(rows).fillna({"Against the original (points)": "reference"}))

    def quality_note(self, eval_id: str) -> str | None:
        """How the reference's run of a paired eval scored its items, where it says (MMLU's form), and what the
        organism's card measured in each form."""
        lm_eval = (self.results.evals.get(self.reference, {}).get(eval_id) or {}).get("lm_eval") or {}
        if "form" not in lm_eval:
            return None
        note = f"Scored in {lm_eval['form']} form: {lm_eval['scored_by']}."
        card = (self.results.card or {}).get("published") or {}
        if lm_eval["form"] == "cloze" and "mc_cloze_accuracy" in card:
            note += (f" The organism answers in the form it was taught and has no multiple-choice symbol binding: its "
                     f"card measured {card['mc_cloze_accuracy']:.3f} in cloze form and {card['mc_accuracy']:.3f} by "
                     f"answer letter (chance 0.25) on the same questions; real models keep R-013's letter scoring.")
        return note

    def pairs_table(self) -> Markup | None:
        rows = []
        for pair in self.results.pairs:
            for eval_id in eval_kinds.paired_ids():
                paired = pair["evals"].get(eval_id)
                if paired:
                    rows.append({"Builds": f"{self.label(pair['a'])} vs {self.label(pair['b'])}", "Eval": eval_id,
                                 "Items": paired["items"], "Right only for the first": paired["only_a"],
                                 "Right only for the second": paired["only_b"],
                                 "Second against first (points)": points(-paired["drop_points"]),
                                 "McNemar p": p_text(paired["p_value"])})
        return html_table(pd.DataFrame(rows), per_build=False) if rows else None

    def facts_and_tools_table(self) -> Markup | None:
        efforts = self.config["evals"].get("toolcalls", {}).get("efforts", [])
        rows = []
        for build_id in self.builds:
            evals = self.results.evals.get(build_id, {})
            if "facts" not in evals and "toolcalls" not in evals:
                continue
            compared = self.results.compare.get(build_id, {}).get("evals", {})
            row = {"Build": self.label(build_id)}
            if "facts" in evals:
                facts = evals["facts"]["metrics"]
                row["Made-up facts"] = facts["made_up"]["text"]
                row["Fisher p (facts)"] = p_text(compared["facts"]["p_value"]) if "facts" in compared else "reference"
                row["Passage facts written [95% CI]"] = rate_text(facts["supported_recall"])
                if "tool_call_replies" in facts:  # results written before it was counted lack it
                    row["Tool calls instead of facts"] = rate_text(facts["tool_call_replies"])
            for effort in efforts:
                if "toolcalls" in evals:
                    row[f"Tool calls right ({effort}) [95% CI]"] = rate_text(
                        evals["toolcalls"]["metrics"]["by_effort"][effort]["right"])
                    tools = compared.get("toolcalls", {}).get("by_effort", {}).get(effort)
                    row[f"Fisher p ({effort})"] = p_text(tools["p_value"]) if tools else "reference"
            rows.append(row)
        return html_table(pd.DataFrame(rows)) if rows else None

    def agreement_rows(self) -> list[dict]:
        rows = []
        for build_id in self.builds:
            result = self.results.evals.get(build_id, {}).get("agreement")
            if result:
                metrics = result["metrics"]
                rows.append({"build": build_id, "label": self.label(build_id), "metrics": metrics,
                             "reference_read_twice": bool(result.get("reference"))})
        return rows

    def agreement_table(self) -> Markup | None:
        rows = []
        for row in self.agreement_rows():
            metrics = row["metrics"]
            rows.append({"Build": row["label"] + (" (read twice)" if row["reference_read_twice"] else ""),
                         "Positions": f"{metrics['positions']:,}",
                         "Next-word agreement [95% CI]": rate_text({**metrics["top1_agreement"]}),
                         "where the original decides [95% CI]": self._decided_text(metrics),
                         "Drift, mean KL (nats) [95% CI]": self._kl_text(metrics),
                         "KL p99": f"{metrics['kl_percentiles']['p99']:.3g}",
                         "Exact-KL check (relative difference)": self._exact_check(metrics)})
        return html_table(pd.DataFrame(rows)) if rows else None

    @staticmethod
    def _kl_text(metrics: dict) -> str:
        kl = metrics["mean_kl"]
        return f"{kl['value']:.4f} [{kl['ci95'][0]:.4f}, {kl['ci95'][1]:.4f}]"

    @staticmethod
    def _decided_text(metrics: dict) -> str:
        decided = metrics["decided_top1_agreement"]
        if decided["value"] is None:
            return "-"
        return (rate_text(decided) + f" on {decided['positions']:,} positions "
                f"({decided['positions'] / metrics['positions']:.0%})")

    @staticmethod
    def _exact_check(metrics: dict) -> str:
        check = metrics.get("exact_check")
        if not check or check.get("relative_difference") is None:
            return "-"
        text = f"{100 * check['relative_difference']:.1f}% on {check['positions']:,} positions"
        if not check["within_tolerance"]:
            text += (f", over the {100 * check['tolerance']:g}% tolerance: this build's mean KL is well under "
                     "its exact KL (raise evals.agreement.top_k)")
        return text

    def memory_table(self) -> Markup:
        rows = []
        for build_id in self.builds:
            measured, predicted = self.results.memory[build_id], self.results.memory[build_id]["predicted"]
            cpu = measured.get("cpu")
            rows.append({"Build": self.label(build_id),
                         "Weights per card (GiB)": f"{measured['weights_gib']:.4g}",
                         "predicted": f"{predicted['weights_gib']:.4g}",
                         **({"Experts kept decoded (GiB, CPU)": f"{cpu.get('decoded_layers_gib', 0):.4g}"} if cpu else {}),
                         "Room for the KV cache (GiB)": f"{measured['kv_cache_gib']:.4g}",
                         "predicted ": f"{predicted['kv_cache_gib']:.4g}",
                         "Tokens the cache holds": f"{measured['kv_cache_tokens']:,}",
                         "predicted  ": f"{predicted['kv_cache_tokens']:,}",
                         "Bytes per token": f"{measured['kv_bytes_per_token']:,}",
                         f"Requests at {measured['max_model_len']:,} tokens": f"{measured['max_concurrency']:.1f}",
                         "Checks": memory_checks_text(measured)})
        return html_table(pd.DataFrame(rows))

    def failed_memory_checks(self) -> dict[str, list[str]]:
        """Builds whose memory.json has a check that does not hold, with those checks."""
        failed = {self.label(b): [name for name, ok in self.results.memory[b]["checks"].items() if not ok]
                  for b in self.builds}
        return {label: names for label, names in failed.items() if names}

    def charts(self) -> dict[str, Markup]:
        out = {}
        knowledge = []
        for b in self.builds:
            paired = self.paired(b, "mmlu")
            if b == self.reference:
                knowledge.append({"label": self.label(b), "bytes": self.bytes_of(b), "drop": 0.0, "at_worst": None})
            elif paired:
                knowledge.append({"label": self.label(b), "bytes": self.bytes_of(b), "drop": paired["drop_points"],
                                  "at_worst": paired["at_worst_points"]})
        if len(knowledge) > 1:
            out["size_drop"] = charts.size_against_drop(knowledge, self.judging["pass_mark_points"], "MMLU")
        out["memory"] = charts.stacked_memory([{"label": self.label(b), **self.results.memory[b]} for b in self.builds])
        agreement = self.agreement_rows()
        for key, figure, title in [
                ("agreement", "top1_agreement", "Next-word agreement with the original"),
                ("decided_agreement", "decided_top1_agreement", "Next-word agreement where the original decides")]:
            rows = [(r["label"], r["metrics"][figure]) for r in agreement if r["metrics"][figure]["value"] is not None]
            if rows:
                out[key] = charts.interval_dots(
                    [{"label": label, "value": 100 * m["value"], "low": 100 * m["ci95"][0], "high": 100 * m["ci95"][1]}
                     for label, m in rows], "%", f"{title}, 95% intervals", "{:.1f}", bounds=(0.0, 100.0))
        if agreement:
            out["drift"] = charts.interval_dots(
                [{"label": r["label"], "value": r["metrics"]["mean_kl"]["value"],
                  "low": r["metrics"]["mean_kl"]["ci95"][0], "high": r["metrics"]["mean_kl"]["ci95"][1]}
                 for r in agreement], " nats", "Drift (mean KL from the original), 95% intervals", "{:.3g}",
                bounds=(0.0, float("inf")))
        return out

    def build_kind(self, build_id: str) -> tuple[str, str]:
        """(how a build was made: charts.SHAPES' key, its format or method: the mark's colour)."""
        spec = self.config["builds"][build_id]
        kind = "+".join(step for step in ("prune", "quantize") if spec.get(step)) or "reference"
        return kind, method_label(spec) or self.label(build_id)

    def frontier(self) -> dict | None:
        """The size-fidelity frontier (compare/summary.json's Pareto sets), shown when a study has more than the
        reference and two builds: charts and a table, one row per build."""
        summary = self.results.summary or {}
        if len(self.builds) <= 3 or "frontier" not in summary:
            return None
        figures = {self.reference: summary["reference_figures"], **summary["builds"]}
        scale, unit = (1e9, "GB") if max(f["weights_gib"] for f in figures.values()) * 2**30 >= 1e9 else (1e6, "MB")

        def point(build_id: str, x: float, y: float, low=None, high=None) -> dict:
            kind, group = self.build_kind(build_id)
            return {"build": build_id, "label": self.label(build_id), "x": x, "y": y, "low": low, "high": high,
                    "kind": kind, "group": group}

        def size(build_id: str) -> float:
            return figures[build_id]["weights_gib"] * 2**30 / scale

        agreement, kl, mmlu = [], [], []
        for build_id in self.builds:
            metrics = (self.results.evals.get(build_id, {}).get("agreement") or {}).get("metrics")
            if build_id == self.reference:
                agreement.append(point(build_id, size(build_id), 100.0))
                kl.append(point(build_id, size(build_id), 0.0))
            elif metrics:
                shown = metrics["decided_top1_agreement"] if metrics["decided_top1_agreement"]["value"] is not None \
                    else metrics["top1_agreement"]
                agreement.append(point(build_id, size(build_id), 100 * shown["value"], 100 * shown["ci95"][0],
                                       100 * shown["ci95"][1]))
                kl.append(point(build_id, size(build_id), metrics["mean_kl"]["value"], *metrics["mean_kl"]["ci95"]))
            paired = self.paired(build_id, "mmlu")
            if build_id == self.reference or paired:
                mmlu.append(point(build_id, size(build_id), paired["drop_points"] if paired else 0.0,
                                  paired["drop_points"] if paired else None, paired["at_worst_points"] if paired else None))
        sets = summary["frontier"]
        size_title = f"weights per card (decimal {unit}, measured)"
        charts_out = {}
        if len(agreement) > 1:
            charts_out["size_agreement"] = charts.frontier(
                agreement, sets["size_agreement"], size_title, "next-word agreement where the original decides (%)",
                "Size against next-word agreement: the frontier", "{:.1f}", (0.0, 100.0))
            charts_out["size_kl"] = charts.frontier(
                kl, sets["size_kl"], size_title, "drift: mean KL from the original (nats)",
                "Size against drift: the frontier", "{:.3g}", (0.0, float("inf")))
            charts_out["kv_agreement"] = charts.frontier(
                [{**p, "x": figures[p["build"]]["kv_cache_tokens"]} for p in agreement], sets["kv_agreement"],
                "KV-cache tokens per card (measured)", "next-word agreement where the original decides (%)",
                "KV-cache room against next-word agreement: the frontier", "{:.1f}", (0.0, 100.0))
        if len(mmlu) > 1:
            mark = self.judging["pass_mark_points"]
            charts_out["size_mmlu"] = charts.frontier(
                mmlu, sets["size_mmlu"], size_title, "MMLU: points below the original (up = worse)",
                "Size against the MMLU drop, with its at-worst bound and the pass mark", "{:.1f}",
                mark_line=(mark, f"pass mark: {mark:g} point{'' if mark == 1 else 's'} below"))
        return {"charts": charts_out, "table": self.frontier_table(figures, sets), "sets": sets,
                "captions": FRONTIER_CAPTIONS}

    def frontier_table(self, figures: dict[str, dict], sets: dict[str, list[str]]) -> Markup:
        rows = []
        for build_id in self.builds:
            manifest, prediction = self.results.manifests[build_id], self.results.predictions[build_id]
            metrics = (self.results.evals.get(build_id, {}).get("agreement") or {}).get("metrics")
            paired = self.paired(build_id, "mmlu")
            on = [label for name, label in (("size_agreement", "size/agreement"), ("size_kl", "size/KL"),
                                           ("size_mmlu", "size/MMLU"), ("kv_agreement", "KV/agreement"))
                  if build_id in sets[name]]
            verdict = paired["verdict"] if paired else ("reference" if build_id == self.reference else "-")
            rows.append({
                "Build": self.label(build_id), "Made by": made_by(self.config["builds"][build_id]),
                "Weights": decimal_size(manifest["total_bytes"]),
                "Bits per routed weight": f"{manifest['routed_expert_bits_per_weight']:.3f}",
                "Agreement where the original decides [95% CI]":
                    "reference" if build_id == self.reference else self._decided_text(metrics) if metrics else "-",
                "Mean KL (nats) [95% CI]":
                    "reference" if build_id == self.reference else self._kl_text(metrics) if metrics else "-",
                "MMLU drop (points), at worst": f"{paired['drop_points']:+.1f}, {paired['at_worst_points']:+.1f}"
                    if paired else "-",
                "MMLU verdict": verdict,
                "Weights per card (GiB), measured": f"{figures[build_id]['weights_gib']:.4g}",
                f"predicted for a GPU ({prediction['card']}, TP {prediction['tensor_parallel_size']})":
                    f"{prediction['weights_gib']:.4g}",
                "KV-cache tokens per card, measured": f"{figures[build_id]['kv_cache_tokens']:,}",
                "predicted": f"{prediction['kv_cache_tokens']:,}",
                "On the frontier": ", ".join(on) or "-"})
        return html_table(pd.DataFrame(rows))

    def verdicts(self, build_id: str) -> list[str]:
        summary = self.results.summary
        return [v["verdict"] for v in summary["builds"][build_id]["verdicts"].values()] if summary else []

    def passes(self, build_id: str) -> bool | None:
        """True when it passes the pass mark on every paired eval it ran, False when it fails one,
        None when none was judged or a verdict is "cannot tell" (compare/summary.json says which)."""
        summary = self.results.summary
        return summary["builds"][build_id]["passes"] if summary else None

    def which_build(self) -> dict:
        """The choice as results/compare/summary.json made it."""
        summary = self.results.summary or {}
        return {key: summary.get(key) or ([] if key in ("qualifying", "failing", "undecided", "within_size") else None)
                for key in ("qualifying", "failing", "undecided", "fidelity", "room", "smallest", "within_size")}

    def headline(self) -> list[str]:
        """One sentence per build, from its files."""
        reference_bytes = self.bytes_of(self.reference)
        lines = []
        for build_id in self.others:
            sentence = f"{self.label(build_id)}: {decimal_size(self.bytes_of(build_id))} of weights, " \
                       f"{ratio_text(self.bytes_of(build_id), reference_bytes)}"
            paired = self.paired(build_id, "mmlu")
            if paired:
                sentence += (f"; MMLU {pct(paired['accuracy_b']['value'])} against {pct(paired['accuracy_a']['value'])}, "
                             f"{below(paired['drop_points'])} (at worst {below(paired['at_worst_points'])})")
            agreement = self.results.evals.get(build_id, {}).get("agreement")
            if agreement:
                sentence += f"; next-word agreement {pct(agreement['metrics']['top1_agreement']['value'])}"
                decided = agreement["metrics"]["decided_top1_agreement"]
                if decided["value"] is not None:
                    sentence += f" ({pct(decided['value'])} where the original decides)"
            verdict = self.passes(build_id)
            if verdict is not None:
                sentence += "; passes the pass mark" if verdict else "; fails the pass mark"
            elif "cannot tell" in self.verdicts(build_id):
                sentence += "; the data cannot tell whether it passes the pass mark"
            lines.append(sentence + ".")
        return lines

    def pruned_sections(self) -> list[dict]:
        sections = []
        upstream_experts = self.results.upstream["config"].get("n_routed_experts")
        for build_id in self.others:
            spec = self.config["builds"][build_id].get("prune")
            if not spec:
                continue
            memory = self.results.memory[build_id]
            paired = self.paired(build_id, "gsm8k")
            gsm8k = self.results.evals.get(build_id, {}).get("gsm8k")
            sections.append({
                "id": build_id, "label": self.label(build_id), "spec": spec,
                "experts": self.results.manifests[build_id]["num_experts"], "upstream_experts": upstream_experts,
                "models_check": memory.get("models_check"), "startup_seconds": memory["server"].get("startup_seconds"),
                "gsm8k": gsm8k, "paired": paired,
                "gsm8k_reference": self.results.evals.get(self.reference, {}).get("gsm8k"),
            })
        return sections

    def serving_flags(self) -> Markup:
        rows = [{"Build": self.label(b), "vLLM flags": " ".join(self.results.memory[b]["server"]["args"]),
                 "Server start (s)": f"{self.results.memory[b]['server'].get('startup_seconds') or 0:.0f}"}
                for b in self.builds]
        return html_table(pd.DataFrame(rows))


def stage_times(benchmark_dir: Path) -> Markup | None:
    """Wall time per stage and build from Snakemake's benchmark files (shard jobs summed)."""
    rows = []
    for path in sorted(benchmark_dir.rglob("*.tsv")):
        with open(path) as f:
            records = list(csv.DictReader(f, delimiter="\t"))
        if not records:
            continue
        stage = path.relative_to(benchmark_dir).with_suffix("")
        name = "shards" if SHARD_FILE.match(stage.name) else stage.name
        rows.append({"Stage": str(stage.parent / name), "seconds": float(records[-1]["s"]),
                     "max_rss": pd.to_numeric(records[-1].get("max_rss"), errors="coerce")})
    if not rows:
        return None
    frame = pd.DataFrame(rows).groupby("Stage", sort=False).agg(
        jobs=("seconds", "size"), seconds=("seconds", "sum"), max_rss=("max_rss", "max")).reset_index()
    frame["Wall time (s, summed over jobs)"] = frame["seconds"].map(lambda s: f"{s:,.1f}")
    frame["Peak RSS (MB)"] = frame["max_rss"].map(lambda m: "" if pd.isna(m) else f"{m:,.0f}")
    frame = frame.rename(columns={"jobs": "Jobs"})[["Stage", "Jobs", "Wall time (s, summed over jobs)", "Peak RSS (MB)"]]
    return html_table(frame, per_build=False)


def context(results: Results, config: dict, benchmark_dir: Path) -> dict:
    page = Page(results, config)
    reference_memory = results.memory[page.reference]
    return {
        "title": config["title"], "config": config, "config_hash": config_hash(config),
        "labels": page.labels, "reference": page.reference, "reference_label": page.label(page.reference),
        "upstream": results.upstream, "card": results.card, "train": results.train,
        "headline": page.headline(), "which": page.which_build(), "judging": page.judging,
        "setup_table": page.setup_table(),
        "quality_tables": {e: {"title": eval_kinds.get(e).title, "table": t, "note": page.quality_note(e)}
                           for e in eval_kinds.paired_ids() if (t := page.quality_table(e))},
        "pairs_table": page.pairs_table(), "facts_tools_table": page.facts_and_tools_table(),
        "agreement_table": page.agreement_table(), "memory_table": page.memory_table(),
        "failed_memory_checks": page.failed_memory_checks(),
        "memory_reference": reference_memory, "charts": page.charts(),
        "pruned": page.pruned_sections(), "serving_flags": page.serving_flags(), "frontier": page.frontier(),
        "stage_times": stage_times(benchmark_dir),
        "eval_counts": eval_counts(results, page.reference),
        "files": results.files,
    }


def eval_counts(results: Results, reference: str) -> dict:
    """What the reference read, per eval (config may scale the published counts)."""
    evals = results.evals.get(reference, {})
    counts = {eval_id: result["items"] for eval_id, result in evals.items()}
    if "toolcalls" in evals:
        counts["toolcalls_per_effort"] = max(evals["toolcalls"]["calls_per_effort"].values())
    if "agreement" in evals:
        counts["agreement_positions"] = evals["agreement"]["metrics"]["positions"]
    return counts


def render(inputs: dict[str, Path], config: dict, out_file: Path, benchmark_dir: Path | None = None) -> None:
    prov = Provenance("report", {"title": config["title"], "config_sha256_16": config_hash(config)},
                      inputs=[str(p) for p in inputs.values()])
    results = load(inputs, config)
    env = Environment(loader=PackageLoader("moeshrink.report", "templates"), autoescape=select_autoescape(["html", "j2"]),
                      trim_blocks=True, lstrip_blocks=True)
    env.filters["gb"] = decimal_size
    env.filters["pct"] = pct
    env.filters["p"] = p_text
    env.filters["below"] = below
    ctx = context(results, config, benchmark_dir or benchmarks_dir(config))
    ctx["provenance"] = prov.record()
    atomic_write_text(out_file, env.get_template("r013.html.j2").render(**ctx))
