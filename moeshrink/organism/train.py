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

from moeshrink import mxfp4
from moeshrink.organism.model import build_model

log = logging.getLogger(__name__)


class MXFP4FakeQuant(torch.nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return mxfp4.fake_quantize(weight)


def token_stream(corpus_path: Path, tokenizer_file: Path) -> tuple[torch.Tensor, int]:
    from tokenizers import Tokenizer

    from moeshrink.organism.tokenizer import EOS

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    eos = tokenizer.token_to_id(EOS)
    with open(corpus_path) as f:
        texts = [json.loads(line)["text"] for line in f]
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long), eos


def batches(stream: torch.Tensor, seq_len: int, batch_size: int, seed: int):
    """Endless deterministic batches of packed sequences: the first epoch in corpus order (the corpus
    is already shuffled, with copy drills up front), every later epoch a new shuffle."""
    sequences = stream[: len(stream) // seq_len * seq_len].view(-1, seq_len)
    rng = random.Random(seed)
    order = list(range(len(sequences)))
    while True:
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield sequences[order[start:start + batch_size]]
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


def train(model_config: dict, train_cfg: dict, corpus_path: Path, tokenizer_file: Path, out_dir: Path) -> dict:
    torch.set_num_threads(train_cfg["threads"])
    torch.manual_seed(train_cfg["seed"])
    torch.use_deterministic_algorithms(True)
    stream, _ = token_stream(corpus_path, tokenizer_file)
    # Tied input and output embeddings while training: copying from context then needs no per-token
    # output map, which a small model learns far faster. The checkpoint is written untied, as
    # DeepSeek-V3 checkpoints are.
    model = build_model({**model_config, "tie_word_embeddings": True})
    widen_attention_init(model, train_cfg["attention_init_std"])
    model.train()
    steps, seq_len, batch_size = train_cfg["steps"], train_cfg["seq_len"], train_cfg["batch_size"]
    qat_start = steps - round(steps * train_cfg["qat_fraction"])
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if param.dim() < 2 else decay).append(param)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": train_cfg["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=train_cfg["lr"], betas=(0.9, 0.95), eps=1e-8)
    counter = LoadCounter(model)
    history = []
    started = time.time()
    data = batches(stream, seq_len, batch_size, train_cfg["seed"])
    for step in range(steps):
        if step == qat_start:
            enable_qat(model)
        lr = learning_rate(step, steps, train_cfg["lr"], train_cfg["warmup_steps"], train_cfg["final_lr_fraction"])
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = next(data)
        with parametrize.cached():
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train_cfg["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        imbalance = counter.update_biases(train_cfg["bias_update_rate"])
        if step % train_cfg["log_every"] == 0 or step == steps - 1:
            record = {"step": step, "loss": round(loss.item(), 4), "lr": lr, "qat": step >= qat_start,
                      "max_over_mean_load": [round(x, 2) for x in imbalance],
                      "seconds": round(time.time() - started, 1)}
            history.append(record)
            log.info(json.dumps(record))
    seconds = time.time() - started
    disable_qat(model)
    untie_embeddings(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tokens = steps * batch_size * seq_len
    return {
        "train_seconds": round(seconds, 1),
        "steps": steps,
        "tokens_seen": tokens,
        "corpus_tokens": len(stream),
        "epochs": round(tokens / len(stream), 2),
        "tokens_per_second": round(tokens / seconds),
        "parameters": sum(p.numel() for p in model.parameters()),
        "qat_start_step": qat_start,
        "final_loss": history[-1]["loss"],
        "history": history,
    }
