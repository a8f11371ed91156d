"""TWX format version 2: 4 weights share one index into a fixed codebook of 4-vectors, one UE5M3
scale per 32 weights (as in version 1).

This module is the reference encoder and decoder; `kernels/FORMAT.md` describes the same layout for
other engines. For a weight matrix [rows, K] (K a multiple of 32) with `bits` 2 or 3:

- codes: uint8 [rows, K * bits / 8]; a row holds K / 4 indices of 4 * bits bits each (8 or 12),
  index g at bit offset 4 * bits * g of the row's bytes read as one little-endian bit string
  (the same bytes as version 1's packing of 4 consecutive `bits`-bit fields, low field first);
- scales: uint8 [rows, K / 32], UE5M3 as in version 1;
- weight[row, 4 g + d] = CODEBOOKS[bits][index(row, g), d] * scale(row, (4 g) // 32).

The codebooks (256 entries for 2 bits per weight, 4,096 for 3) are format constants, stored in
`twx_vq_codebooks.safetensors` beside this module: odd (entry k + N/2 is entry k negated, entry 0 is
zero), made by k-means on block-normalised MXFP4-published Gaussian weights, refined through this
encoder (`train_codebook`, run as `python -m moeshrink.formats.twx_vq --out FILE`; its float sums may
differ in the last bits on another CPU, so the committed file, not a rerun, is the constant). The
encoder tries 9 scales per block, 1/8 octave apart around the block's absolute maximum over the
codebook's, each with every 4-vector's nearest codeword, and keeps the scale with the least squared
error. MXFP4 blocks make few distinct 4-vectors
once divided by their power of two, so each (4-vector, scale row) pair is searched once: a workflow run
writes that table once per code width (`write_encoder_table`) and every job that encodes loads it
(`load_encoder_table`); a process without it searches each pair as it first comes (`_table_search`).
Given each input column's importance (`encode(importance=)`), the encoder weighs each weight's squared
error by it instead, trying per 4-vector the NEIGHBOURS of its plain nearest codeword (`_weighted_search`).
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from moeshrink.core.ioutil import atomic_path, sha256_file
from moeshrink.formats import mxfp4
from moeshrink.formats.twx import (
    _KEY_SHIFT,
    _KEY_VALID,
    GROUP,
    SCALE_EXP_BIAS,
    TWXFormatError,
    check_encodable,
    checked_pair,
    decode_scales,
    nearest_scale_bytes,
    non_finite,
)
from moeshrink.formats.twx_layout import VQ_CODEBOOKS as CODEBOOK_FILE

FORMAT_VERSION = 2
DIM = 4  # weights per index
ENTRIES = {2: 256, 3: 4096}
RECIPE = ("odd k-means (entry k + N/2 is entry k negated, entry 0 is zero) on 4-vectors of MXFP4-published "
          "Gaussian weights, each block divided by the UE5M3 scale")
SEARCH_STEPS = range(-4, 5)  # UE5M3 steps (1/8 octave) around the block's maximum over the codebook's
_STEPS = torch.tensor(list(SEARCH_STEPS))
_CHUNK_VECTORS = 2048
IMPORTANCE_FLOOR = 0.1  # of the mean importance, added to every column's (`error_weights`)
NEIGHBOURS = 64  # codewords the weighted search tries per 4-vector (`_weighted_search`)
# a table key: the 4 values' 12-bit keys at these bit offsets, and the 3-bit maximum row below them
_FIELD_SHIFTS = (39, 27, 15, 3)


@cache
def codebooks() -> dict[int, torch.Tensor]:
    """The format's codebooks: {bits: float32 [entries, 4]}."""
    tensors = load_file(str(CODEBOOK_FILE))
    books = {bits: tensors[f"codebook.{bits}"].to(torch.float32).contiguous() for bits in ENTRIES}
    for bits, book in books.items():
        if tuple(book.shape) != (ENTRIES[bits], DIM) or not torch.isfinite(book).all():
            raise TWXFormatError(f"{CODEBOOK_FILE}: codebook.{bits} must be {ENTRIES[bits]} finite 4-vectors, "
                                 f"got {tuple(book.shape)}")
        check_odd(book, f"{CODEBOOK_FILE}: codebook.{bits}")
    return books


