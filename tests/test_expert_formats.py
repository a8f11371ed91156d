"""The expert-format registry is the one place a format is known: a toy 4-bit format, registered by
its own module (tests/toy_format.py) and edited in nowhere else, is checked by the config, built,
decoded into the bf16 twin and sized by the planner like TWX."""
import copy
import json

import pytest
import torch
from conftest import import_plugin
from test_quantize import all_tensors, make_build

from moeshrink.core import expert_formats
from moeshrink.core.config import ConfigError, validate
from moeshrink.formats import mxfp4
from moeshrink.serve import memory, planner
from moeshrink.upstream.twin import make_twin


@pytest.fixture
def toy(monkeypatch):
    return import_plugin(monkeypatch, expert_formats.REGISTRY, "toy_format")


def test_the_builtin_formats_and_their_budgets():
    known = expert_formats.formats()
    assert list(known)[:2] == ["twx3", "twx2.5"]
    assert known["twx3"].bits_per_weight(3) == 3.25 and known["twx2.5"].default_budget == 2.75
    assert known["twx2.5"].budget_problem(2.0, "k").startswith("k: twx2.5 stores at least 2.25 bits per weight")
    assert known["twx2.5"].budget_problem(2.5, "k") is None
    with pytest.raises(expert_formats.FormatError, match=r"^b: 'nf4' is unknown; known: twx3, twx2.5, twx3-v2, twx2.5-v2$"):
        expert_formats.get("nf4", "b")


def test_a_toy_format_needs_only_its_own_module(toy, published, default_config, tmp_path):
    config = copy.deepcopy(default_config)
    config["builds"]["twx3"]["quantize"] = {"format": "uniform4"}
    validate(config)
    config["builds"]["twx3"]["quantize"] = {"format": "uniform4", "max_bits_per_weight": 3.0}
    with pytest.raises(ConfigError, match="uniform4 stores at least 4.25 bits per weight, more than 3"):
        validate(config)

    plan, manifest = make_build(published, {"label": "x", "quantize": {"format": "uniform4"}}, tmp_path / "b")
    assert manifest["routed_expert_bits_per_weight"] == pytest.approx(4.25)
    assert json.loads((tmp_path / "b/config.json").read_text())["quantization_config"]["quant_method"] == "uniform4"
    source, built = all_tensors(published[0]), all_tensors(tmp_path / "b")
    encoded = [name for name in built if name.endswith(".u4_codes")]
    assert encoded and not any(name.endswith(".twx_codes") for name in built)
    for name in encoded:
        base = name[: -len(".u4_codes")]
        exact = mxfp4.decode(source[base + ".weight"], source[base + ".weight_scale"], torch.float32)
        decoded = toy.decode(built[name], built[base + ".u4_scales"], torch.float32)
        assert float((decoded - exact).pow(2).sum() / exact.pow(2).sum()) < 0.02, name

    make_twin(tmp_path / "b", tmp_path / "twin")
    twin = all_tensors(tmp_path / "twin")
    for name in encoded:
        base = name[: -len(".u4_codes")]
        assert torch.equal(twin[base + ".weight"], toy.decode(built[name], built[base + ".u4_scales"]))
    assert not any(name.endswith((".u4_codes", ".u4_scales")) for name in twin)

    upstream_config = json.loads((published[0] / "config.json").read_text())
    modelled, _ = planner.modelled_build(memory.checkpoint_tensors(published[0]), upstream_config,
                                         {"quantize": {"format": "uniform4"}}, "b")
    def described(tensors):
        return sorted((t.name, t.dtype, t.shape) for t in tensors)

    assert described(modelled) == described(memory.checkpoint_tensors(tmp_path / "b"))
