"""Pruning: the pruned model computes what the original computes with the pruned experts masked out."""
import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from moeshrink.compress import prune
from moeshrink.compress.builder import gather, make_plan, rewrite_shard
from moeshrink.core.arch import adapter_for
from moeshrink.core.checkpoint import build_manifest, index_of

HIDDEN = 64


def save_tiny(model, folder):
    model.save_pretrained(str(folder))
    manifest = build_manifest(folder, {"kind": "test"})
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return manifest


def build(folder, manifest, build_cfg, out):
    plan = make_plan("pruned", build_cfg, folder, manifest)
    out.mkdir()
    shards = sorted(set(index_of(folder)["weight_map"].values()))
    for shard in shards:
        rewrite_shard(folder, manifest, shard, plan, out / shard)
    return plan, gather(out, folder, manifest, plan, shards)


def qwen3_moe(tmp_path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=300, hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=128)
    model = Qwen3MoeForCausalLM(config).eval()
    return model, save_tiny(model, tmp_path / "qwen")


def deepseek_v3(tmp_path):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(vocab_size=300, hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=32,
                              num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1,
                              n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                              first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=None, qk_rope_head_dim=16,
                              qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=128,
                              topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True)
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.uniform_(-0.2, 0.2)
    return model, save_tiny(model, tmp_path / "dsv3")


def masked_qwen3_router(gate, pruned: list[int]):
    def forward(hidden_states):
        logits = F.linear(hidden_states.reshape(-1, gate.hidden_dim), gate.weight)
        logits[:, pruned] = float("-inf")
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        values, indices = torch.topk(probs, gate.top_k, dim=-1)
        values = values / values.sum(dim=-1, keepdim=True)
        return logits, values.to(logits.dtype), indices
    return forward


def masked_deepseek_router(gate, pruned: list[int]):
    """DeepSeek-V3 routing with the pruned experts' scores at -inf before group and expert selection."""
    def forward(hidden_states):
        hidden_states = hidden_states.view(-1, gate.hidden_dim)
        logits = F.linear(hidden_states.float(), gate.weight.float())
        scores = logits.sigmoid()
        choice = scores + gate.e_score_correction_bias
        choice[:, pruned] = float("-inf")
        per_group = gate.num_experts // gate.num_group
        group_scores = choice.view(-1, gate.num_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=gate.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        mask = group_mask.unsqueeze(-1).expand(-1, gate.num_group, per_group).reshape(-1, gate.num_experts)
        choice = choice.masked_fill(~mask.bool(), float("-inf"))
        indices = torch.topk(choice, k=gate.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, indices)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * gate.routed_scaling_factor
        return logits, weights, indices
    return forward


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_pruned_model_equals_original_with_pruned_experts_masked(tmp_path, family):
    model, manifest = (qwen3_moe if family == "qwen3_moe" else deepseek_v3)(tmp_path)
    folder = tmp_path / ("qwen" if family == "qwen3_moe" else "dsv3")
    plan, built = build(folder, manifest, {"label": "x", "prune": {"method": "router_sum", "keep_fraction": 0.5}},
                        tmp_path / "pruned")
    pruned_model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "pruned")).eval()
    masker = masked_qwen3_router if family == "qwen3_moe" else masked_deepseek_router
    for layer_key, layer_plan in plan["prune"]["layers"].items():
        gate = model.model.layers[int(layer_key)].mlp.gate
        dropped = [e for e in range(plan["num_experts"]) if e not in layer_plan["kept"]]
        gate.forward = masker(gate, dropped)
    ids = torch.randint(0, 300, (2, 20))
    with torch.no_grad():
        expected, got = model(ids).logits, pruned_model(ids).logits
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
    assert built["num_experts"] == plan["num_experts"] // 2
    config = json.loads((tmp_path / "pruned/config.json").read_text())
    assert adapter_for(config).num_experts(config) == plan["num_experts"] // 2


