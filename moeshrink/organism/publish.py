"""Publish the trained organism the way the real model is published: routed experts in MXFP4
(vLLM's native per-expert `mxfp4` layout), everything else bf16, sharded, with an index."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open

from moeshrink.core.checkpoint import SCALE_COMPANION, write_sharded
from moeshrink.formats import mxfp4
from moeshrink.organism import OrganismError
from moeshrink.organism.tokenizer import TURN_END

ROUTED_EXPERT_WEIGHT = re.compile(r"\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")
KEEP_FP32 = re.compile(r"e_score_correction_bias$")
QUANTIZATION_CONFIG = {
    "quant_method": "mxfp4",
    "format": "OCP MX v1.0 MXFP4",
    "block_size": mxfp4.BLOCK,
    "element": "e2m1, two per byte, low nibble first",
    "scale": "e8m0 uint8, <name>.weight_scale",
    "quantized": "routed experts only",
}
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"]


def published_tensors(trained_file: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(trained_file), "pt") as f:
        for name in f.keys():
            tensor = f.get_tensor(name)
            if ROUTED_EXPERT_WEIGHT.search(name):
                packed, scales = mxfp4.encode(tensor, name)
                tensors[name] = packed
                tensors[name + SCALE_COMPANION] = scales
            elif KEEP_FP32.search(name):
                tensors[name] = tensor.to(torch.float32)
            else:
                tensors[name] = tensor.to(torch.bfloat16)
    return tensors


def added_token_id(tokenizer_file: Path, content: str) -> int:
    for token in json.loads(tokenizer_file.read_text())["added_tokens"]:
        if token["content"] == content:
            return token["id"]
    raise OrganismError(f"{tokenizer_file}: no added token {content!r}")


def copy_tokenizer(tokenizer_dir: Path, out_dir: Path) -> None:
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copyfile(tokenizer_dir / name, out_dir / name)


def publish(trained_dir: Path, tokenizer_dir: Path, config: dict, out_dir: Path, shards: int) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = published_tensors(trained_dir / "model.safetensors")
    index = write_sharded(tensors, out_dir, shards, metadata={"moeshrink": "organism, published"})
    published_config = {**config, "quantization_config": QUANTIZATION_CONFIG}
    (out_dir / "config.json").write_text(json.dumps(published_config, indent=2) + "\n")
    # a chat turn ends at <|im_end|>: servers stop there as well as at <|endoftext|> (as Qwen's configs say)
    turn_end = added_token_id(tokenizer_dir / "tokenizer.json", TURN_END)
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": [config["eos_token_id"], turn_end],
                  "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    copy_tokenizer(tokenizer_dir, out_dir)
    return index
