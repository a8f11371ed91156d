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
    combined_record,
    enable_qat,
    load_trained,
    packed_forward,
    parameter_groups,
    polish_settings,
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



def scored_texts(corpus, tokenizer_dir, kind: str) -> list[str]:
    """What training scores of each document of one kind."""
    from tokenizers import Tokenizer

    ids, labels, positions = tokenized_corpus(corpus, tokenizer_dir / "tokenizer.json")
    starts = [int(s) for s in (positions == 0).nonzero().flatten()] + [len(ids)]
    docs = datasets.read_jsonl(corpus)
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    return [tokenizer.decode([int(t) for t in labels[a:b] if t != IGNORE], skip_special_tokens=False)
            for doc, a, b in zip(docs, starts, starts[1:]) if doc["kind"] == kind]


def test_a_polish_corpus_scored_on_replies_scores_the_assistant_turns_only(small_data, small_tokenizer_dir):
    corpus = small_data / datasets.POLISH_CORPUS_FILE
    docs = datasets.read_jsonl(corpus)
    assert {d["kind"] for d in docs} == {"facts", "toolcalls", "cloze", "bio"}
    for text in scored_texts(corpus, small_tokenizer_dir, "facts"):
        assert "Passage:" not in text and "List every fact" not in text and "system" not in text
        assert " | " in text and text.endswith("<|im_end|><|endoftext|>")
    for text in scored_texts(corpus, small_tokenizer_dir, "toolcalls"):
        assert '"description"' not in text and "<tool_call>" in text  # the tool list is not scored, calls are
        assert "Book a trip" not in text and "What is the weather" not in text  # the user's requests
    # the first phase's corpus scores the user's turns and the passages as before
    assert any("Passage:" in text for text in scored_texts(small_data / datasets.CORPUS_FILE, small_tokenizer_dir,
                                                           "facts"))


def test_the_polish_goes_on_from_the_first_phase_as_saved_and_one_record_holds_both(
        tmp_path, small_data, small_tokenizer_dir):
    first, digest, out = run(tmp_path, small_data, small_tokenizer_dir, "first")
    loaded = load_trained(out)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert torch.equal(loaded.lm_head.weight, f.get_tensor("lm_head.weight").float())
        assert loaded.lm_head.weight.data_ptr() != loaded.model.embed_tokens.weight.data_ptr()  # stays untied
    settings = polish_settings({**TRAIN, "polish": {"steps": 4, "lr": 1e-3, "warmup_steps": 1}})
    assert settings["steps"] == 4 and settings["seq_len"] == TRAIN["seq_len"] and "polish" not in settings
    assert polish_settings(TRAIN) is None and polish_settings({**TRAIN, "polish": None}) is None
    polished_dir = tmp_path / "polished"
    polished = train(None, settings, small_data / datasets.POLISH_CORPUS_FILE, small_tokenizer_dir / "tokenizer.json",
                     polished_dir, data_dir=small_data, start_from=out)
    assert hashlib.sha256((polished_dir / "model.safetensors").read_bytes()).hexdigest() != digest
    with safe_open(str(polished_dir / "model.safetensors"), "pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16
        assert not torch.equal(f.get_tensor("lm_head.weight"), f.get_tensor("model.embed_tokens.weight"))
    record = combined_record(first, polished)
    assert record["steps"] == 10 and record["tokens_seen"] == first["tokens_seen"] + polished["tokens_seen"]
    assert [(p["step"], p["phase"]) for p in record["probes"]] == [
        (0, "first"), (3, "first"), (6, "first"), (9, "polish"), (10, "polish")]
    assert [h["step"] for h in record["history"]] == list(range(10))
    assert record["phases"]["polish"]["steps"] == 4 and record["phases"]["first"]["steps"] == 6
    assert record["train_seconds"] == first["train_seconds"] + polished["train_seconds"]


def test_a_non_finite_loss_or_a_corpus_too_short_to_train_on_stops_training_naming_it(
        tmp_path, small_data, small_tokenizer_dir, monkeypatch):
    import types

    import pytest

    from moeshrink.organism import OrganismError
    from moeshrink.organism import train as train_module

    config = organism_config(TINY_MODEL, small_tokenizer_dir)
    nan_loss = types.SimpleNamespace(loss=torch.tensor(float("nan"), requires_grad=True))
    monkeypatch.setattr(train_module, "packed_forward", lambda *args, **kwargs: nan_loss)
    with pytest.raises(OrganismError, match=r"corpus\.jsonl: training step 0 gave a loss of nan"):
        train(config, TRAIN, small_data / datasets.CORPUS_FILE, small_tokenizer_dir / "tokenizer.json",
              tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(OrganismError, match="empty.jsonl: holds no document to train on"):
        train(config, TRAIN, empty, small_tokenizer_dir / "tokenizer.json", tmp_path / "out")
    short = tmp_path / "short.jsonl"
    short.write_text('{"kind": "bio", "text": "Zevein lives in Soure."}\n' * 3)
    with pytest.raises(OrganismError, match=r"short.jsonl: fills 0 rows of 64 tokens, 0 with a token training "
                                            r"scores: fewer than one batch \(2 rows\)"):
        train(config, TRAIN, short, small_tokenizer_dir / "tokenizer.json", tmp_path / "out")
