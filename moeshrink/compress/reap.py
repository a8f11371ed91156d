"""REAP saliency of routed experts from calibration text, one decoder layer at a time, and that
calibration forward (`layer_pass`) for other per-expert measures (`calibrated_bits`).

For expert j of a MoE layer, over the calibration tokens X_j that route to it (j in the token's
top-k): S_j = mean over x in X_j of g_j(x) * ||f_j(x)||_2, where g_j is the gate value renormalised
over the token's top-k and f_j the expert's output. Experts no token reaches score 0.

Only one decoder layer is materialised at a time (transformers' own module for attention and norms,
built on the meta device and filled from the shards), and routed experts are decoded one at a time
from their upstream encoding, so memory is bounded by one layer's dense part, one expert and the
calibration activations, never the whole model.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from moeshrink.core.arch import Adapter, ExpertTensor, adapter_for
from moeshrink.core.checkpoint import CheckpointError, index_of
from moeshrink.core.errors import MoeshrinkError
from moeshrink.core.ioutil import read_json
from moeshrink.formats.source_experts import read_expert_weight, source_format
from moeshrink_kernels.experts import expert_mlp

log = logging.getLogger(__name__)
SUPPORTED = ("deepseek_v3", "qwen3_moe")
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class ReapError(MoeshrinkError, ValueError):
    pass


# ------------------------------------------------------------------------------ calibration text
def calibration_texts(path: Path) -> list[str]:
    """Texts from a .jsonl file (a "text" field per line) or a plain text file (blank-line separated)."""
    if not path.is_file():
        raise ReapError(f"calibration file {path} does not exist")
    if path.suffix == ".jsonl":
        texts = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                record = json.loads(line)
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise ReapError(f"{path}:{number}: a calibration line needs a string field 'text'")
                texts.append(record["text"])
    else:
        texts = [part for part in path.read_text().split("\n\n") if part.strip()]
    if not texts:
        raise ReapError(f"calibration file {path} holds no text")
    return texts


def calibration_batch(upstream: Path, texts: list[str], sequences: int, seq_len: int) -> torch.Tensor:
    """Token ids [sequences, seq_len]: the texts tokenised, joined by EOS and cut into windows."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(upstream))
    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    needed = sequences * seq_len
    stream: list[int] = []
    for text in texts:
        stream += tokenizer(text, add_special_tokens=False)["input_ids"] + separator
        if len(stream) >= needed:
            break
    if len(stream) < needed:
        raise ReapError(f"calibration text gives {len(stream)} tokens, fewer than sequences x seq_len = {needed}")
    return torch.tensor(stream[:needed]).reshape(sequences, seq_len)


# ------------------------------------------------------------------------------- checkpoint access
class ShardReader:
    """Tensors by name from a sharded checkpoint, routed experts decoded exactly to float32."""

    def __init__(self, folder: Path, fmt: str):
        self.folder, self.fmt = folder, fmt
        self.weight_map: dict[str, str] = index_of(folder)["weight_map"]
        self._handles: dict[str, object] = {}

    def _handle(self, name: str):
        if name not in self.weight_map:
            raise CheckpointError(f"{self.folder}: tensor {name} is not in the index")
        shard = self.weight_map[name]
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(self.folder / shard), "pt")
        return self._handles[shard]

    def tensor(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name).to(torch.float32)

    def expert(self, name: str) -> torch.Tensor:
        return read_expert_weight(self._handle(name), name, self.fmt)

    def names_under(self, prefix: str) -> list[str]:
        return [n for n in self.weight_map if n.startswith(prefix)]


