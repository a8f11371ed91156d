"""Output-aware bit allocation: how much each routed expert's output would lose at each code width of a
format, measured on calibration text.

In the calibration forward of `reap.layer_pass`, for every expert and its routed tokens x with the
gate g the layer applies and the residual stream h the layer adds to:
error(expert, bits) = sum over x of || g * (f_bits(x) - f(x)) ||^2 / || h ||^2, where f is the
expert's exact MLP and f_bits the same MLP with its three weights encoded at `bits` and decoded. The
next layer normalises h, so what reaches it is the change relative to h (the residual stream grows
with depth: an absolute error ranks nearly every 3-bit expert into the last layers, and served worse
than the calibration-free rule on the organism). The allocator widens the experts whose error falls
most from the narrowest code to the widest. An expert no calibration token reaches has error 0.
"""
from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from moeshrink.compress import reap
from moeshrink.core.expert_formats import ExpertFormat


class OutputErrorMoE(reap.SalienceMoE):
    def __init__(self, reader, adapter, config, layer, shared, fmt: ExpertFormat):
        super().__init__(reader, adapter, config, layer, shared)
        self.fmt = fmt
        self.squared_error = torch.zeros(self.router_weight.shape[0], len(fmt.code_bits), dtype=torch.float64)

    def observe(self, expert, tokens, x, y, weights, applied, renormalised) -> None:
        super().observe(expert, tokens, x, y, weights, applied, renormalised)
        residual_sq = self.residual[tokens].double().square().sum(dim=1)
        codec = self.fmt.codec_module()
        for column, bits in enumerate(self.fmt.code_bits):
            decoded = {projection: codec.decode(*codec.encode(weight, bits, name=f"layer {self.layer} expert {expert} "
                                                                                   f"{projection}"), torch.float32)
                       for projection, weight in weights.items()}
            error = (reap.expert_output(x, decoded) - y) * applied[:, None]
            self.squared_error[expert, column] += float((error.double().square().sum(dim=1) / residual_sq).sum())

    def result(self) -> dict:
        return {"squared_error": self.squared_error.tolist(), "tokens": self.token_count.tolist()}


def output_errors(upstream: Path, fmt: ExpertFormat, spec: dict, calibration_file: Path) -> dict[int, dict]:
    """{moe layer: {"squared_error": [expert][code width], "tokens": [expert]}} on the calibration text
    that `spec` ({file, sequences, seq_len}) names."""
    texts = reap.calibration_texts(calibration_file)
    token_ids = reap.calibration_batch(upstream, texts, spec["sequences"], spec["seq_len"])
    return reap.layer_pass(upstream, token_ids, partial(OutputErrorMoE, fmt=fmt))["layers"]
