"""Training is deterministic, balances experts through the router bias, and ends quantization-aware."""
import hashlib

import torch
from conftest import TINY_MODEL
from safetensors import safe_open

from moeshrink.formats import mxfp4
from moeshrink.organism import datasets
from moeshrink.organism.model import build_model
from moeshrink.organism.train import (
    IGNORE,
    LoadCounter,
    enable_qat,
    packed_forward,
    parameter_groups,
    tokenized_corpus,
    train,
)
from moeshrink.stages import organism_config

TRAIN = dict(seed=0, steps=6, seq_len=64, batch_size=2, lr=3e-3, warmup_steps=2, final_lr_fraction=0.1,
             weight_decay=0.1, grad_clip=1.0, qat_fraction=0.5, bias_update_rate=0.01, threads=2, log_every=1,
             probe_every=3, attention_init_std=None, packing="documents")


def run(tmp_path, small_data, small_tokenizer_dir, name):
    config = organism_config(TINY_MODEL, small_tokenizer_dir)
    out = tmp_path / name
    result = train(config, TRAIN, small_data / datasets.CORPUS_FILE, small_tokenizer_dir / "tokenizer.json", out,
                   data_dir=small_data)
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
        # trained tied, written untied like DeepSeek-V3 checkpoints, in bf16 but for the router bias
        assert torch.equal(f.get_tensor("lm_head.weight"), f.get_tensor("model.embed_tokens.weight"))
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16
        assert all(f.get_tensor(k).dtype == torch.float32 for k in f.keys() if k.endswith("e_score_correction_bias"))
    assert biases and all(b.abs().sum() > 0 for b in biases), "the router bias was never updated"
    assert any(".mlp.experts.0.gate_proj.weight" in n for n in names), "saved in per-expert checkpoint layout"
    # the probes ran every probe_every steps and at the end, with the same figures in both runs
    assert [p["step"] for p in first["probes"]] == [0, 3, 6] and first["probes"] == second["probes"] or \
        [{k: v for k, v in p.items() if k != "train_seconds"} for p in first["probes"]] == \
        [{k: v for k, v in p.items() if k != "train_seconds"} for p in second["probes"]]
    assert set(first["probes"][-1]) >= {"induction", "open_book_mc", "passage_copy", "operand_copy", "recall"}


def test_documents_are_packed_with_their_own_positions_and_masked_spans(small_data, small_tokenizer_dir):
    """Positions restart at every document (`packed_forward` masks attention to it), a document's
    first token is not scored, nor the tool list of a tool dialogue."""
    ids, labels, positions = tokenized_corpus(small_data / datasets.CORPUS_FILE, small_tokenizer_dir / "tokenizer.json")
    starts = (positions == 0).nonzero().flatten()
    docs = datasets.read_jsonl(small_data / datasets.CORPUS_FILE)
    assert len(starts) == len(docs) and bool((labels[starts] == IGNORE).all())
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(small_tokenizer_dir / "tokenizer.json"))
    first_tool_doc = next(i for i, d in enumerate(docs) if d["kind"] == "toolcalls")
    begin = int(starts[first_tool_doc])
    end = int(starts[first_tool_doc + 1]) if first_tool_doc + 1 < len(starts) else len(ids)
    scored_text = tokenizer.decode([int(t) for t in labels[begin:end] if t != IGNORE])
    assert "get_weather" not in scored_text.split("<tool_call>")[0]  # the tool list is read, never scored
    assert "<tool_call>" in scored_text  # the assistant's calls are


def test_packed_rows_attend_per_document_or_as_one_stream(small_tokenizer_dir):
    """Training's forward over a packed row gives each document what it gives that document alone
    (`packing: documents`), with the organism's own config (`use_cache: true`, under which
    transformers would not mask), or the row as one sequence (`packing: stream`)."""
    config = organism_config(TINY_MODEL, small_tokenizer_dir)
    assert config.get("use_cache", True)
    model = build_model(config).train()
    generator = torch.Generator().manual_seed(0)
    first, second = (torch.randint(0, 500, (1, n), generator=generator) for n in (11, 13))
    ids = torch.cat([first, second], 1)
    positions = torch.cat([torch.arange(11), torch.arange(13)]).unsqueeze(0)
    with torch.no_grad():
        packed = packed_forward(model, ids, ids, positions, "documents").logits
        stream = packed_forward(model, ids, ids, positions, "stream").logits
        alone = model(input_ids=second, use_cache=False).logits
        across = model(input_ids=ids, position_ids=positions).logits  # what training computed before
        whole = model(input_ids=ids, use_cache=False).logits
    assert torch.allclose(packed[0, 11:], alone[0], atol=1e-4)
    assert not torch.allclose(across[0, 11:], alone[0], atol=1e-2)
    assert torch.allclose(stream, whole, atol=1e-4)  # stream: one sequence, positions running on


def test_no_weight_decay_on_embeddings_norms_and_biases(small_tokenizer_dir):
    model = build_model({**organism_config(TINY_MODEL, small_tokenizer_dir), "tie_word_embeddings": True})
    decayed, spared = parameter_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decayed["weight_decay"] == 0.1 and spared["weight_decay"] == 0.0
    assert not any("embed_tokens" in names[id(p)] or "norm" in names[id(p)] for p in decayed["params"])
    assert any("q_proj" in names[id(p)] for p in decayed["params"])


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

