"""Train the organism on the CPU, deterministically, with MXFP4 quantization-aware training at the end.

The router's score-correction bias is trained the auxiliary-loss-free way DeepSeek-V3 describes:
after each step every expert's bias moves by `bias_update_rate` towards balanced load. In the last
`qat_fraction` of the steps the routed experts are fake-quantized to MXFP4 (straight-through), so
the 4-bit published model computes what the trained model computed.
"""
from __future__ import annotations

import json
import logging
import math
import random
import time
from pathlib import Path

import torch
from torch.nn.utils import parametrize

from moeshrink.formats import mxfp4
from moeshrink.organism import OrganismError
from moeshrink.organism.model import build_model

log = logging.getLogger(__name__)


class MXFP4FakeQuant(torch.nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return mxfp4.fake_quantize(weight)


IGNORE = -100  # transformers' label for "not scored"


def tokenized_corpus(corpus_path: Path, tokenizer_file: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The corpus as one stream: token ids (each document closed by EOS), labels (IGNORE on a
    document's first token, which nothing in its context predicts, and on the spans the document
    marks as not scored, e.g. a tool list), and positions that restart at every document (for
    `packed_forward`)."""
    from tokenizers import Tokenizer

    from moeshrink.organism.tokenizer import EOS

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    eos = tokenizer.token_to_id(EOS)
    with open(corpus_path) as f:
        docs = [json.loads(line) for line in f]
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    for doc, encoding in zip(docs, tokenizer.encode_batch([d["text"] for d in docs])):
        spans = doc.get("mask") or []
        doc_ids = list(encoding.ids) + [eos]
        scored = [not any(start <= a and b <= end for start, end in spans) for a, b in encoding.offsets] + [True]
        scored[0] = False
        ids += doc_ids
        labels += [t if keep else IGNORE for t, keep in zip(doc_ids, scored)]
        positions += range(len(doc_ids))
    return torch.tensor(ids), torch.tensor(labels), torch.tensor(positions)


PACKINGS = ("documents", "stream", "whole")


def packed_forward(model, ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor, packing: str):
    """The forward pass over packed rows. `documents`: each document attends only to itself;
    transformers derives that mask from positions restarting, but only without a KV cache (a config
    with `use_cache: true`, DeepSeek-V3's, would otherwise attend across documents at the restarted
    positions). `stream` and `whole`: every token attends to all before it in its row, positions
    0..seq_len-1."""
    if packing not in PACKINGS:
        raise ValueError(f"upstream.organism.train.packing is {packing!r}; known: {', '.join(PACKINGS)}")
    position_ids = positions if packing == "documents" else None
    return model(input_ids=ids, labels=labels, position_ids=position_ids, use_cache=False)


def whole_document_rows(stream: tuple[torch.Tensor, torch.Tensor, torch.Tensor], seq_len: int,
                        pad: int) -> list[torch.Tensor]:
    """Rows that each hold whole documents, in corpus order, the rest of a row padded (not scored): no
    document is cut at a row's end, so each sees its own start (a tool dialogue its tool list). A
    document longer than a row is cut into rows of its own."""
    ids, labels, positions = stream
    starts = (positions == 0).nonzero().flatten().tolist() + [len(ids)]
    rows: list[list[tuple[int, int]]] = [[]]
    room = seq_len
    for start, end in zip(starts, starts[1:]):
        for piece in range(start, end, seq_len):
            length = min(seq_len, end - piece)
            if length > room:
                rows.append([])
                room = seq_len
            rows[-1].append((piece, piece + length))
            room -= length
    out = [torch.full((len(rows), seq_len), pad), torch.full((len(rows), seq_len), IGNORE),
           torch.zeros((len(rows), seq_len), dtype=torch.long)]
    for r, spans in enumerate(rows):
        filled = 0
        for a, b in spans:
            for tensor, source in zip(out, stream):
                tensor[r, filled:filled + b - a] = source[a:b]
            filled += b - a
    return out


def packed_rows(stream: tuple[torch.Tensor, torch.Tensor, torch.Tensor], seq_len: int, packing: str,
                pad: int) -> list[torch.Tensor]:
    """The corpus as rows of `seq_len` tokens (ids, labels, positions). A document cut at a row's end goes
    on in the next row, but with `whole` packing; the tail that fills no row is left out."""
    if packing == "whole":
        return whole_document_rows(stream, seq_len, pad)
    return [t[: len(t) // seq_len * seq_len].view(-1, seq_len) for t in stream]


def batches(rows: list[torch.Tensor], batch_size: int, seed: int):
    """Endless deterministic batches of rows (ids, labels, positions): the first epoch in corpus order
    (the corpus is already shuffled, with copy drills up front), every later epoch a new shuffle."""
    rng = random.Random(seed)
    order = list(range(len(rows[0])))
    while True:
        for start in range(0, len(order) - batch_size + 1, batch_size):
            picked = order[start:start + batch_size]
            yield tuple(t[picked] for t in rows)
        rng.shuffle(order)


def learning_rate(step: int, total: int, peak: float, warmup: int, final_fraction: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (final_fraction + (1 - final_fraction) * 0.5 * (1 + math.cos(math.pi * progress)))


def expert_modules(model) -> list:
    return [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]


def enable_qat(model) -> None:
    for moe in expert_modules(model):
        for name in ("gate_up_proj", "down_proj"):
            if not parametrize.is_parametrized(moe.experts, name):
                parametrize.register_parametrization(moe.experts, name, MXFP4FakeQuant())


def disable_qat(model) -> None:
    for moe in expert_modules(model):
        for name in ("gate_up_proj", "down_proj"):
            if parametrize.is_parametrized(moe.experts, name):
                parametrize.remove_parametrizations(moe.experts, name, leave_parametrized=False)


@torch.no_grad()
def widen_attention_init(model, std: float) -> None:
    """Start the attention projections wider than the rest: with the default 0.02 the first
    attention patterns are nearly uniform and a small model takes hundreds of steps longer to
    learn to look things up (seen here on copying drills)."""
    for layer in model.model.layers:
        for module in layer.self_attn.modules():
            if isinstance(module, torch.nn.Linear) and module is not layer.self_attn.o_proj:
                module.weight.normal_(0.0, std)


def untie_embeddings(model) -> None:
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    model.config.tie_word_embeddings = False


class LoadCounter:
    """Counts tokens routed to each expert, per MoE layer, through forward hooks on the routers."""

    def __init__(self, model):
        self.moes = expert_modules(model)
        self.counts = [torch.zeros(m.gate.num_experts) for m in self.moes]
        self.handles = [m.gate.register_forward_hook(self._hook(i)) for i, m in enumerate(self.moes)]

    def _hook(self, index: int):
        def hook(_module, _inputs, outputs):
            _, _, topk_indices = outputs
            self.counts[index] += torch.bincount(topk_indices.flatten(), minlength=len(self.counts[index])).float()
        return hook

    @torch.no_grad()
    def update_biases(self, rate: float) -> list[float]:
        """Move each bias towards balance; returns each layer's max/mean load before the update."""
        imbalance = []
        for moe, counts in zip(self.moes, self.counts):
            mean = counts.mean()
            moe.gate.e_score_correction_bias += rate * torch.sign(mean - counts)
            imbalance.append(float(counts.max() / mean) if mean > 0 else 0.0)
            counts.zero_()
        return imbalance


def save_trained(model, out_dir: Path) -> None:
    """The trained checkpoint in bf16, as it is served, but for the router's score-correction bias,
    kept in float32 (its steps of 0.001 around 1.0 are below bf16's resolution), as published."""
    biases = [moe.gate.e_score_correction_bias.detach().clone() for moe in expert_modules(model)]
    model.to(torch.bfloat16)
    for moe, bias in zip(expert_modules(model), biases):
        moe.gate.e_score_correction_bias.data = bias.float()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))


