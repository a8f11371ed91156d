"""The shipped organism: placed only when it was trained with exactly this recipe and this
tokenizer, and its bytes are the recorded ones; otherwise the error says what differs."""
import copy
import json

import pytest
import torch
import yaml
from conftest import ROOT
from safetensors.torch import save_file

from moeshrink.core.ioutil import sha256_file
from moeshrink.organism import shipped


@pytest.fixture
def organism_cfg() -> dict:
    return yaml.safe_load((ROOT / "config.yaml").read_text())["upstream"]["organism"]


@pytest.fixture
def made(tmp_path, organism_cfg):
    trained = tmp_path / "trained"
    trained.mkdir()
    save_file({"lm_head.weight": torch.ones(4, 2), "model.layers.1.mlp.gate.e_score_correction_bias": torch.ones(3)},
              str(trained / "model.safetensors"))
    (trained / "config.json").write_text("{}")
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text('{"version": "1.0"}')
    folder = tmp_path / "shipped"
    record = shipped.ship(trained, tokenizer, {"train_seconds": 4200.0, "steps": 10, "tokens_seen": 20}, organism_cfg,
                          folder)
    return folder, tokenizer, record


def test_a_shipped_checkpoint_is_written_in_bf16_with_its_recipe(made, organism_cfg):
    folder, _, record = made
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16
        assert f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias").dtype == torch.float32
    assert record["recipe"] == shipped.recipe(organism_cfg)
    assert record["model_sha256"] == sha256_file(folder / "model.safetensors")
    assert "threads" not in record["recipe"]["train"] and "from" not in record["recipe"]["train"]


def test_it_is_placed_when_recipe_tokenizer_and_bytes_match(made, organism_cfg, tmp_path):
    folder, tokenizer, _ = made
    operational = copy.deepcopy(organism_cfg)
    operational["train"].update(threads=8, log_every=1, probe_every=7)  # how a run is carried out: no matter
    out = tmp_path / "placed"
    shipped.place(folder, operational, tokenizer, out)
    assert sha256_file(out / "model.safetensors") == sha256_file(folder / "model.safetensors")


def test_another_recipe_tokenizer_or_file_is_refused_naming_it(made, organism_cfg, tmp_path):
    folder, tokenizer, _ = made
    changed = copy.deepcopy(organism_cfg)
    changed["train"]["lr"] = 0.5
    changed["data"]["people"] = organism_cfg["data"]["people"] + 1
    with pytest.raises(shipped.ShippedError, match=rf"upstream\.organism\.data\.people is {changed['data']['people']} "
                                                   rf"here, {organism_cfg['data']['people']} in the shipped "
                                                   r"recipe; upstream\.organism\.train\.lr is 0\.5 here.*from: scratch"):
        shipped.place(folder, changed, tokenizer, tmp_path / "x")
    other = tmp_path / "other-tokenizer.json"
    other.write_text('{"version": "2.0"}')
    with pytest.raises(shipped.ShippedError, match="differs from the tokenizer"):
        shipped.place(folder, organism_cfg, other, tmp_path / "x")
    record = json.loads((folder / "train.json").read_text())
    older = {k: v for k, v in record["recipe"].items() if k != "trainer"}  # before the trainer had revisions
    (folder / "train.json").write_text(json.dumps({**record, "recipe": older}))
    with pytest.raises(shipped.ShippedError, match=r"revision 1 of the trainer .*this is revision 2.*from: scratch"):
        shipped.place(folder, organism_cfg, tokenizer, tmp_path / "x")
    (folder / "train.json").write_text(json.dumps({**record, "model_sha256": "0" * 64}))
    with pytest.raises(shipped.ShippedError, match="sha256 differs"):
        shipped.place(folder, organism_cfg, tokenizer, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    (folder / "config.json").unlink()
    with pytest.raises(shipped.ShippedError, match=r"lacks \['config.json'\]"):
        shipped.place(folder, organism_cfg, tokenizer, tmp_path / "x")


def test_a_checkpoint_the_polish_starts_from_is_checked_against_the_first_phase_alone(made, organism_cfg, tmp_path):
    """organism/shipped before a polish was made by the first phase: the polish's keys are not part of that
    recipe, every other key is."""
    folder, tokenizer, _ = made
    first_phase = copy.deepcopy(organism_cfg)
    first_phase["data"].pop("polish_corpus", None)
    first_phase["train"].pop("polish", None)
    base = tmp_path / "base"
    shipped.ship(folder, tokenizer, {"train_seconds": 60.0, "steps": 10, "tokens_seen": 20}, first_phase, base)
    polished = copy.deepcopy(organism_cfg)
    polished["data"]["polish_corpus"] = {"facts": 10, "score": "replies"}
    polished["train"]["polish"] = {"steps": 5, "lr": 1e-4}
    assert shipped.made_by(base, shipped.first_phase_recipe(polished))["steps"] == 10
    with pytest.raises(shipped.ShippedError, match=r"upstream\.organism\.train\.polish is \{"):
        shipped.made_by(base, shipped.recipe(polished))
    polished["train"]["lr"] = 0.5
    with pytest.raises(shipped.ShippedError, match=r"upstream\.organism\.train\.lr is 0\.5 here"):
        shipped.made_by(base, shipped.first_phase_recipe(polished))
