"""An activation-importance file (`activation_importance` measures it): each routed expert's
input-column importance on calibration text, the record of that text, and the reader the shard jobs
use. Light (no transformers), so the builder imports it."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moeshrink.core.errors import MoeshrinkError
from moeshrink.core.ioutil import atomic_path, sha256_file

RULE = ("per input column, sum over an expert's calibration tokens of (gate x activation)^2: the tokens' "
        "hidden state for gate_proj and up_proj, silu(gate_proj x) * up_proj x for down_proj")
# which importance vector each projection's input columns take
INPUT_OF = {"gate_proj": "hidden", "up_proj": "hidden", "down_proj": "intermediate"}
# the calibration forward that measures it, named as the prune methods name their scorers (it builds
# transformers' modules)
MEASURE = "moeshrink.compress.activation_importance:measure"


class ImportanceError(MoeshrinkError, ValueError):
    pass


def calibration_record(spec: dict, calibration_file: Path) -> dict:
    """What the plan and the manifest say of the calibration an importance file was made from."""
    return {"rule": RULE, "calibration": {**spec, "sha256": sha256_file(calibration_file)}}


def write(path: Path, layers: dict[int, dict], record: dict) -> dict:
    """One float32 tensor per (layer, expert, vector) a calibration token reached, named
    `layers.<layer>.experts.<expert>.<hidden|intermediate>` (upstream expert numbering); `record` goes
    into the metadata."""
    tensors = {f"layers.{layer}.experts.{expert}.{vector}": values.to(torch.float32).contiguous()
               for layer, measured in layers.items() for expert, sums in measured["sums"].items()
               for vector, values in sums.items()}
    tokens = {str(layer): measured["tokens"] for layer, measured in layers.items()}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), {"record": json.dumps(record, sort_keys=True), "tokens": json.dumps(tokens)})
    return {"path": str(path), "tensors": len(tensors), **record}


class Importance:
    """An importance file, read: each routed expert weight's input-column importance."""

    def __init__(self, path: Path, expected_record: dict):
        with safe_open(str(path), "pt") as f:
            record = json.loads((f.metadata() or {}).get("record", "null"))
        if record != expected_record:
            raise ImportanceError(f"{path}: made from other calibration than the plan names ({record} against "
                                  f"{expected_record}); delete it and let the workflow write it again")
        self.path, self.tensors = path, load_file(str(path))

    def for_weight(self, layer: int, expert: int, projection: str) -> torch.Tensor | None:
        """The importance of the input columns of one upstream expert's `projection` weight; None when no
        calibration token reached that expert."""
        if projection not in INPUT_OF:
            raise ImportanceError(f"{self.path}: no importance for projection {projection!r}")
        return self.tensors.get(f"layers.{layer}.experts.{expert}.{INPUT_OF[projection]}")
