"""Upstream routed-expert weights read as exact float32 values, whatever their encoding (unquantized or
MXFP4); the compress stage and REAP's calibration pass both read them through here."""
from __future__ import annotations

import torch

from moeshrink.core.checkpoint import SCALE_COMPANION
from moeshrink.core.errors import MoeshrinkError
from moeshrink.formats import mxfp4


class SourceError(MoeshrinkError, ValueError):
    pass


def source_format(config: dict) -> str:
    method = (config.get("quantization_config") or {}).get("quant_method")
    if method in (None, "mxfp4"):
        return method or "float"
    raise SourceError(f"config.json quantization_config.quant_method {method!r}: routed experts in this encoding "
                      "cannot be decoded exactly yet (supported: unquantized, mxfp4)")


def read_expert_weight(handle, name: str, fmt: str) -> torch.Tensor:
    """An upstream routed-expert weight [rows, K] as exact float32 values."""
    tensor = handle.get_tensor(name)
    if fmt == "mxfp4" and tensor.dtype == torch.uint8:
        return mxfp4.decode(tensor, handle.get_tensor(name + SCALE_COMPANION), torch.float32, name=name)
    if not tensor.is_floating_point():
        raise SourceError(f"{name}: a {tensor.dtype} expert weight in a checkpoint without a known quantization")
    return tensor.to(torch.float32)