def parameter_groups(model, weight_decay: float) -> list[dict]:
    """Weight decay on the weight matrices only: not on norms, biases, router biases or embeddings
    (rare tokens' embeddings would decay between their few updates)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if param.dim() < 2 or "embed_tokens" in name or "lm_head" in name else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def load_trained(trained_dir: Path, experts_implementation: str = "grouped_mm"):
    """A checkpoint `save_trained` wrote, in float32 for training on: what the next phase starts from."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config.from_pretrained(str(trained_dir))
    config._experts_implementation = experts_implementation
    return DeepseekV3ForCausalLM.from_pretrained(str(trained_dir), config=config, dtype=torch.float32)


def first_phase_settings(train_cfg: dict) -> dict:
    return {k: v for k, v in train_cfg.items() if k != "polish"}


def polish_settings(train_cfg: dict) -> dict | None:
    """The second phase's settings: the first's, with `train.polish` over them; None without a polish."""
    polish = train_cfg.get("polish")
    return None if not polish else {**first_phase_settings(train_cfg), **polish}


PHASE_KEYS = ("train_seconds", "probe_seconds", "steps", "tokens_seen", "corpus_tokens", "corpus_scored_tokens",
              "epochs", "tokens_per_second", "qat_start_step", "final_loss")


def combined_record(first: dict, polish: dict) -> dict:
    """One training record for both phases: totals, one loss curve and one probe curve with the polish's
    steps after the first's (each point says its phase), and each phase's own figures."""
    offset = first["steps"]

    def shifted(points: list[dict], phase: str) -> list[dict]:
        out = []
        for point in points:
            point = {**point, "phase": phase}
            if phase == "polish":
                point["step"] += offset
                if "tokens" in point:
                    point["tokens"] += first["tokens_seen"]
                for key in ("seconds", "train_seconds"):
                    if key in point:
                        point[key] = round(point[key] + first["train_seconds"], 1)
            out.append(point)
        return out

    return {
        **{key: first[key] + polish[key] for key in ("train_seconds", "probe_seconds", "steps", "tokens_seen")},
        "parameters": polish["parameters"],
        "final_loss": polish["final_loss"],
        "history": shifted(first["history"], "first") + shifted(polish["history"], "polish"),
        "probes": shifted(first["probes"], "first") + shifted(polish["probes"][1:], "polish"),
        "phases": {"first": {key: first[key] for key in PHASE_KEYS if key in first},
                   "polish": {key: polish[key] for key in PHASE_KEYS if key in polish}},
    }