def check_odd(book: torch.Tensor, where: str) -> None:
    """A version 2 codebook of N entries is odd: entry k + N/2 is entry k negated, and entry 0 is zero."""
    half = book.shape[0] // 2
    if not (torch.equal(book[half:], -book[:half]) and not book[0].any()):
        raise TWXFormatError(f"{where}: entry k + {half} must be entry k negated and entry 0 the zero vector")


@cache
def codebook_sha256() -> str:
    return sha256_file(CODEBOOK_FILE)


def _nearest(vectors: torch.Tensor, book: torch.Tensor, norms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per vector: the nearest codeword's index (the first on ties) and its squared distance."""
    index = torch.empty(vectors.shape[0], dtype=torch.int64)
    distance = torch.empty(vectors.shape[0], dtype=torch.float32)
    for start in range(0, vectors.shape[0], _CHUNK_VECTORS):
        part = vectors[start:start + _CHUNK_VECTORS]
        partial = torch.addmm(norms, part, book.T, alpha=-2)  # |c|^2 - 2 x.c
        value, where = partial.min(dim=1)
        index[start:start + part.shape[0]] = where
        distance[start:start + part.shape[0]] = (value + part.square().sum(dim=1)).clamp_(min=0)
    return index, distance


def _candidate_bytes(amax: torch.Tensor, book: torch.Tensor) -> torch.Tensor:
    """[n, steps] int64: the UE5M3 bytes the encoder tries for blocks with these absolute maxima."""
    base = nearest_scale_bytes(amax / book.abs().max()).to(torch.int64)
    return (base[:, None] + _STEPS[None, :]).clamp(0, 255)


def _block_sum(distance: torch.Tensor) -> torch.Tensor:
    """[n, 8] -> [n]: a block's squared distances added in index order, as F.embedding_bag adds them
    (the table search's sums), so that both searches compare the same float32 errors on any CPU."""
    total = distance[:, 0].clone()
    for column in range(1, distance.shape[1]):
        total += distance[:, column]
    return total


def _scale_search(blocks: torch.Tensor, candidates: torch.Tensor,
                  nearest: Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [n, 32], candidate scale bytes [n, steps], and for a step and the blocks' 4-vectors divided
    by that step's scales each vector's (codeword index, squared distance) -> (scale bytes int64 [n],
    indices int64 [n, 8]): per block, the candidate of least error (the first on ties)."""
    best_error = torch.full((blocks.shape[0],), float("inf"), dtype=torch.float32)
    best_bytes = candidates[:, 0].clone()
    best_index = torch.zeros(blocks.shape[0], GROUP // DIM, dtype=torch.int64)
    for step in range(candidates.shape[1]):
        candidate = candidates[:, step]
        scale = decode_scales(candidate)
        index, distance = nearest(step, (blocks / scale[:, None]).reshape(-1, DIM))
        error = _block_sum(distance.reshape(blocks.shape[0], -1)) * scale.square()
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_bytes = torch.where(better, candidate, best_bytes)
        best_index = torch.where(better[:, None], index.reshape(blocks.shape[0], -1), best_index)
    return best_bytes, best_index


def _search(blocks: torch.Tensor, book: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks float32 [n, 32] -> (scale bytes int64 [n], indices int64 [n, 8]): every block, any values."""
    norms = book.square().sum(dim=1)
    candidates = _candidate_bytes(blocks.abs().amax(dim=1), book)
    return _scale_search(blocks, candidates, lambda step, vectors: _nearest(vectors, book, norms))


@cache
def _relative_candidates(bits: int) -> np.ndarray:
    """[8, steps] int64: the candidate scale bytes of a block whose absolute maximum is 0.5 * (1 + m / 8)
    (row m). A block whose maximum is that times 2**e has these plus 8 e, as long as they stay within
    0..255: UE5M3 has no subnormals, so a byte 8 higher is exactly twice the scale."""
    maxima = torch.tensor([0.5 * (1 + m / 8) for m in range(8)], dtype=torch.float32)
    return _candidate_bytes(maxima, codebooks()[bits]).numpy()


def _relative_scales(bits: int) -> torch.Tensor:
    """[8, steps]: the scales of `_relative_candidates`."""
    return decode_scales(torch.from_numpy(_relative_candidates(bits)))


class _PairCache:
    """Each (4-vector key, maximum row) seen so far in this process at one code width, sorted, with
    its nearest codeword and squared distance at every candidate scale: [U, steps]."""

    def __init__(self, bits: int) -> None:
        self.bits = bits
        self.keys = np.zeros(0, np.int64)
        self.index = torch.zeros(0, len(SEARCH_STEPS), dtype=torch.int64)
        self.distance = torch.zeros(0, len(SEARCH_STEPS), dtype=torch.float32)

    def lookup(self, keys: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """keys: sorted, distinct -> their rows [len(keys), steps] of indices and distances."""
        where = np.searchsorted(self.keys, keys).clip(max=max(self.keys.size - 1, 0))
        missing = keys if self.keys.size == 0 else keys[self.keys[where] != keys]
        if missing.size:
            self._add(missing)
            where = np.searchsorted(self.keys, keys)
        rows = torch.from_numpy(where)
        return self.index[rows], self.distance[rows]

    def _add(self, keys: np.ndarray) -> None:
        book = codebooks()[self.bits]
        fields = np.stack([(keys >> shift) & ((1 << 12) - 1) for shift in _FIELD_SHIFTS], axis=1)
        vectors = torch.from_numpy((fields.astype(np.uint32) << _KEY_SHIFT).view(np.float32))
        scales = _relative_scales(self.bits)[torch.from_numpy(keys & 7)]  # [m, steps]
        norms = book.square().sum(dim=1)
        index = torch.empty(keys.size, scales.shape[1], dtype=torch.int64)
        distance = torch.empty(keys.size, scales.shape[1], dtype=torch.float32)
        for step in range(scales.shape[1]):
            index[:, step], distance[:, step] = _nearest(vectors / scales[:, step:step + 1], book, norms)
        order = np.argsort(np.concatenate([self.keys, keys]), kind="stable")
        self.keys = np.concatenate([self.keys, keys])[order]
        self.index = torch.cat([self.index, index])[torch.from_numpy(order)]
        self.distance = torch.cat([self.distance, distance])[torch.from_numpy(order)]


_PAIRS: dict[int, _PairCache] = {}


class _DenseTable:
    """A loaded table's MXFP4 pairs, addressed directly: the 12-bit keys of an MXFP4 block's values over
    its power of two are 16 (+-0, 1/16 .. 3/4), so a 4-vector is a 16-bit number and a pair (row, vector)
    one of 8 x 65,536 slots. Same rows as the table it was made from."""

    VALUES = mxfp4.CODE_VALUES.numpy() / 8
    VALUE_ID = np.full(1 << 12, 255, np.uint8)
    VALUE_ID[VALUES.view(np.uint32) >> _KEY_SHIFT] = np.arange(VALUES.size)
    SLOTS = 8 << 16

    def __init__(self, pairs: _PairCache) -> None:
        fields = np.stack([(pairs.keys >> shift) & ((1 << 12) - 1) for shift in _FIELD_SHIFTS], axis=1)
        ids = self.VALUE_ID[fields]
        on_slots = (ids != 255).all(axis=1)
        slot = self.slots(pairs.keys[on_slots] & 7, ids[on_slots])
        self.present = np.zeros(self.SLOTS, bool)
        self.present[slot] = True
        self.index = torch.zeros(self.SLOTS, len(SEARCH_STEPS), dtype=torch.int16)
        self.distance = torch.zeros(self.SLOTS, len(SEARCH_STEPS), dtype=torch.float32)
        self.index[torch.from_numpy(slot)] = pairs.index[torch.from_numpy(on_slots)].to(torch.int16)
        self.distance[torch.from_numpy(slot)] = pairs.distance[torch.from_numpy(on_slots)]

    @staticmethod
    def slots(row: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """row [...], value ids [..., 4] -> slot numbers [...]."""
        ids = ids.astype(np.int64)
        return (row << 16) | (ids[..., 0] << 12) | (ids[..., 1] << 8) | (ids[..., 2] << 4) | ids[..., 3]

    def lookup(self, row: np.ndarray, keys: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, Callable] | None:
        """row [r], keys [r, 32] -> (each 4-vector's row of the next [r, 8], distances [*, steps], the
        indices [r, 8] at given steps [r]), or None when a pair is off the table."""
        ids = np.take(self.VALUE_ID, keys)
        if (ids == 255).any():
            return None
        slot = self.slots(row[:, None], ids.reshape(row.size, GROUP // DIM, DIM))
        if not self.present[slot].all():
            return None
        where = torch.from_numpy(slot)
        flat_index, steps = self.index.reshape(-1), self.distance.shape[1]

        def indices_at(best: torch.Tensor) -> torch.Tensor:
            return flat_index.index_select(0, (where * steps + best[:, None]).reshape(-1)).reshape(where.shape).long()

        return where, self.distance, indices_at


_DENSE: dict[int, _DenseTable] = {}


# ------------------------------------------------------------------ the encoder's table, kept on disk
def _mxfp4_blocks() -> torch.Tensor:
    """One block per (largest magnitude, first 4-vector) an MXFP4 block can have, with its power-of-two
    scale 1: their first 4-vectors make every table key an MXFP4 block makes (a block at another scale
    makes the same keys, and a smaller maximum a subset of a larger one's keys at the same row)."""
    values = mxfp4.CODE_VALUES  # -0.0 is a code of its own
    blocks = []
    for maximum in mxfp4.E2M1_VALUES[mxfp4.E2M1_VALUES > 0]:
        allowed = values[values.abs() <= maximum]
        vectors = torch.cartesian_prod(*[allowed] * DIM)
        block = torch.zeros(vectors.shape[0], GROUP)
        block[:, :DIM], block[:, DIM] = vectors, maximum
        blocks.append(block)
    return torch.cat(blocks)


def write_encoder_table(bits: int, path: Path) -> dict:
    """Search every (4-vector, row) an MXFP4 block can make at this code width and write the table, so
    that an encoding process loads it (`load_encoder_table`) instead of searching as it goes; this
    process keeps it too. The table holds this CPU's float32 choices; a process that loads it makes
    them on any CPU."""
    from safetensors.torch import save_file

    from moeshrink.core.machine import cpu_isa, cpu_model

    _DENSE.pop(bits, None)
    _PAIRS[bits] = _PairCache(bits)
    blocks = _mxfp4_blocks()
    for start in range(0, blocks.shape[0], 1 << 14):
        part = blocks[start:start + (1 << 14)]
        _, _, decided = _table_search(part, part.abs().amax(dim=1), bits)
        if not bool(decided.all()):
            raise TWXFormatError(f"TWX v2 encoder table: an MXFP4 block fell off the {bits}-bit table")
    pairs = _PAIRS[bits]
    _DENSE[bits] = _DenseTable(pairs)
    metadata = {"format_version": str(FORMAT_VERSION), "bits": str(bits), "codebook_sha256": codebook_sha256(),
                "search_steps": ",".join(map(str, SEARCH_STEPS)), "cpu": cpu_model(), "isa": " ".join(cpu_isa())}
    with atomic_path(path) as tmp:
        save_file({"keys": torch.from_numpy(pairs.keys), "index": pairs.index.to(torch.int16),
                   "distance": pairs.distance}, str(tmp), metadata)
    return {"path": str(path), "pairs": int(pairs.keys.size), **metadata}


def forget_encoder_tables() -> None:
    """Empty this process's tables (a bench times a fresh process's encoder)."""
    _PAIRS.clear()
    _DENSE.clear()


def load_encoder_table(path: Path) -> int:
    """Make a table `write_encoder_table` wrote this process's (pairs it lacks are still searched as they
    come). Returns the code width; a table made for other codebooks or another search is refused."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        metadata = f.metadata() or {}
        expected = {"format_version": str(FORMAT_VERSION), "codebook_sha256": codebook_sha256(),
                    "search_steps": ",".join(map(str, SEARCH_STEPS))}
        wrong = [key for key, value in expected.items() if metadata.get(key) != value]
        if wrong or metadata.get("bits") not in {str(b) for b in ENTRIES}:
            raise TWXFormatError(f"{path}: not a TWX v2 encoder table for this encoder ({', '.join(wrong or ['bits'])} "
                                 "differ); delete it and let the workflow write it again")
        bits = int(metadata["bits"])
        keys, index, distance = (f.get_tensor(name) for name in ("keys", "index", "distance"))
    pairs = _PairCache(bits)
    pairs.keys, pairs.index, pairs.distance = keys.numpy(), index.to(torch.int64), distance
    steps = len(SEARCH_STEPS)
    if (keys.dim() != 1 or tuple(index.shape) != (keys.shape[0], steps) or tuple(distance.shape) != index.shape
            or not bool((keys[1:] > keys[:-1]).all()) or not bool(((index >= 0) & (index < ENTRIES[bits])).all())):
        raise TWXFormatError(f"{path}: a TWX v2 encoder table needs sorted distinct keys and [keys, {steps}] "
                             f"indices below {ENTRIES[bits]} and distances")
    _PAIRS[bits] = pairs
    _DENSE[bits] = _DenseTable(pairs)
    return bits


def _table_view(blocks: torch.Tensor, amax: torch.Tensor, bits: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[torch.Tensor, torch.Tensor, Callable] | None]:
    """The blocks (absolute maxima `amax`) whose values, divided by the power of two just above their
    maximum, have at most 3 mantissa bits (every MXFP4 block). Such a block's 4-vectors are 48-bit keys,
    its candidate scales that power of two times one of 8 rows (`_relative_candidates`), and dividing
    both by a power of two leaves every quotient's float32 rounding, and every error's up to that
    power's square, as it is: so each (vector, row) is searched once, at every scale, and the choices
    are `_search`'s. Returns (those blocks [r], every block's row [n] and byte offset [n], and for
    those blocks (bags [r, 8] of rows of distance [*, steps], distance, the indices [r, 8] at given
    steps [r]) or None when there are none)."""
    amax_mantissa, amax_octave = np.frexp(amax.numpy())
    row = ((amax_mantissa.astype(np.float32).view(np.uint32) >> _KEY_SHIFT) & 7).astype(np.int64)
    relative = _relative_candidates(bits)
    offset = 8 * amax_octave.astype(np.int64)
    raw = np.ldexp(blocks.numpy(), -amax_octave[:, None]).view(np.uint32)
    keys = np.right_shift(raw, _KEY_SHIFT)  # [n, 32], 12 bits each
    fits = (amax_mantissa > 0) & (relative[row, 0] + offset >= 0) & (relative[row, -1] + offset <= 255)
    fits &= ~(raw & ((1 << _KEY_SHIFT) - 1)).any(axis=1)
    rows = np.flatnonzero(fits)
    if rows.size < blocks.shape[0]:
        keys = keys[rows]
    found = _DENSE[bits].lookup(row[rows], keys) if bits in _DENSE and rows.size else None
    if found is None and rows.size:
        valid = np.take(_KEY_VALID, keys).all(axis=1)
        rows, keys = rows[valid], keys[valid]
        found = _sparse_lookup(bits, row[rows], keys) if rows.size else None
    return rows, row, offset, found


def _table_search(blocks: torch.Tensor, amax: torch.Tensor, bits: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_search` for the blocks on the table (`_table_view`). Returns (scale bytes [n], indices [n, 8],
    decided [n]); an undecided block (off the table) has garbage in the first two."""
    n = blocks.shape[0]
    rows, row, offset, found = _table_view(blocks, amax, bits)
    decided = torch.zeros(n, dtype=torch.bool)
    chosen_bytes = torch.zeros(n, dtype=torch.int64)
    index = torch.zeros(n, GROUP // DIM, dtype=torch.int64)
    if found is not None:
        bags, distance, indices_at = found
        rows_t, row_t = torch.from_numpy(rows), torch.from_numpy(row[rows])
        error = F.embedding_bag(bags, distance, mode="sum") * _relative_scales(bits)[row_t].square()
        best = error.argmin(dim=1)
        chosen_bytes[rows_t] = torch.from_numpy(_relative_candidates(bits))[row_t, best] + torch.from_numpy(offset[rows])
        index[rows_t] = indices_at(best)
        decided[rows_t] = True
    return chosen_bytes, index, decided


def _nearest_at_every_step(blocks: torch.Tensor, amax: torch.Tensor, bits: int) -> torch.Tensor:
    """[n, steps, 8]: each 4-vector's nearest codeword at each candidate scale (`_candidate_bytes`), from
    the table for the blocks on it."""
    book = codebooks()[bits]
    nearest = torch.empty(blocks.shape[0], len(SEARCH_STEPS), GROUP // DIM, dtype=torch.int64)
    rows, _, _, found = _table_view(blocks, amax, bits)
    on_table = torch.zeros(blocks.shape[0], dtype=torch.bool)
    if found is not None:
        rows_t, indices_at = torch.from_numpy(rows), found[2]
        for step in range(len(SEARCH_STEPS)):
            nearest[rows_t, step] = indices_at(torch.full((rows.size,), step, dtype=torch.int64))
        on_table[rows_t] = True
    rest = torch.nonzero(~on_table).squeeze(1)
    if rest.numel():
        candidates, norms = _candidate_bytes(amax[rest], book), book.square().sum(dim=1)
        for step in range(len(SEARCH_STEPS)):
            vectors = (blocks[rest] / decode_scales(candidates[:, step])[:, None]).reshape(-1, DIM)
            nearest[rest, step] = _nearest(vectors, book, norms)[0].reshape(rest.numel(), -1)
    return nearest


@cache
def _neighbours(bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each codeword's NEIGHBOURS, its nearest codewords in the book (itself first; those of entry k + N/2
    the negations of entry k's, so that the weighted search stays odd): their indices [entries,
    NEIGHBOURS], and their coordinates and squares coordinate-major [entries, 4 * NEIGHBOURS]."""
    book = codebooks()[bits]
    half = book.shape[0] // 2
    first = torch.cdist(book[:half].double(), book.double()).topk(NEIGHBOURS, dim=1, largest=False, sorted=True).indices
    indices = torch.cat([first, (first + half) % book.shape[0]])
    coordinates = book[indices].transpose(1, 2).reshape(book.shape[0], DIM * NEIGHBOURS).contiguous()
    return indices, coordinates, coordinates.square()


def _weighted_search(blocks: torch.Tensor, amax: torch.Tensor, weights: torch.Tensor, bits: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [n, 32], their weights' factors in the squared error [n, 32] -> (scale bytes [n], indices
    [n, 8]): at each candidate scale, each 4-vector takes the codeword of least weighted squared
    distance among the NEIGHBOURS of its (unweighted) nearest; the block keeps the scale of least
    weighted error."""
    neighbours, coordinates, squares = _neighbours(bits)
    nearest = _nearest_at_every_step(blocks, amax, bits)
    factors = weights.reshape(-1, DIM)

    def weighted_nearest(step: int, vectors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        nearest_now = nearest[:, step].reshape(-1)
        index = torch.empty(vectors.shape[0], dtype=torch.int64)
        distance = torch.empty(vectors.shape[0], dtype=torch.float32)
        for start in range(0, vectors.shape[0], _CHUNK_VECTORS):
            part = slice(start, start + _CHUNK_VECTORS)
            tried = nearest_now[part]
            coordinate = coordinates.index_select(0, tried).view(-1, DIM, NEIGHBOURS)
            square = squares.index_select(0, tried).view(-1, DIM, NEIGHBOURS)
            factor, cross = factors[part], 2 * factors[part] * vectors[part]
            # sum over d of w_d c_d^2 - 2 w_d x_d c_d: the weighted distance less sum of w_d x_d^2
            partial = square[:, 0] * factor[:, 0:1] - coordinate[:, 0] * cross[:, 0:1]
            for d in range(1, DIM):
                partial += square[:, d] * factor[:, d:d + 1] - coordinate[:, d] * cross[:, d:d + 1]
            value, where = partial.min(dim=1)
            index[part] = neighbours[tried, where]
            distance[part] = (value + (factor * vectors[part].square()).sum(dim=1)).clamp_(min=0)
        return index, distance

    return _scale_search(blocks, _candidate_bytes(amax, codebooks()[bits]), weighted_nearest)


def _sparse_lookup(bits: int, row: np.ndarray, keys: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, Callable]:
    """`_DenseTable.lookup` through this process's `_PairCache`, which searches the pairs it lacks."""
    vector_keys = keys.astype(np.int64).reshape(row.size, GROUP // DIM, DIM)
    pair_keys = row[:, None]
    for d, shift in enumerate(_FIELD_SHIFTS):
        pair_keys = pair_keys | (vector_keys[..., d] << shift)
    distinct, inverse_flat = np.unique(pair_keys.reshape(-1), return_inverse=True)
    nearest, distance = _PAIRS.setdefault(bits, _PairCache(bits)).lookup(distinct)
    inverse = torch.from_numpy(inverse_flat.reshape(row.size, GROUP // DIM))
    return inverse, distance, lambda best: nearest[inverse, best[:, None]]


def _pack(index: torch.Tensor, bits: int) -> torch.Tensor:
    """indices [rows, K/4] -> codes uint8 [rows, K*bits/8]: the indices' 4*bits-bit fields as one
    little-endian bit string per row (the same bytes as version 1's `pack_codes` of their bits)."""
    if bits == 2:
        return index.to(torch.uint8)
    pairs = index.unflatten(-1, (-1, 2))
    low, high = pairs[..., 0], pairs[..., 1]
    return torch.stack([low & 255, (low >> 8) | ((high & 15) << 4), high >> 4], dim=-1).flatten(-2).to(torch.uint8)


def _unpack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """`_pack` undone: codes uint8 [rows, K*bits/8] -> indices int64 [rows, K/4]."""
    if bits == 2:
        return codes.to(torch.int64)
    triples = codes.to(torch.int64).unflatten(-1, (-1, 3))
    low = triples[..., 0] | ((triples[..., 1] & 15) << 8)
    high = (triples[..., 1] >> 4) | (triples[..., 2] << 4)
    return torch.stack([low, high], dim=-1).flatten(-2)


def error_weights(importance: torch.Tensor, k: int, name: str) -> torch.Tensor | None:
    """An input column's factor in the encoder's squared error: its importance over their mean, plus
    IMPORTANCE_FLOOR (so that no column is ignored on the strength of a finite sample); None when every
    importance is zero (no calibration token reached the weight)."""
    if tuple(importance.shape) != (k,):
        raise TWXFormatError(f"{name}: importance must hold one value per input column ({k}), got "
                             f"{tuple(importance.shape)}")
    importance = importance.to(torch.float64)
    if not bool(torch.isfinite(importance).all()) or bool((importance < 0).any()):
        column = int((~torch.isfinite(importance) | (importance < 0)).nonzero()[0])
        raise TWXFormatError(f"{name}: importance of input column {column} is {float(importance[column])}; "
                             "it must be finite and >= 0")
    mean = importance.mean()
    return None if mean == 0 else (importance / mean + IMPORTANCE_FLOOR).to(torch.float32)


@torch.no_grad()
def encode(weight: torch.Tensor, bits: int, name: str = "tensor", chunk_rows: int = 256,
           importance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float [rows, K] -> (codes uint8 [rows, K*bits/8], scales uint8 [rows, K/32]). `importance` [K]:
    how much each input column's error costs (e.g. its calibration activations' mean square); the
    search then weighs each weight's squared error by `error_weights` (`_weighted_search`). None:
    every weight alike."""
    check_encodable(tuple(weight.shape), bits, ENTRIES, name, "TWX v2")
    book = codebooks()[bits]
    rows, k = weight.shape
    column_weights = None if importance is None else error_weights(importance, k, name)
    codes = torch.empty(rows, k * bits // 8, dtype=torch.uint8)
    scale_bytes = torch.empty(rows, k // GROUP, dtype=torch.uint8)
    for first in range(0, rows, chunk_rows):
        part = weight[first:first + chunk_rows].to(torch.float32)
        blocks = part.reshape(-1, GROUP)
        amax = blocks.abs().amax(dim=1)  # not finite where a block holds a NaN or an infinity
        if not torch.isfinite(amax).all():
            raise non_finite(name, first * k + int((~torch.isfinite(part)).reshape(-1).nonzero()[0]), k)
        if column_weights is None:
            chosen_bytes, index, decided = _table_search(blocks, amax, bits)
            if not bool(decided.all()):
                rest = torch.nonzero(~decided).squeeze(1)
                chosen_bytes[rest], index[rest] = _search(blocks[rest], book)
        else:
            weights = column_weights.expand(part.shape[0], -1).reshape(-1, GROUP)
            chosen_bytes, index = _weighted_search(blocks, amax, weights, bits)
        codes[first:first + part.shape[0]] = _pack(index.reshape(part.shape[0], -1), bits)
        scale_bytes[first:first + part.shape[0]] = chosen_bytes.reshape(part.shape[0], -1).to(torch.uint8)
    return codes, scale_bytes


def decode(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
           name: str = "tensor") -> torch.Tensor:
    """The reference decoder: (codes, scales) -> [rows, K]; bits follow from the two shapes."""
    k, bits = checked_pair(codes, scales, ENTRIES, name, "TWX v2")
    index = _unpack(codes, bits)
    values = codebooks()[bits][index].reshape(codes.shape[0], k)
    return (values * decode_scales(scales).repeat_interleave(GROUP, dim=1)).to(dtype)


def quantization_config(fmt, expert_bits: dict, source_format: str) -> dict:
    """config.json's `quantization_config` of a build in a TWX v2 format (`fmt`, a registry entry)."""
    return {
        "quant_method": fmt.quant_method,
        "format": fmt.name,
        "format_version": FORMAT_VERSION,
        "group_size": GROUP,
        "scale_encoding": "ue5m3",
        "scale_exponent_bias": SCALE_EXP_BIAS,
        "codebook": {"dim": DIM, "entries": {str(b): n for b, n in ENTRIES.items()},
                     "file": CODEBOOK_FILE.name, "sha256": codebook_sha256()},
        "tensors": {"codes": fmt.codes_suffix, "scales": fmt.scales_suffix},
        "expert_bits": expert_bits,
        "source_format": source_format,
    }


# ------------------------------------------------------------------------- making the codebooks
def _training_blocks(weights: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return mxfp4.quantize_values(torch.randn(weights // 512, 512, generator=generator)).reshape(-1, GROUP)


def _centroids(vectors: torch.Tensor, index: torch.Tensor, book: torch.Tensor) -> torch.Tensor:
    total = torch.zeros_like(book).index_add_(0, index, vectors)
    count = torch.zeros(book.shape[0], dtype=torch.float32).index_add_(0, index, torch.ones(vectors.shape[0]))
    return torch.where(count[:, None] > 0, total / count.clamp(min=1)[:, None], book)


def _odd_book(half_book: torch.Tensor) -> torch.Tensor:
    """The first half of a codebook (entry 0 the zero vector) -> the whole book: the first half, then its negation."""
    return torch.cat([half_book, -half_book])


def _refit_odd(vectors: torch.Tensor, index: torch.Tensor, half_book: torch.Tensor) -> torch.Tensor:
    """Each codeword of the first half moved to the mean of the vectors coded by it and the negated vectors
    coded by its negation; entry 0 stays zero."""
    half = half_book.shape[0]
    sign = torch.where(index >= half, -1.0, 1.0)
    refitted = _centroids(vectors * sign[:, None], index % half, half_book)
    refitted[0] = 0
    return refitted


def train_codebook(bits: int, weights: int = 1 << 22, kmeans_rounds: int = 10, encoder_rounds: int = 4,
                   seed: int = 0, odd: bool = True) -> torch.Tensor:
    """k-means on 4-vectors of MXFP4-published Gaussian weights, each block divided by the UE5M3 scale
    nearest to its maximum / 2.5, then rounds of re-fitting each codeword to the vectors the encoder
    gives it (at the scale the encoder chooses). The format's books are odd (`check_odd`): a 4-vector
    and its negation are coded alike and an all-zero 4-vector stays zero, so the code's errors carry no
    bias of sign that every row would share. `odd=False` is the recipe of the first books, without that
    structure, kept for `bench/codebook_seeds.py`."""
    blocks = _training_blocks(weights, seed)
    start = decode_scales(nearest_scale_bytes(blocks.abs().amax(dim=1) / 2.5))
    vectors = (blocks / start[:, None]).reshape(-1, DIM)
    generator = torch.Generator().manual_seed(seed + 1)
    # what is fitted (the first half of an odd book; a whole book otherwise), the book it makes, and its refit
    whole, refit = (_odd_book, _refit_odd) if odd else ((lambda book: book), _centroids)
    fitted = vectors[torch.randperm(vectors.shape[0], generator=generator)[:ENTRIES[bits] // (2 if odd else 1)]].clone()
    if odd:
        fitted[0] = 0
    for _ in range(kmeans_rounds):
        book = whole(fitted)
        fitted = refit(vectors, _nearest(vectors, book, book.square().sum(dim=1))[0], fitted)
    for _ in range(encoder_rounds):
        chosen_bytes, index = _search(blocks, whole(fitted))
        fitted = refit((blocks / decode_scales(chosen_bytes)[:, None]).reshape(-1, DIM), index.reshape(-1), fitted)
    return whole(fitted)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train TWX v2's codebooks (format constants) into a file.")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    from safetensors.torch import save_file

    books = {f"codebook.{bits}": train_codebook(bits) for bits in ENTRIES}
    with atomic_path(args.out) as tmp:
        save_file(books, str(tmp), {"recipe": RECIPE, "weights": str(1 << 22)})
    print(f"{args.out}: " + ", ".join(f"{n} {tuple(b.shape)} rms {float(b.square().mean().sqrt()):.4f}"
                                      for n, b in books.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
