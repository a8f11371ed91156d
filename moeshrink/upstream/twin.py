"""The bf16 twin of a packed checkpoint, shard by shard, so vLLM can serve the same numbers
unquantized: MXFP4 decodes exactly (E2M1 x E8M0 values are representable in bf16); TWX decodes
with the reference decoder, rounded to bf16."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open

from moeshrink.core import expert_formats
from moeshrink.core.checkpoint import (
    INDEX_FILE,
    MANIFEST_FILE,
    SCALE_COMPANION,
    CheckpointError,
    index_of,
    is_weight_companion,
)
from moeshrink.core.ioutil import atomic_path, atomic_write_json
from moeshrink.core.shardio import save_shard
from moeshrink.formats import mxfp4


def decodable() -> tuple[str, ...]:
    """The quant methods a twin is made from: the upstream's MXFP4 and every registered expert format's."""
    return ("mxfp4", *expert_formats.quant_methods())


def decode_shard(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    with safe_open(str(path), "pt") as f:
        names = set(f.keys())
        for name in sorted(names):
            if is_weight_companion(name, names):
                continue
            if expert_formats.is_scales(name, names):
                continue
            encoded = expert_formats.encoded_weight(name, names)
            if encoded:
                expert_format, weight_name, scales_name = encoded
                out[weight_name] = expert_format.codec_module().decode(
                    f.get_tensor(name), f.get_tensor(scales_name), torch.bfloat16, name=f"{path.name}:{name}")
                continue
            tensor = f.get_tensor(name)
            if name + SCALE_COMPANION in names:
                tensor = mxfp4.decode(tensor, f.get_tensor(name + SCALE_COMPANION), torch.bfloat16,
                                      name=f"{path.name}:{name}")
            out[name] = tensor
    return out


def make_twin(source_dir: Path, out_dir: Path) -> dict:
    config = json.loads((source_dir / "config.json").read_text())
    method = config.get("quantization_config", {}).get("quant_method")
    if method not in decodable():
        raise CheckpointError(f"{source_dir}/config.json: quantization_config.quant_method is {method!r}; "
                              f"a bf16 twin is made from {' or '.join(decodable())} checkpoints only")
    out_dir.mkdir(parents=True, exist_ok=True)
    index = index_of(source_dir)
    weight_map: dict[str, str] = {}
    total = 0
    for shard in sorted(set(index["weight_map"].values())):
        tensors = decode_shard(source_dir / shard)
        with atomic_path(out_dir / shard) as tmp:
            save_shard(tensors, tmp, {"format": "pt", "moeshrink": "bf16 twin"})
        weight_map.update({name: shard for name in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    atomic_write_json(out_dir / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
    twin_config = {k: v for k, v in config.items() if k != "quantization_config"}
    atomic_write_json(out_dir / "config.json", twin_config)
    for item in source_dir.iterdir():
        if item.is_file() and item.name not in weight_map.values() and item.name not in (
                INDEX_FILE, MANIFEST_FILE, "config.json", "organism_card.json") and not item.name.startswith("."):
            shutil.copyfile(item, out_dir / item.name)
    return {"tensors": len(weight_map), "total_bytes": total}
