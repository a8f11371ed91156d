"""Publishing in MXFP4 and the bf16 twin: the twin is the exact decode of the published files."""
import json

import pytest
import torch
from conftest import TINY_MODEL
from safetensors import safe_open

from moeshrink.core.checkpoint import CheckpointError, index_of
from moeshrink.formats import mxfp4
from moeshrink.organism.publish import ROUTED_EXPERT_WEIGHT
from moeshrink.stages import bf16_twin, upstream


@pytest.fixture(scope="module")
def published(tiny_trained, small_tokenizer_dir, default_config, tmp_path_factory):
    out = tmp_path_factory.mktemp("upstream")
    cfg = {"source": "organism", "organism": {"model": TINY_MODEL,
                                              "publish": {"shards": 4}}}
    manifest = upstream(cfg, out, tiny_trained, small_tokenizer_dir)
    return out, manifest


def tensors_of(folder) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(set(index_of(folder)["weight_map"].values())):
        with safe_open(str(folder / shard), "pt") as f:
            for name in f.keys():
                assert name not in out
                out[name] = f.get_tensor(name)
    return out


def test_published_layout(published):
    folder, manifest = published
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    assert config["topk_method"] == "noaux_tc" and config["scoring_func"] == "sigmoid"
    assert config["kv_lora_rank"] + config["qk_rope_head_dim"] == 576
    assert manifest["shard_count"] >= 4
    assert {"tokenizer.json", "tokenizer_config.json", "config.json", "model.safetensors.index.json"} <= \
        {f["file"] for f in manifest["files"]}
    assert manifest["revision"].startswith("organism-")
    assert manifest["provenance"]["config"]["source"] == "organism"
    # servers end a chat turn at <|im_end|> as well as at <|endoftext|>
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")]
    tensors = tensors_of(folder)
    experts = [n for n in tensors if ROUTED_EXPERT_WEIGHT.search(n)]
    assert len(experts) == 3 * 16 * (config["num_hidden_layers"] - config["first_k_dense_replace"])
    for name in experts:
        assert tensors[name].dtype == torch.uint8 and tensors[name + "_scale"].dtype == torch.uint8
        assert tensors[name + "_scale"].shape[-1] * 32 == tensors[name].shape[-1] * 2
    others = [n for n in tensors if not ROUTED_EXPERT_WEIGHT.search(n) and not n.endswith("_scale")]
    assert all(tensors[n].dtype == torch.bfloat16 for n in others if not n.endswith("e_score_correction_bias"))
    assert any(n.endswith("shared_experts.gate_proj.weight") for n in others)
    assert any(n.startswith("model.layers.0.mlp.gate_proj") for n in others)  # the dense first layer


def test_experts_are_the_mxfp4_encoding_of_the_trained_weights(published, tiny_trained):
    folder, _ = published
    tensors = tensors_of(folder)
    with safe_open(str(tiny_trained / "model.safetensors"), "pt") as f:
        for name in f.keys():
            if ROUTED_EXPERT_WEIGHT.search(name):
                packed, scales = mxfp4.encode(f.get_tensor(name))
                assert torch.equal(packed, tensors[name]) and torch.equal(scales, tensors[name + "_scale"])


def test_twin_decodes_the_published_files_bit_for_bit(published, tmp_path):
    folder, _ = published
    manifest = bf16_twin(folder, tmp_path)
    published_tensors = tensors_of(folder)
    twin = tensors_of(tmp_path)
    assert set(twin) == {n for n in published_tensors if not n.endswith("_scale") or
                         n[: -len("_scale")] not in published_tensors}
    for name, tensor in twin.items():
        if name + "_scale" in published_tensors:
            expected = mxfp4.decode(published_tensors[name], published_tensors[name + "_scale"], torch.bfloat16)
            assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected)
        else:
            assert torch.equal(tensor, published_tensors[name])
    config = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in config
    assert manifest["shard_count"] == len(set(index_of(folder)["weight_map"].values()))


def test_twin_computes_what_the_fake_quantized_model_computes(published, tiny_trained, tmp_path):
    """The published model is the trained model with its experts through MXFP4, nothing else."""
    from transformers import AutoModelForCausalLM

    from moeshrink.organism.train import enable_qat

    folder, _ = published
    bf16_twin(folder, tmp_path)
    twin = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    trained = AutoModelForCausalLM.from_pretrained(str(tiny_trained), dtype=torch.float32).eval()
    # the twin's non-expert weights are bf16: compare against the trained model rounded the same way
    with torch.no_grad():
        for name, param in trained.named_parameters():
            if "experts.gate_up_proj" not in name and "experts.down_proj" not in name and param.dim() > 1:
                param.copy_(param.to(torch.bfloat16).float())
    enable_qat(trained)
    ids = torch.randint(0, 500, (2, 24))
    with torch.no_grad():
        assert torch.allclose(twin(ids).logits, trained(ids).logits, atol=1e-4, rtol=1e-4)


def test_twin_refuses_an_unquantized_checkpoint(tmp_path, tiny_trained):
    with pytest.raises(CheckpointError, match="quant_method is None"):
        bf16_twin(tiny_trained, tmp_path)
