"""How much each input column of each routed expert's weights matters to the layer's output, measured
on calibration text: what an encoder that weighs its squared error (TWX v2, `encode(importance=)`)
reads.

In the calibration forward of `reap.layer_pass`, for every expert and its routed tokens x with the
gate g the layer applies: hidden[j] = sum over x of g^2 x_j^2 (the input of gate_proj and up_proj)
and intermediate[j] = sum over x of g^2 a_j^2, a = silu(gate_proj x) * up_proj x (the input of
down_proj). An error e in row r of a weight changes that row's output by e . x, so with columns
taken as independent the output's squared error is sum_j importance[j] e_j^2 (the diagonal of the
activations' second moment, as GPTQ's and llama.cpp's importance matrices use). Experts no
calibration token reaches have zero importance, which the encoder takes as "all columns alike".
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from moeshrink.compress import reap
from moeshrink.compress.importance_file import ImportanceError


class ImportanceMoE(reap.SalienceMoE):
    def __init__(self, reader, adapter, config, layer, shared):
        super().__init__(reader, adapter, config, layer, shared)
        self.sums: dict[int, dict[str, torch.Tensor]] = {}

    def observe(self, expert, tokens, x, y, weights, applied, renormalised) -> None:
        super().observe(expert, tokens, x, y, weights, applied, renormalised)
        gate_squared = applied.double().square()[:, None]
        intermediate = F.silu(x @ weights["gate_proj"].T) * (x @ weights["up_proj"].T)
        sums = self.sums.setdefault(expert, {})
        for vector, activation in (("hidden", x), ("intermediate", intermediate)):
            sums[vector] = sums.get(vector, 0) + (gate_squared * activation.double().square()).sum(dim=0)

    def result(self) -> dict:
        for expert, sums in self.sums.items():
            for vector, values in sums.items():
                if not bool(torch.isfinite(values).all()):
                    raise ImportanceError(f"layer {self.layer} expert {expert}: the calibration activations' "
                                          f"{vector} importance is not finite")
        return {"sums": self.sums, "tokens": self.token_count.tolist()}


def measure(upstream: Path, spec: dict, calibration_file: Path) -> dict[int, dict]:
    """{moe layer: {"sums": {expert: {"hidden": [hidden], "intermediate": [moe intermediate]}}, "tokens":
    [expert]}} on the calibration text that `spec` ({file, sequences, seq_len}) names."""
    texts = reap.calibration_texts(calibration_file)
    token_ids = reap.calibration_batch(upstream, texts, spec["sequences"], spec["seq_len"])
    return reap.layer_pass(upstream, token_ids, ImportanceMoE)["layers"]
