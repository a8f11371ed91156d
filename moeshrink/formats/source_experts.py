"""Upstream routed-expert weights read as exact float32 values, whatever their encoding (unquantized or
MXFP4); the compress stage and REAP's calibration pass both read them through here."""
from __future__ import annotations

from pathlib import Path

import torch

from moeshrink.core.arch import adapter_for
from moeshrink.core.checkpoint import SCALE_COMPANION, check_index
from moeshrink.core.errors import MoeshrinkError
from moeshrink.formats import mxfp4


class SourceError(MoeshrinkError, ValueError):
    pass


def _quant_method(config: dict) -> str | None:
    return (config.get("quantization_config") or {}).get("quant_method")


def source_format(config: dict) -> str:
    method = _quant_method(config)
    if is_source_format(config):
        return method or "float"
    raise SourceError(f"config.json quantization_config.quant_method {method!r}: routed experts in this encoding "
                      "cannot be decoded exactly yet (supported: unquantized, mxfp4)")


def is_source_format(config: dict) -> bool:
    """Whether the checkpoint's experts are in an upstream encoding (unquantized or MXFP4)."""
    return _quant_method(config) in (None, "mxfp4")


FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors' names


def check_expert_headers(folder: Path, config: dict) -> None:
    """Every per-expert weight of an upstream checkpoint, from its shard's header, before any tensor is read:
    stored in the checkpoint's encoding (MXFP4 uint8 codes with their scales, or a float dtype) and of the
    shape config.json gives the projection. A wrong one is named with its shard."""
    adapter, fmt = adapter_for(config), source_format(config)
    for shard, header in check_index(folder).items():
        for name, entry in sorted(header.items()):
            ref = adapter.parse_expert(name)
            if ref is None or ref.suffix != "weight":
                continue
            rows, columns = adapter.expert_weight_shape(config, ref.projection)
            if fmt == "mxfp4" and entry["dtype"] == "U8":
                expected = [(name, [rows, columns // 2]), (name + SCALE_COMPANION, [rows, columns // mxfp4.BLOCK])]
            elif entry["dtype"] in FLOAT_DTYPES:
                expected = [(name, [rows, columns])]
            else:
                encodings = "MXFP4 codes (U8) or " if fmt == "mxfp4" else ""
                raise SourceError(f"{folder / shard}: {name} is stored as {entry['dtype']}; a routed expert weight "
                                  f"of this checkpoint is {encodings}one of {', '.join(FLOAT_DTYPES)}")
            for tensor, shape in expected:
                if tensor not in header:
                    raise SourceError(f"{folder / shard}: {tensor}, the scales of MXFP4 expert weight {name}, is "
                                      "not in it")
                if list(header[tensor]["shape"]) != shape:
                    raise SourceError(f"{folder / shard}: {tensor} has shape {header[tensor]['shape']}; config.json "
                                      f"(hidden_size, {adapter.expert_intermediate_key}) gives {ref.projection} {shape}")


def read_expert_weight(handle, name: str, fmt: str, shard: Path | None = None) -> torch.Tensor:
    """An upstream routed-expert weight [rows, K] as exact float32 values; a non-finite value is refused, naming
    the tensor (and its shard, where given)."""
    label = f"{shard}: {name}" if shard else name
    tensor = handle.get_tensor(name)
    if fmt == "mxfp4" and tensor.dtype == torch.uint8:
        return mxfp4.decode(tensor, handle.get_tensor(name + SCALE_COMPANION), torch.float32, name=label)
    if not tensor.is_floating_point():
        raise SourceError(f"{label}: a {tensor.dtype} expert weight in a checkpoint without a known quantization")
    return require_finite(tensor.to(torch.float32), label)


def require_finite(tensor: torch.Tensor, name: str) -> torch.Tensor:
    bad = int((~torch.isfinite(tensor)).sum())
    if bad:
        raise SourceError(f"{name}: {bad} of {tensor.numel()} values are NaN or infinite")
    return tensor
