"""REAP: the layer-by-layer forward reproduces the model, the saliency follows its definition,
and a reap build keeps the most salient experts of every group."""

import pytest
import torch
from test_prune import deepseek_v3, qwen3_moe
from transformers import AutoModelForCausalLM

from moeshrink.compress import reap
from moeshrink.compress.builder import make_plan


def saliency_through_transformers(model, ids, family):
    """REAP computed independently: hooks on transformers' own MoE blocks, its router and experts."""
    scores = {}

    def hook(index):
        def record(module, args):
            x = args[0].reshape(-1, args[0].shape[-1])
            if family == "deepseek_v3":
                _, weights, indices = module.gate(x)
            else:
                logits = module.gate(x)[0] if isinstance(module.gate(x), tuple) else module.gate(x)
                probs = logits.softmax(-1)
                weights, indices = probs.topk(model.config.num_experts_per_tok, dim=-1)
            gates = weights / weights.sum(-1, keepdim=True)
            experts = module.experts
            total = torch.zeros(experts.num_experts, dtype=torch.float64)
            count = torch.zeros(experts.num_experts)
            for token in range(x.shape[0]):
                for slot in range(indices.shape[1]):
                    e = int(indices[token, slot])
                    gate, up = (experts.gate_up_proj[e] @ x[token]).chunk(2)
                    y = experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up)
                    total[e] += float(gates[token, slot] * y.norm())
                    count[e] += 1
            scores[index] = [float(t / c) if c else 0.0 for t, c in zip(total, count)]
        return record

    for index, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "experts"):
            layer.mlp.register_forward_pre_hook(hook(index))
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
    return scores, hidden


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_layer_by_layer_forward_and_saliency_match_transformers(tmp_path, family):
    model, _ = (qwen3_moe if family == "qwen3_moe" else deepseek_v3)(tmp_path)
    folder = tmp_path / ("qwen" if family == "qwen3_moe" else "dsv3")
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    got = reap.layer_saliency(folder, ids, return_hidden=True)
    model = AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="sdpa").eval()
    expected, hidden = saliency_through_transformers(model, ids, family)
    assert torch.allclose(got["hidden"], hidden, atol=1e-4), (got["hidden"] - hidden).abs().max()
    assert set(got["saliency"]) == set(expected)
    for layer, values in expected.items():
        assert got["saliency"][layer] == pytest.approx(values, rel=1e-4, abs=1e-6)
        assert any(v > 0 for v in values)


def test_reap_build_keeps_the_most_salient_experts_per_group(published, small_data, tmp_path):
    folder, manifest = published
    calibration = {"file": None, "sequences": 2, "seq_len": 32}
    spec = {"label": "r", "prune": {"method": "reap", "keep_fraction": 0.5, "calibration": calibration}}
    plan = make_plan("r", spec, folder, manifest, small_data / "corpus.jsonl")
    per_group = plan["num_experts"] // plan["n_group"]
    for layer_plan in plan["prune"]["layers"].values():
        scores, kept = layer_plan["scores"], layer_plan["kept"]
        assert len(kept) == plan["num_experts"] // 2
        for group in range(plan["n_group"]):
            members = range(group * per_group, (group + 1) * per_group)
            best = sorted(members, key=lambda e: (-scores[e], e))[: per_group // 2]
            assert sorted(best) == [e for e in kept if e in members]
    assert plan["prune"]["calibration_sha256"]


def test_reap_without_usable_calibration_fails_clearly(published, small_data, tmp_path):
    folder, manifest = published
    spec = {"label": "r", "prune": {"method": "reap", "keep_fraction": 0.5,
                                    "calibration": {"file": None, "sequences": 2, "seq_len": 32}}}
    with pytest.raises(reap.ReapError, match=r"builds.r.prune.calibration: method reap needs calibration text"):
        make_plan("r", spec, folder, manifest, None)
    with pytest.raises(reap.ReapError, match="does not exist"):
        make_plan("r", spec, folder, manifest, tmp_path / "missing.jsonl")
    short = tmp_path / "short.txt"
    short.write_text("only a few words")
    with pytest.raises(reap.ReapError, match="fewer than sequences x seq_len"):
        make_plan("r", spec, folder, manifest, short)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"txt": "x"}\n')
    with pytest.raises(reap.ReapError, match="bad.jsonl:1: .*'text'"):
        make_plan("r", spec, folder, manifest, bad)