def test_router_sum_keeps_the_largest_signed_row_sums_and_their_rows(tmp_path):
    model, manifest = deepseek_v3(tmp_path)
    plan, _ = build(tmp_path / "dsv3", manifest, {"label": "x", "prune": {"method": "router_sum", "keep_fraction": 0.5}},
                    tmp_path / "pruned")
    pruned = AutoModelForCausalLM.from_pretrained(str(tmp_path / "pruned")).eval()
    for layer_key, layer_plan in plan["prune"]["layers"].items():
        layer = int(layer_key)
        gate = model.model.layers[layer].mlp.gate
        sums = gate.weight.detach().double().sum(dim=1)
        kept = layer_plan["kept"]
        for group in range(4):  # per group, the two largest sums
            members = list(range(4 * group, 4 * group + 4))
            best = sorted(members, key=lambda e: -float(sums[e]))[:2]
            assert sorted(best) == [e for e in kept if e in members]
        new_gate = pruned.model.layers[layer].mlp.gate
        assert torch.equal(new_gate.weight, gate.weight[kept])
        assert torch.equal(new_gate.e_score_correction_bias, gate.e_score_correction_bias[kept])
        assert torch.equal(pruned.model.layers[layer].mlp.experts.down_proj,
                           model.model.layers[layer].mlp.experts.down_proj[kept])


def test_keep_counts_that_cannot_work_are_refused_with_alternatives():
    with pytest.raises(prune.PruneConfigError, match=r"keeps 3 of 16.*top-k = 4.*n_group = 4.*: 4 \(0.25\), 8 \(0.5\)"):
        prune.kept_count(16, 0.2, top_k=4, n_group=4)
    with pytest.raises(prune.PruneConfigError, match="outside"):
        prune.kept_count(16, 0.0, top_k=4, n_group=4)
    assert prune.kept_count(896, 0.25, top_k=8, n_group=1) == 224


def test_mxfp4_experts_are_copied_byte_for_byte(tmp_path, tiny_trained, small_tokenizer_dir):
    from conftest import TINY_MODEL

    from moeshrink.stages import upstream

    published = tmp_path / "published"
    manifest = upstream({"source": "organism", "organism": {"model": TINY_MODEL, "publish": {"shards": 4}}},
                        published, tiny_trained, small_tokenizer_dir)
    plan, built = build(published, manifest, {"label": "x", "prune": {"method": "router_sum", "keep_fraction": 0.5}},
                        tmp_path / "pruned")
    from safetensors import safe_open

    source = {}
    for shard in manifest["shards"]:
        with safe_open(str(published / shard["file"]), "pt") as f:
            source.update({k: f.get_tensor(k) for k in f.keys()})
    layer = plan["moe_layers"][0]
    kept = plan["prune"]["layers"][str(layer)]["kept"]
    index = index_of(tmp_path / "pruned")["weight_map"]
    for new, old in enumerate(kept):
        for suffix in ("weight", "weight_scale"):
            name = f"model.layers.{layer}.mlp.experts.{new}.down_proj.{suffix}"
            with safe_open(str(tmp_path / "pruned" / index[name]), "pt") as f:
                got = f.get_tensor(name)
            assert got.dtype == torch.uint8
            assert torch.equal(got, source[f"model.layers.{layer}.mlp.experts.{old}.down_proj.{suffix}"])
    assert built["routed_expert_bits_per_weight"] == pytest.approx(4.25)
    assert built["bytes_by_class"]["routed_experts"] > 0 and built["bytes_by_class"]["attention"] > 0


def test_prune_methods_are_a_registry_the_config_check_reads(default_config):
    import copy

    from moeshrink.core import prune_methods
    from moeshrink.core.config import ConfigError, validate

    known = prune_methods.methods()
    assert list(known) == ["router_sum", "reap"] and known["reap"].calibrated and not known["router_sum"].calibrated
    config = copy.deepcopy(default_config)
    config["builds"]["pruned75"]["prune"]["method"] = "magnitude"
    with pytest.raises(ConfigError, match=r"builds.pruned75.prune.method: 'magnitude' is unknown; known: router_sum, "
                                          r"reap"):
        validate(config)
    config["builds"]["pruned75"]["prune"] = {"method": "router_sum", "keep_fraction": 0.25,
                                             "calibration": {"file": None, "sequences": 2, "seq_len": 32}}
    with pytest.raises(ConfigError, match="method router_sum reads no calibration text"):
        validate(config)
