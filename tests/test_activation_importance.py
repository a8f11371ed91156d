"""Activation importance, which TWX v2's encoder may weigh its error by: each expert's per-column sums
follow their definition (computed here apart, through transformers' own MoE blocks); a build made with
it records the calibration in its plan and manifest, its shards differ from the calibration-free
build's and lose less where the calibration text's activations are; an importance file made from
other calibration is refused by name."""
import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file
from test_calibrated_bits import through_moe_blocks, tiny_deepseek_v3

from moeshrink.compress import activation_importance, importance_file, reap
from moeshrink.compress.activation_importance import ImportanceMoE
from moeshrink.compress.importance_file import ImportanceError
from moeshrink.core.arch import adapter_for
from moeshrink.core.ioutil import read_json
from moeshrink.formats import twx_vq
from moeshrink.formats.source_experts import read_expert_weight, source_format
from moeshrink.stages import build_folder


def importance_through_transformers(model, ids):
    """{layer: {expert: (sum of g^2 x^2, sum of g^2 a^2)}} with g the gate the layer applies."""
    sums = {}

    def hook(index):
        def record(module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            _, weights, indices = module.gate(x)
            experts = module.experts
            half = experts.gate_up_proj.shape[1] // 2
            for e in range(experts.num_experts):
                tokens, slot = torch.where(indices == e)
                if len(tokens):
                    g2 = weights[tokens, slot, None].double().square()
                    h = x[tokens]
                    a = F.silu(h @ experts.gate_up_proj[e, :half].T) * (h @ experts.gate_up_proj[e, half:].T)
                    sums.setdefault(index, {})[e] = ((g2 * h.double().square()).sum(0), (g2 * a.double().square()).sum(0))
        return record

    through_moe_blocks(model, ids, hook)
    return sums


def test_importance_per_expert_follows_its_definition(tmp_path):
    folder, ids, model = tiny_deepseek_v3(tmp_path)
    got = reap.layer_pass(folder, ids, ImportanceMoE)["layers"]
    expected = importance_through_transformers(model, ids)
    assert set(got) == set(expected)
    for layer, experts in expected.items():
        assert set(got[layer]["sums"]) == set(experts)
        assert [e for e, n in enumerate(got[layer]["tokens"]) if n] == sorted(experts)
        for e, (hidden, intermediate) in experts.items():
            assert torch.allclose(got[layer]["sums"][e]["hidden"], hidden, rtol=1e-4)
            assert torch.allclose(got[layer]["sums"][e]["intermediate"], intermediate, rtol=1e-3, atol=1e-12)


def test_a_build_whose_encoder_weighs_activations(published, small_data, tmp_path):
    folder, _ = published
    calibration = {"file": None, "sequences": 2, "seq_len": 32}
    text = small_data / "corpus.jsonl"
    weighted = build_folder("w", {"label": "w", "quantize": {"format": "twx3-v2", "calibration": calibration}},
                            folder, tmp_path / "w", quantize_calibration_file=text)
    plain = build_folder("p", {"label": "p", "quantize": {"format": "twx3-v2"}}, folder, tmp_path / "p")
    record = weighted["done"]["quantize"]["error_weights"]
    assert record == importance_file.calibration_record(calibration, text)
    assert "error_weights" not in plain["done"]["quantize"]
    assert weighted["routed_expert_bits_per_weight"] == plain["routed_expert_bits_per_weight"]
    assert not list((tmp_path / "w").glob("importance*")), "the importance file is not part of the build"

    measured = tmp_path / "importance.safetensors"
    importance_file.write(measured, activation_importance.measure(folder, calibration, text), record)
    importance = importance_file.Importance(measured, record)
    adapter = adapter_for(read_json(folder / "config.json"))
    fmt = source_format(read_json(folder / "config.json"))
    w_tensors = {k: v for shard in sorted((tmp_path / "w").glob("*.safetensors")) for k, v in load_file(shard).items()}
    p_tensors = {k: v for shard in sorted((tmp_path / "p").glob("*.safetensors")) for k, v in load_file(shard).items()}
    compared = lower = 0
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():
                ref = adapter.parse_expert(name)
                if not ref or ref.suffix != "weight" or name.endswith("_scale"):
                    continue
                column = importance.for_weight(ref.layer, ref.expert, ref.projection)
                if column is None:
                    continue
                weight = read_expert_weight(f, name, fmt)
                stem = name[:-len(".weight")]
                cost = twx_vq.error_weights(column, weight.shape[1], name)

                def weighted_error(tensors):
                    decoded = twx_vq.decode(tensors[f"{stem}.tw2_codes"], tensors[f"{stem}.tw2_scales"], torch.float32)
                    return float(((decoded - weight).square() * cost).sum())

                compared += 1
                lower += weighted_error(w_tensors) < weighted_error(p_tensors)
    assert compared and lower >= 0.9 * compared, (lower, compared)

    other = {**record, "calibration": {**record["calibration"], "sequences": 3}}
    with pytest.raises(ImportanceError, match="made from other calibration than the plan names"):
        importance_file.Importance(measured, other)