# ---------------------------------------------------------------------------------------- routing
def route(logits: torch.Tensor, config: dict, arch: str, correction_bias: torch.Tensor | None
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(top-k indices, weights the layer applies, gate values renormalised over the top-k)."""
    top_k = int(config["num_experts_per_tok"])
    if arch == "deepseek_v3":
        scores = logits.sigmoid()
        choice = scores + (correction_bias if correction_bias is not None else 0)
        n_group, topk_group = int(config.get("n_group") or 1), int(config.get("topk_group") or 1)
        if n_group > 1:
            grouped = choice.view(len(choice), n_group, -1)
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(-1)
            keep_groups = group_scores.topk(topk_group, dim=-1)[1]
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep_groups, True)
            choice = choice.masked_fill(~mask.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
        indices = choice.topk(top_k, dim=-1)[1]
        gates = scores.gather(1, indices)
        renormalised = gates / (gates.sum(-1, keepdim=True) + 1e-20)
        applied = (renormalised if config.get("norm_topk_prob", True) else gates) * float(
            config.get("routed_scaling_factor", 1.0))
        return indices, applied, renormalised
    probabilities = logits.softmax(dim=-1)
    gates, indices = probabilities.topk(top_k, dim=-1)
    renormalised = gates / gates.sum(-1, keepdim=True)
    applied = renormalised if config.get("norm_topk_prob", False) else gates
    return indices, applied, renormalised


class SalienceMoE(nn.Module):
    """Stands in for a MoE block: computes its output exactly and accumulates REAP saliency."""

    def __init__(self, reader: ShardReader, adapter: Adapter, config: dict, layer: int, shared: nn.Module | None):
        super().__init__()
        self.reader, self.adapter, self.config, self.layer = reader, adapter, config, layer
        self.shared = shared
        routers = adapter.router_tensors(layer)
        self.router_weight = reader.tensor(routers["weight"])
        bias_name = routers.get("correction_bias")
        self.correction_bias = reader.tensor(bias_name) if bias_name and bias_name in reader.weight_map else None
        experts = self.router_weight.shape[0]
        self.saliency_sum = torch.zeros(experts, dtype=torch.float64)
        self.token_count = torch.zeros(experts, dtype=torch.int64)

    def expert_weights(self, expert: int) -> dict[str, torch.Tensor]:
        """{projection: float32 weight} of one routed expert, decoded from its upstream encoding."""
        return {projection: self.reader.expert(self.adapter.expert_name(ExpertTensor(self.layer, expert, projection,
                                                                                     "weight")))
                for projection in PROJECTIONS}

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        flat = hidden_states.reshape(-1, hidden_states.shape[-1]).to(torch.float32)
        indices, applied, renormalised = route(flat @ self.router_weight.T, self.config, self.adapter.name,
                                               self.correction_bias)
        out = torch.zeros_like(flat)
        for expert in indices.unique().tolist():
            tokens, slot = torch.where(indices == expert)
            weights = self.expert_weights(expert)
            y = expert_output(flat[tokens], weights)
            out.index_add_(0, tokens, y * applied[tokens, slot, None])
            self.observe(expert, tokens, flat[tokens], y, weights, applied[tokens, slot], renormalised[tokens, slot])
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.reshape(hidden_states.shape).to(hidden_states.dtype)

    def observe(self, expert: int, tokens: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                weights: dict[str, torch.Tensor], applied: torch.Tensor, renormalised: torch.Tensor) -> None:
        """One expert's routed tokens (their rows of the layer's flattened batch, and their inputs x), its
        output y and the gates: what a subclass measures."""
        self.saliency_sum[expert] += float((renormalised * y.norm(dim=-1)).double().sum())
        self.token_count[expert] += len(x)

    def saliency(self) -> torch.Tensor:
        return torch.where(self.token_count > 0, self.saliency_sum / self.token_count.clamp(min=1).double(),
                           torch.zeros_like(self.saliency_sum))

    def result(self):
        """What the layer pass returns for this layer."""
        return self.saliency().tolist()


def expert_output(x: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    return expert_mlp(x, torch.cat([weights["gate_proj"], weights["up_proj"]]), weights["down_proj"])


# ------------------------------------------------------------------------------------ the forward
def _skeleton(config: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "quantization_config"})
    hf_config._attn_implementation = "sdpa"  # causal masking without a mask tensor
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa", dtype=torch.float32)
    rotary = type(model.model.rotary_emb)(config=hf_config)
    return hf_config, model, rotary


def _materialise(module: nn.Module, reader: ShardReader, prefix: str, skip: set[str]) -> None:
    module.to_empty(device="cpu")
    state = {name[len(prefix):]: reader.tensor(name) for name in reader.names_under(prefix) if name not in skip}
    missing, _ = module.load_state_dict(state, strict=False, assign=True)
    if missing:
        raise CheckpointError(f"{reader.folder}: tensors missing under {prefix}: {', '.join(sorted(missing)[:8])}")


def layer_saliency(upstream: Path, token_ids: torch.Tensor, threads: int | None = None,
                   return_hidden: bool = False) -> dict:
    """{"saliency": {moe layer: saliency per expert}} (and, for tests, the final normed hidden states)."""
    result = layer_pass(upstream, token_ids, SalienceMoE, threads, return_hidden)
    result["saliency"] = result.pop("layers")
    return result


def _keep_residual(block: SalienceMoE) -> Callable:
    """A pre-hook on the norm before a MoE block: the block may read the residual stream it normalises
    (`block.residual`, flattened like the block's own input)."""
    def keep(module, args) -> None:
        block.residual = args[0].reshape(-1, args[0].shape[-1]).to(torch.float32)
    return keep


@torch.no_grad()
def layer_pass(upstream: Path, token_ids: torch.Tensor, observer: Callable[..., SalienceMoE] = SalienceMoE,
               threads: int | None = None, return_hidden: bool = False) -> dict:
    """The calibration forward, one decoder layer at a time, with `observer` (called as SalienceMoE is)
    standing in for every MoE block: {"layers": {moe layer: its observer's result()}} (and, for tests,
    the final normed hidden states)."""
    if threads:
        torch.set_num_threads(threads)
    config = read_json(upstream / "config.json")
    adapter = adapter_for(config)
    if adapter.name not in SUPPORTED:
        raise ReapError(f"reap: architecture {adapter.name} is not supported yet (supported: {', '.join(SUPPORTED)}); "
                        "use method router_sum")
    reader = ShardReader(upstream, source_format(config))
    hf_config, model, rotary = _skeleton(config)
    moe_layers = set(adapter.moe_layers(config))
    hidden = F.embedding(token_ids, reader.tensor("model.embed_tokens.weight"))
    positions = torch.arange(token_ids.shape[1]).unsqueeze(0).expand(token_ids.shape[0], -1)
    position_embeddings = rotary(hidden, positions)
    results: dict[int, object] = {}
    for index, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{index}."
        skip = {n for n in reader.names_under(prefix) if adapter.parse_expert(n) or adapter.router_layer(n) is not None}
        if index in moe_layers:
            if hasattr(layer.mlp, "shared_expert_gate"):
                raise ReapError(f"reap: layer {index} has a gated shared expert (Qwen2-MoE), which this forward "
                                "does not compute; use method router_sum")
            shared = getattr(layer.mlp, "shared_experts", None)
            layer.mlp = nn.Identity()
        _materialise(layer, reader, prefix, skip)
        if index in moe_layers:
            shared_module = None
            if shared is not None:
                shared.to_empty(device="cpu")
                shared_prefix = prefix + "mlp.shared_experts."
                shared.load_state_dict({n[len(shared_prefix):]: reader.tensor(n) for n in reader.names_under(shared_prefix)},
                                       assign=True)
                shared_module = shared
            layer.mlp = observer(reader, adapter, config, index, shared_module)
            layer.post_attention_layernorm.register_forward_pre_hook(_keep_residual(layer.mlp))
        hidden = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=position_embeddings)
        if isinstance(hidden, tuple):
            hidden = hidden[0]
        if index in moe_layers:
            results[index] = layer.mlp.result()
            log.info("layer %d: tokens per expert min %d max %d", index, int(layer.mlp.token_count.min()),
                     int(layer.mlp.token_count.max()))
        model.model.layers[index] = nn.Identity()  # free the layer before the next one is built
    result: dict = {"layers": results}
    if return_hidden:
        norm = model.model.norm
        _materialise(norm, reader, "model.norm.", set())
        result["hidden"] = norm(hidden)
    return result


def reap_layers(upstream: Path, spec: dict, calibration_file: Path | None, where: str) -> dict[int, torch.Tensor]:
    """The reap scorer: every MoE layer's experts by their mean saliency on the calibration text."""
    calibration = spec.get("calibration")
    if calibration is None or calibration_file is None:
        raise ReapError(f"{where}.calibration: method reap needs calibration text (file, sequences, seq_len)")
    texts = calibration_texts(calibration_file)
    token_ids = calibration_batch(upstream, texts, calibration["sequences"], calibration["seq_len"])
    saliency = layer_saliency(upstream, token_ids)["saliency"]
    return {layer: torch.tensor(values, dtype=torch.float64) for layer, values in saliency.items()}