def train(model_config: dict | None, train_cfg: dict, corpus_path: Path, tokenizer_file: Path, out_dir: Path,
          data_dir: Path | None = None, on_probe=None, start_from: Path | None = None) -> dict:
    """Train, save, and return the record (train.json). With `data_dir`, the probes (`probes.py`) run
    every `probe_every` steps and at the end; `on_probe(step, model, record)` sees each. With
    `start_from`, training goes on from that checkpoint (as saved, untied) instead of a fresh model."""
    torch.set_num_threads(train_cfg["threads"])
    torch.manual_seed(train_cfg["seed"])
    torch.use_deterministic_algorithms(True)
    stream = tokenized_corpus(corpus_path, tokenizer_file)
    if not len(stream[0]):
        raise OrganismError(f"{corpus_path}: holds no document to train on")
    # Tied input and output embeddings while training: copying from context then needs no per-token
    # output map, which a small model learns far faster. The checkpoint is written untied, as
    # DeepSeek-V3 checkpoints are.
    if start_from is not None:
        model = load_trained(start_from)
    elif model_config is not None:
        model = build_model({**model_config, "tie_word_embeddings": True})
        if train_cfg.get("attention_init_std"):
            widen_attention_init(model, train_cfg["attention_init_std"])
    else:
        raise ValueError("train: give a model config or a checkpoint to start from")
    model.train()
    steps, seq_len, batch_size = train_cfg["steps"], train_cfg["seq_len"], train_cfg["batch_size"]
    qat_start = steps - round(steps * train_cfg["qat_fraction"])
    optimizer = torch.optim.AdamW(parameter_groups(model, train_cfg["weight_decay"]), lr=train_cfg["lr"],
                                  betas=(0.9, 0.95), eps=1e-8)
    counter = LoadCounter(model)
    probe_set = None
    if data_dir is not None:
        from moeshrink.organism import probes

        probe_set = probes.ProbeSet.build(data_dir, tokenizer_file, train_cfg["seed"])
    history, probe_history = [], []
    started = time.time()
    probe_seconds = 0.0
    rows = packed_rows(stream, seq_len, train_cfg["packing"], pad=int(stream[0][-1]))  # the corpus ends with EOS
    if len(rows[0]) < batch_size or not bool((rows[1] != IGNORE).any()):
        raise OrganismError(f"{corpus_path}: fills {len(rows[0])} rows of {seq_len} tokens, "
                            f"{int((rows[1] != IGNORE).any(dim=1).sum())} with a token training scores: "
                            f"fewer than one batch ({batch_size} rows) to train on")
    data = batches(rows, batch_size, train_cfg["seed"])

    def probe(step: int) -> None:
        nonlocal probe_seconds
        began = time.time()
        record = {"step": step, "tokens": step * batch_size * seq_len, **probe_set.run(model)}
        probe_seconds += time.time() - began
        record["train_seconds"] = round(time.time() - started - probe_seconds, 1)
        probe_history.append(record)
        log.info("probe %s", json.dumps(record))
        if on_probe:
            on_probe(step, model, record)

    for step in range(steps):
        if probe_set is not None and step % train_cfg["probe_every"] == 0:
            probe(step)
        if step == qat_start:
            enable_qat(model)
        lr = learning_rate(step, steps, train_cfg["lr"], train_cfg["warmup_steps"], train_cfg["final_lr_fraction"])
        for group in optimizer.param_groups:
            group["lr"] = lr
        ids, labels, positions = next(data)
        while not bool((labels != IGNORE).any()):  # rows wholly inside unscored spans (a tool list) teach nothing
            ids, labels, positions = next(data)
        with parametrize.cached():
            loss = packed_forward(model, ids, labels, positions, train_cfg["packing"]).loss
            if not torch.isfinite(loss):
                raise OrganismError(f"{corpus_path}: training step {step} gave a loss of {loss.item()}; "
                                    "training stops here")
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train_cfg["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        imbalance = counter.update_biases(train_cfg["bias_update_rate"])
        if step % train_cfg["log_every"] == 0 or step == steps - 1:
            record = {"step": step, "loss": round(loss.item(), 4), "lr": lr, "qat": step >= qat_start,
                      "max_over_mean_load": [round(x, 2) for x in imbalance],
                      "seconds": round(time.time() - started - probe_seconds, 1)}
            history.append(record)
            log.info(json.dumps(record))
    seconds = time.time() - started - probe_seconds
    if probe_set is not None:
        probe(steps)
    disable_qat(model)
    if model.config.tie_word_embeddings:
        untie_embeddings(model)
    save_trained(model, out_dir)
    tokens = steps * batch_size * seq_len
    scored = int((stream[1] != IGNORE).sum())
    return {
        "train_seconds": round(seconds, 1),
        "probe_seconds": round(probe_seconds, 1),
        "steps": steps,
        "tokens_seen": tokens,
        "corpus_tokens": len(stream[0]),
        "corpus_scored_tokens": scored,
        "epochs": round(tokens / len(stream[0]), 2),
        "tokens_per_second": round(tokens / seconds),
        "parameters": sum(p.numel() for p in model.parameters()),
        "qat_start_step": qat_start,
        "final_loss": history[-1]["loss"],
        "history": history,
        "probes": probe_history,
    }
