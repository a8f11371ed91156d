"""What the report reads: every configured build's result files, checked complete, loaded by kind."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from moeshrink.core.errors import MoeshrinkError
from moeshrink.core.ioutil import read_json
from moeshrink.report.report_inputs import input_files


class ReportError(MoeshrinkError, ValueError):
    """The report's inputs are incomplete or inconsistent."""


@dataclass
class Results:
    """Everything the report reads, by build."""
    upstream: dict
    manifests: dict[str, dict] = field(default_factory=dict)
    memory: dict[str, dict] = field(default_factory=dict)
    predictions: dict[str, dict] = field(default_factory=dict)
    evals: dict[str, dict[str, dict]] = field(default_factory=lambda: defaultdict(dict))
    compare: dict[str, dict] = field(default_factory=dict)
    pairs: list[dict] = field(default_factory=list)
    summary: dict | None = None
    card: dict | None = None
    train: dict | None = None
    files: dict[str, str] = field(default_factory=dict)


def load(inputs: dict[str, Path], config: dict) -> Results:
    check_complete(inputs, config)
    results = Results(upstream=read_json(inputs["upstream"]), files={k: str(v) for k, v in inputs.items()})
    for key, path in inputs.items():
        kind, _, rest = key.partition("_")
        if kind == "build":
            results.manifests[rest] = read_json(path)
        elif kind == "memory":
            results.memory[rest] = read_json(path)
        elif kind == "prediction":
            results.predictions[rest] = read_json(path)
        elif kind == "eval":
            record = read_json(path)
            results.evals[record["build"]][record["eval"]] = record
        elif kind == "compare":
            record = read_json(path)
            results.compare[record["b"]] = record
        elif kind == "pair":
            results.pairs.append(read_json(path))
    results.summary = read_json(inputs["summary"]) if "summary" in inputs else None
    results.card = read_json(inputs["card"]) if "card" in inputs else None
    results.train = read_json(inputs["train"]) if "train" in inputs else None
    return results


def check_complete(inputs: dict[str, Path], config: dict) -> None:
    """Every build config declares has its manifest, memory, evals and comparison."""
    missing = [path for key, path in input_files(config).items() if key not in inputs]
    if missing:
        raise ReportError("the report needs every configured build's results; missing: " + ", ".join(missing))
