"""Writing safetensors shards: byte-deterministic, and able to copy a tensor's bytes straight from
another shard without loading it, hashing what it writes as it goes.

The file is laid out as safetensors specifies: an 8-byte little-endian header length, the JSON
header (padded with spaces to a multiple of 8), then each tensor's bytes, contiguous, in header order.
Tensors are written in name order and `__metadata__` keys sorted, so the same tensors always give
the same bytes.
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from moeshrink.core.ioutil import out_of_room

DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


@dataclass(frozen=True)
class StoredTensor:
    """A tensor's bytes as they lie in an existing shard, to be copied unchanged."""
    path: Path
    offset: int
    length: int
    dtype: str
    shape: tuple[int, ...]


def data_start(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def stored_tensor(path: Path, header: dict, name: str, start: int | None = None) -> StoredTensor:
    entry = header[name]
    begin, end = entry["data_offsets"]
    return StoredTensor(path, (data_start(path) if start is None else start) + begin, end - begin,
                        entry["dtype"], tuple(entry["shape"]))


def _describe(value: torch.Tensor | StoredTensor) -> tuple[str, list[int], int]:
    if isinstance(value, StoredTensor):
        return value.dtype, list(value.shape), value.length
    if value.dtype not in DTYPES:
        raise TypeError(f"dtype {value.dtype} cannot be stored in safetensors")
    return DTYPES[value.dtype], list(value.shape), value.numel() * value.element_size()


class _Sink:
    """Writes chunks to a file descriptor while a second thread hashes them (sha256), so a shard's
    digest costs no second read of it."""

    def __init__(self, fd: int):
        self.fd = fd
        self.digest = hashlib.sha256()
        self.chunks: queue.Queue = queue.Queue(maxsize=8)
        self.hasher = threading.Thread(target=self._hash, daemon=True)
        self.hasher.start()

    def _hash(self) -> None:
        while (chunk := self.chunks.get()) is not None:
            self.digest.update(chunk)

    def write(self, data: memoryview) -> None:
        self.chunks.put(data)
        while data:
            written = os.write(self.fd, data)
            data = data[written:]

    def close(self) -> str:
        self.chunks.put(None)
        self.hasher.join()
        return self.digest.hexdigest()


def _copy_range(source: StoredTensor, sink: _Sink, chunk_bytes: int = 16 << 20) -> None:
    with open(source.path, "rb") as f:
        offset, remaining = source.offset, source.length
        while remaining:
            chunk = os.pread(f.fileno(), min(remaining, chunk_bytes), offset)
            if not chunk:
                raise OSError(f"{source.path}: ends before byte {offset + remaining}")
            sink.write(memoryview(chunk))
            offset += len(chunk)
            remaining -= len(chunk)


def save_shard(tensors: dict[str, torch.Tensor | StoredTensor], path: Path | str,
               metadata: dict[str, str] | None = None) -> str:
    """Write the shard; returns its sha256."""
    names = sorted(tensors)
    header: dict = {"__metadata__": dict(sorted((metadata or {}).items()))} if metadata else {}
    offset = 0
    for name in names:
        dtype, shape, size = _describe(tensors[name])
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sink = _Sink(fd)
    try:
        sink.write(memoryview(len(raw).to_bytes(8, "little") + raw))
        for name in names:
            value = tensors[name]
            if isinstance(value, StoredTensor):
                _copy_range(value, sink)
            elif value.numel():
                flat = value.detach().contiguous().reshape(-1).view(torch.uint8)
                sink.write(memoryview(flat.numpy()))  # type: ignore[arg-type]  # numpy's stubs lack the buffer protocol
    except OSError as error:
        unwritable = out_of_room(error, path)
        if unwritable:
            raise unwritable from error
        raise
    finally:
        digest = sink.close()
        os.close(fd)
    return digest
