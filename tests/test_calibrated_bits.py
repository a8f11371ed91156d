"""Output-aware bit allocation: each expert's output error at each code width follows its definition
(computed here apart, through transformers' own MoE blocks), the plan widens the experts whose error
falls most, and calibration text given to a format that allocates nothing is refused by name."""
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from test_prune import deepseek_v3
from transformers import AutoModelForCausalLM

from moeshrink.compress import reap
from moeshrink.compress.builder import BuildError, make_plan
from moeshrink.compress.calibrated_bits import OutputErrorMoE
from moeshrink.core import expert_formats
from moeshrink.formats import twx


def output_error_through_transformers(model, ids, code_bits):
    """sum over an expert's routed tokens of |applied gate x (f with decoded codes - f)|^2 / |residual|^2,
    per code width, the residual being what the layer's post-attention norm reads."""
    errors, residuals = {}, {}

    def keep_residual(index):
        def record(module, args):
            residuals[index] = args[0].reshape(-1, args[0].shape[-1]).double().square().sum(dim=1)
        return record

    def roundtrip(weight, bits):
        return twx.decode(*twx.encode(weight.detach().float(), bits), torch.float32)

    def hook(index):
        def record(module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            _, weights, indices = module.gate(x)
            experts = module.experts
            table = torch.zeros(experts.num_experts, len(code_bits), dtype=torch.float64)
            for e in range(experts.num_experts):
                tokens, slot = torch.where(indices == e)
                if not len(tokens):
                    continue
                gate_up, down = experts.gate_up_proj[e].float(), experts.down_proj[e].float()
                half = gate_up.shape[0] // 2

                def mlp(gate_w, up_w, down_w):
                    h = x[tokens]
                    return (F.silu(h @ gate_w.T) * (h @ up_w.T)) @ down_w.T

                exact = mlp(gate_up[:half], gate_up[half:], down)
                for column, bits in enumerate(code_bits):
                    coded = mlp(roundtrip(gate_up[:half], bits), roundtrip(gate_up[half:], bits), roundtrip(down, bits))
                    squared = ((coded - exact) * weights[tokens, slot, None]).double().square().sum(dim=1)
                    table[e, column] = float((squared / residuals[index][tokens]).sum())
            errors[index] = table
        return record

    through_moe_blocks(model, ids, hook, keep_residual)
    return errors


def through_moe_blocks(model, ids, mlp_hook, norm_hook=None) -> None:
    """The model's forward with `mlp_hook(layer index)` before every MoE block (and `norm_hook(layer
    index)` before the norm that feeds it)."""
    for index, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "experts"):
            if norm_hook:
                layer.post_attention_layernorm.register_forward_pre_hook(norm_hook(index))
            layer.mlp.register_forward_pre_hook(mlp_hook(index))
    with torch.no_grad():
        model.model(input_ids=ids)


def tiny_deepseek_v3(tmp_path):
    """(folder, token ids [2, 16], the model through transformers) of test_prune's tiny DeepSeek-V3."""
    deepseek_v3(tmp_path)
    folder = tmp_path / "dsv3"
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(3))
    return folder, ids, AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="sdpa").eval()


def test_output_error_per_expert_and_code_width_follows_its_definition(tmp_path):
    folder, ids, model = tiny_deepseek_v3(tmp_path)
    fmt = expert_formats.get("twx2.5", "test")
    got = reap.layer_pass(folder, ids, partial(OutputErrorMoE, fmt=fmt))["layers"]
    expected = output_error_through_transformers(model, ids, fmt.code_bits)
    assert set(got) == set(expected)
    for layer, table in expected.items():
        measured = torch.tensor(got[layer]["squared_error"], dtype=torch.float64)
        assert torch.allclose(measured, table, rtol=2e-3, atol=1e-9), (measured - table).abs().max()
        reached = torch.tensor(got[layer]["tokens"]) > 0
        assert (measured[reached, 0] > measured[reached, 1]).all(), "2-bit codes must lose more than 3-bit ones"
        assert (measured[~reached] == 0).all()


def test_a_calibrated_plan_widens_the_experts_whose_output_error_falls_most(published, small_data):
    folder, manifest = published
    calibration = {"file": None, "sequences": 2, "seq_len": 32}
    spec = {"label": "c", "quantize": {"format": "twx2.5", "calibration": calibration}}
    plan = make_plan("c", spec, folder, manifest, None, small_data / "corpus.jsonl")
    sensitivity = plan["quantize"]["sensitivity"]
    assert sensitivity["rule"].startswith("output error on calibration text")
    assert sensitivity["calibration"]["sha256"] and sensitivity["calibration"]["sequences"] == 2
    gains = {(layer, e): row[0] - row[1] for layer, measured in sensitivity["output_squared_error"].items()
             for e, row in enumerate(measured["squared_error"])}
    widened = {(layer, int(e)) for layer, experts in plan["quantize"]["expert_bits"].items()
               for e, bits in experts.items() if bits == 3}
    ranked = sorted(gains, key=lambda key: (-gains[key], int(key[0]), key[1]))
    assert widened == {(layer, e) for layer, e in ranked[:len(widened)]}
    assert 0 < len(widened) < len(gains)
    free = make_plan("f", {"label": "f", "quantize": {"format": "twx2.5"}}, folder, manifest)
    assert free["quantize"]["sensitivity"]["rule"].startswith("squared norm")


def test_calibration_for_a_format_of_one_code_width_is_refused_by_name(published, small_data):
    folder, manifest = published
    spec = {"label": "c", "quantize": {"format": "twx3", "calibration": {"file": None, "sequences": 2, "seq_len": 32}}}
    with pytest.raises(BuildError, match=r"builds\.c\.quantize\.calibration: twx3 has one code width and an encoder "
                                          "that weighs no error"):
        make_plan("c", spec, folder, manifest, None, small_data / "corpus.jsonl")
