"""Which routed experts a pruned build keeps, per MoE layer.

`router_sum` is the pruned75 card's calibration-free rule: rank each layer's experts by the signed
sum of their router weight row, descending, keep the top fraction. With grouped routing
(n_group > 1) the same number is kept from every group, so a pruned model routes exactly like the
original with the pruned experts masked out (each group keeps its place in group-limited routing).
`reap` ranks by calibration saliency instead (see `moeshrink.compress.reap`). Both are registered
here (`moeshrink.core.prune_methods`); this module stays light, so that checking a config or
planning from headers imports no torch.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from moeshrink.core.prune_methods import REGISTRY, PruneConfigError, PruneMethod, kept_count  # noqa: F401

if TYPE_CHECKING:  # the planner counts kept experts from headers alone, without torch
    import torch

REGISTRY.register(PruneMethod("router_sum", "moeshrink.compress.prune:router_sum_layers"))
REGISTRY.register(PruneMethod("reap", "moeshrink.compress.reap:reap_layers", calibrated=True))


def router_sum_scores(router_weight: torch.Tensor) -> torch.Tensor:
    """The signed sum of each expert's router row."""
    import torch

    return router_weight.to(torch.float64).sum(dim=1)


def router_tensors(upstream: Path, layers: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """Each MoE layer's router tensors (`weight`, and `correction_bias` where the model has one)."""
    from safetensors import safe_open

    from moeshrink.core.arch import adapter_for
    from moeshrink.core.checkpoint import CheckpointError, index_of
    from moeshrink.core.ioutil import read_json
    from moeshrink.formats.source_experts import require_finite

    adapter = adapter_for(read_json(upstream / "config.json"))
    weight_map = index_of(upstream)["weight_map"]
    out: dict[int, dict[str, torch.Tensor]] = {}
    for layer in layers:
        out[layer] = {}
        for role, name in adapter.router_tensors(layer).items():
            if name not in weight_map:
                if role == "weight":
                    raise CheckpointError(f"{upstream}: router tensor {name} of MoE layer {layer} is not in the index")
                continue
            with safe_open(str(upstream / weight_map[name]), "pt") as f:
                out[layer][role] = require_finite(f.get_tensor(name), f"{upstream / weight_map[name]}: {name}")
    return out


def router_sum_layers(upstream: Path, spec: dict, calibration_file: Path | None, where: str) -> dict:
    """The router_sum scorer: every MoE layer's experts by the signed sum of their router rows."""
    from moeshrink.core.arch import adapter_for
    from moeshrink.core.ioutil import read_json

    config = read_json(upstream / "config.json")
    layers = adapter_for(config).moe_layers(config)
    return {layer: router_sum_scores(tensors["weight"]) for layer, tensors in router_tensors(upstream, layers).items()}


def choose_experts(scores: torch.Tensor, keep: int, n_group: int = 1) -> list[int]:
    """Indices of the kept experts, ascending (their order, and so the compacted numbering, is kept)."""
    num_experts = scores.numel()
    per_group = num_experts // n_group
    keep_per_group = keep // n_group
    kept: list[int] = []
    for group in range(n_group):
        group_scores = scores[group * per_group:(group + 1) * per_group]
        # stable descending sort: ties keep the lower index
        order = sorted(range(per_group), key=lambda i: (-float(group_scores[i]), i))
        kept += [group * per_group + i for i in order[:keep_per_group]]
    return sorted(kept)
