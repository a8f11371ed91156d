"""Training is deterministic, balances experts through the router bias, and ends quantization-aware."""
import hashlib

import torch
from safetensors import safe_open

from moeshrink import mxfp4
from moeshrink.organism import datasets
from moeshrink.organism.model import build_model
from moeshrink.organism.train import LoadCounter, enable_qat, train
from moeshrink.stages import organism_config

from conftest import TINY_MODEL

TRAIN = dict(seed=0, steps=6, seq_len=64, batch_size=2, lr=3e-3, warmup_steps=2, final_lr_fraction=0.1,
             weight_decay=0.1, grad_clip=1.0, qat_fraction=0.5, bias_update_rate=0.01, threads=2, log_every=1,
             attention_init_std=0.08)


def run(tmp_path, small_data, small_tokenizer_dir, name):
    config = organism_config(TINY_MODEL, small_tokenizer_dir)
    out = tmp_path / name
    result = train(config, TRAIN, small_data / datasets.CORPUS_FILE, small_tokenizer_dir / "tokenizer.json", out)
    return result, hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest(), out


def test_training_is_deterministic_and_records_its_run(tmp_path, small_data, small_tokenizer_dir):
    first, digest_a, out = run(tmp_path, small_data, small_tokenizer_dir, "a")
    second, digest_b, _ = run(tmp_path, small_data, small_tokenizer_dir, "b")
    assert digest_a == digest_b
    assert [h["loss"] for h in first["history"]] == [h["loss"] for h in second["history"]]
    assert first["steps"] == 6 and first["qat_start_step"] == 3
    assert [h["qat"] for h in first["history"]] == [False, False, False, True, True, True]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        biases = [f.get_tensor(k) for k in f.keys() if k.endswith("e_score_correction_bias")]
        names = list(f.keys())
        # trained tied, written untied like DeepSeek-V3 checkpoints
        assert torch.equal(f.get_tensor("lm_head.weight"), f.get_tensor("model.embed_tokens.weight"))
    assert biases and all(b.abs().sum() > 0 for b in biases), "the router bias was never updated"
    assert any(".mlp.experts.0.gate_proj.weight" in n for n in names), "saved in per-expert checkpoint layout"


def test_bias_update_moves_towards_balance(small_tokenizer_dir):
    model = build_model(organism_config(TINY_MODEL, small_tokenizer_dir))
    counter = LoadCounter(model)
    model(input_ids=torch.randint(0, 500, (2, 32)))
    counts = [c.clone() for c in counter.counts]
    counter.update_biases(0.5)
    for moe, c in zip(counter.moes, counts):
        bias = moe.gate.e_score_correction_bias
        assert torch.all(bias[c > c.mean()] < 0) and torch.all(bias[c < c.mean()] > 0)


def test_qat_forward_sees_mxfp4_experts(small_tokenizer_dir):
    model = build_model(organism_config(TINY_MODEL, small_tokenizer_dir))
    experts = model.model.layers[1].mlp.experts
    raw = experts.gate_up_proj.detach().clone()
    enable_qat(model)
    assert torch.equal(experts.gate_up_proj.detach(), mxfp4.quantize_values(raw))

