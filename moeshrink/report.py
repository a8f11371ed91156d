"""Render report/r013.html from the JSON files rules wrote (and nothing else)."""
from __future__ import annotations

import csv
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, select_autoescape

from moeshrink.ioutil import atomic_write_text, read_json
from moeshrink.provenance import Provenance, config_hash

TEMPLATES = Path(__file__).resolve().parent.parent / "report" / "templates"
GB = 1e9
GIB = 2**30


def decimal_size(size_bytes: float) -> str:
    """Decimal units, as the published report writes sizes (GB = 10**9 bytes)."""
    if size_bytes >= GB:
        return f"{size_bytes / GB:,.1f} GB"
    return f"{size_bytes / 1e6:,.2f} MB"


def stage_times(benchmark_dir: Path) -> list[dict]:
    """Wall time of every stage that ran, from Snakemake's benchmark files."""
    rows = []
    for path in sorted(benchmark_dir.rglob("*.tsv")):
        with open(path) as f:
            records = list(csv.DictReader(f, delimiter="\t"))
        if records:
            rows.append({"stage": str(path.relative_to(benchmark_dir).with_suffix("")),
                         "seconds": float(records[-1]["s"]), "max_rss_mb": _float(records[-1].get("max_rss"))})
    return rows


def _float(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def context(inputs: dict[str, Path], config: dict, benchmark_dir: Path) -> dict:
    manifest = read_json(inputs["upstream"])
    ctx = {
        "title": config["title"],
        "config": config,
        "config_hash": config_hash(config),
        "upstream": manifest,
        "upstream_gb": manifest["total_bytes"] / GB,
        "stage_times": stage_times(benchmark_dir),
        "card": read_json(inputs["card"]) if "card" in inputs else None,
        "train": read_json(inputs["train"]) if "train" in inputs else None,
        "builds": config["builds"],
        "build_rows": build_rows(inputs, config),
        "memory_rows": memory_rows(inputs, config),
        "eval_rows": eval_rows(inputs, config),
    }
    return ctx


def build_rows(inputs: dict[str, Path], config: dict) -> list[dict]:
    """One row per build that has a manifest: size, against the reference, expert bits."""
    manifests = {key[len("build_"):]: read_json(path) for key, path in inputs.items() if key.startswith("build_")}
    reference = manifests.get(config["reference_build"])
    rows = []
    for build_id, manifest in manifests.items():
        ratio = manifest["total_bytes"] / reference["total_bytes"] if reference else None
        rows.append({"id": build_id, "label": config["builds"][build_id]["label"], "bytes": manifest["total_bytes"],
                     "ratio": ratio, "bits": manifest["routed_expert_bits_per_weight"],
                     "experts": manifest["num_experts"], "by_class": manifest["bytes_by_class"]})
    return rows


def memory_rows(inputs: dict[str, Path], config: dict) -> list[dict]:
    rows = []
    for key, path in inputs.items():
        if key.startswith("memory_"):
            measured = read_json(path)
            prediction = read_json(inputs[f"prediction_{measured['build']}"])
            rows.append({**measured, "label": config["builds"][measured["build"]]["label"],
                         "utilisation": prediction["utilisation"]})
    return rows


def eval_rows(inputs: dict[str, Path], config: dict) -> list[dict]:
    """One row per build: each eval's headline figures (absent where that eval did not run)."""
    results: dict[str, dict[str, dict]] = {}
    for key, path in inputs.items():
        if key.startswith("eval_"):
            record = read_json(path)
            results.setdefault(record["build"], {})[record["eval"]] = record
    return [{"id": build_id, "label": config["builds"][build_id]["label"], **results[build_id]}
            for build_id in config["builds"] if build_id in results]


def render(inputs: dict[str, Path], config: dict, out_file: Path, benchmark_dir: Path = Path("benchmarks")) -> None:
    prov = Provenance("report", config.get("report", {}), inputs=[str(p) for p in inputs.values()])
    env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(["html", "j2"]),
                      trim_blocks=True, lstrip_blocks=True)
    env.filters["gb"] = decimal_size
    env.filters["pct"] = lambda x: f"{100 * x:.1f}%"
    ctx = context(inputs, config, benchmark_dir)
    ctx["provenance"] = prov.record()
    html = env.get_template("r013.html.j2").render(**ctx)
    atomic_write_text(out_file, html)
