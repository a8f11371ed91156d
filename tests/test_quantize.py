"""TWX builds: bits per weight within budget, experts re-encoded from their exact MXFP4 values,
everything else byte for byte."""
import json

import pytest
import torch
from conftest import TINY_MODEL
from safetensors import safe_open

from moeshrink.compress.builder import BuildError, allocate_bits, gather, make_plan, rewrite_shard
from moeshrink.core import expert_formats
from moeshrink.core.checkpoint import index_of
from moeshrink.formats import mxfp4, twx


def all_tensors(folder):
    tensors = {}
    for shard in sorted(set(index_of(folder)["weight_map"].values())):
        with safe_open(str(folder / shard), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors


def make_build(published, build_cfg, out):
    folder, manifest = published
    plan = make_plan("b", build_cfg, folder, manifest)
    out.mkdir()
    shards = [s["file"] for s in manifest["shards"]]
    for shard in shards:
        rewrite_shard(folder, manifest, shard, plan, out / shard)
    return plan, gather(out, folder, manifest, plan, shards)


@pytest.mark.parametrize("fmt,budget,version", [("twx3", 3.25, 1), ("twx2.5", 2.75, 1), ("twx3-v2", 3.25, 2),
                                                ("twx2.5-v2", 2.75, 2)])
def test_twx_build(published, tmp_path, fmt, budget, version):
    plan, manifest = make_build(published, {"label": "x", "quantize": {"format": fmt}}, tmp_path / "b")
    assert manifest["routed_expert_bits_per_weight"] <= budget
    assert manifest["routed_expert_bits_per_weight"] > budget - 0.5
    source, built = all_tensors(published[0]), all_tensors(tmp_path / "b")
    entry = expert_formats.get(fmt, "test")
    codec, codes_suffix, scales_suffix = entry.codec_module(), "." + entry.codes_suffix, "." + entry.scales_suffix
    widths = set()
    for name, tensor in built.items():
        if name.endswith(codes_suffix):
            base = name[: -len(codes_suffix)]
            exact = mxfp4.decode(source[base + ".weight"], source[base + ".weight_scale"], torch.float32)
            bits = twx.code_bits(tensor, built[base + scales_suffix])
            widths.add(bits)
            codes, scales = codec.encode(exact, bits)
            assert torch.equal(tensor, codes) and torch.equal(built[base + scales_suffix], scales)
            layer, expert = int(base.split(".")[2]), base.split(".")[5]
            assert plan["quantize"]["expert_bits"][str(layer)][expert] == bits
        elif not name.endswith(scales_suffix):
            assert torch.equal(tensor, source[name]), name  # not a routed expert: untouched
    assert widths == ({3} if fmt.startswith("twx3") else {2, 3})
    config = json.loads((tmp_path / "b/config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "twx"
    assert config["quantization_config"]["format"] == fmt
    assert config["quantization_config"]["format_version"] == version
    assert manifest["bytes_by_class"]["routed_experts"] < manifest["total_bytes"]


def test_prune_then_quantize(published, tmp_path):
    plan, manifest = make_build(published, {"label": "x", "prune": {"method": "router_sum", "keep_fraction": 0.5},
                                            "quantize": {"format": "twx3"}}, tmp_path / "b")
    assert manifest["num_experts"] == TINY_MODEL["n_routed_experts"] // 2
    assert manifest["routed_expert_bits_per_weight"] == pytest.approx(3.25)
    assert set(plan["quantize"]["expert_bits"][str(plan["moe_layers"][0])]) == {str(e) for e in range(8)}


def test_allocation_keeps_the_budget_and_widens_the_experts_that_gain_most():
    gains = {1: {0: 5.0, 1: 1.0, 2: 3.0, 3: 0.5}, 2: {0: 4.0, 1: 0.1, 2: 0.2, 3: 6.0}}
    bits = allocate_bits(gains, max_bits=2.75, fmt=expert_formats.get("twx2.5", "test"))
    flat = [b for layer in bits.values() for b in layer.values()]
    assert sum(twx.bits_per_weight(b) for b in flat) / len(flat) <= 2.75
    assert {(layer, e) for layer in bits for e in bits[layer] if bits[layer][e] == 3} == {(2, 3), (1, 0), (2, 0), (1, 2)}


def test_unknown_format_fails_before_any_work(published):
    folder, manifest = published
    with pytest.raises(BuildError,
                       match=r"builds.b.quantize.format: 'twx4' is unknown; known: twx3, twx2.5, twx3-v2, twx2.5-v2"):
        make_plan("b", {"label": "x", "quantize": {"format": "twx4"}}, folder, manifest)
