"""Crash-safe file output: everything is written under a temporary name, then renamed into place."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

from moeshrink.core.errors import MoeshrinkError


class UnwritableFile(MoeshrinkError, OSError):
    """A write that failed for want of room (a full disk or quota, a read-only filesystem): named by the file
    it was for."""

    def __str__(self) -> str:
        return str(self.strerror)


_OUT_OF_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}  # the write's own fault, not its input's


class UnreadableFile(MoeshrinkError, ValueError):
    """A JSON or JSONL file that does not parse: cut mid-write, or not what its name says."""


class NonFiniteNumber(MoeshrinkError, ValueError):
    """NaN or infinity where a figure belongs: refused where it arises (a record about to be written) and
    where it is read, named by file, line and key, since JSON has no such number and every later figure
    (a mean, an interval, a verdict) would silently carry it."""


def first_non_finite(value, where: str = "") -> tuple[str, float] | None:
    """The key path ('metrics.accuracy.value', 'kl[3]') and value of the first NaN or infinity in `value`."""
    if isinstance(value, float):
        return None if math.isfinite(value) else (where or "the value", value)
    if isinstance(value, dict):
        items = ((f"{where}.{key}" if where else str(key), item) for key, item in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{where}[{index}]", item) for index, item in enumerate(value))
    else:
        return None
    for path, item in items:
        found = first_non_finite(item, path)
        if found:
            return found
    return None


def _finite_json(value, path: Path | str, line: int | None = None) -> str:
    """`value` as JSON text, refusing NaN and infinity by key."""
    try:
        return json.dumps(value, indent=None if line else 2, sort_keys=False, allow_nan=False)
    except ValueError:
        found = first_non_finite(value)
        if not found:
            raise
        where = f"{path}, line {line}" if line else str(path)
        raise NonFiniteNumber(f"{where}: {found[0]} is {found[1]}, not a finite number; nothing was written under "
                              "this name") from None


def _loads_finite(text: str, where: str):
    """Parse JSON, refusing the NaN and Infinity that Python's parser would otherwise accept."""
    non_finite = []

    def constant(name: str) -> float:
        non_finite.append(name)
        return float(name)
    value = json.loads(text, parse_constant=constant)
    if non_finite:
        found = first_non_finite(value)
        key = found[0] if found else "a value"
        raise NonFiniteNumber(f"{where}: {key} is {non_finite[0]}, not a finite number; the job that wrote it "
                              "must be fixed and rerun")
    return value


def temporary_sibling(path: Path) -> Path:
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


_TEMPORARY = re.compile(r"^\.(.+)\.tmp-\d+$")


def intended_path(path: Path | str) -> Path:
    """The name a path written under temporary names (its own or a folder's) will have once renamed."""
    return Path(*(_TEMPORARY.sub(r"\1", part) for part in Path(path).parts))


def remove_stale_siblings(path: Path) -> None:
    """Remove temporary names of `path` whose writer is gone (a process killed with SIGKILL cannot clean
    up after itself)."""
    for stale in path.parent.glob(f".{path.name}.tmp-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success rename it over `path`, on failure remove it.
    Temporary names a killed writer left are removed first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_siblings(path)
    tmp = temporary_sibling(path)
    try:
        yield tmp
        if tmp.is_dir():
            if path.exists():
                shutil.rmtree(path)
            os.replace(tmp, path)
        else:
            # no fsync: the rename makes the file appear whole or not at all to any process that
            # outlives this one (a killed job, a rerun); power-loss durability is the filesystem's
            os.replace(tmp, path)
    except BaseException as error:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        if isinstance(error, OSError) and not isinstance(error, MoeshrinkError):
            unwritable = out_of_room(error, path)
            if unwritable:
                raise unwritable from error
        raise


def out_of_room(error: OSError, path: Path | str) -> UnwritableFile | None:
    """`error` as an UnwritableFile naming `path`, where it is a write's want of room (else None)."""
    if error.errno not in _OUT_OF_ROOM:
        return None
    return UnwritableFile(error.errno, f"{intended_path(path)}: not written ({error.strerror}); nothing was left "
                          "under its name")


def atomic_write_text(path: Path | str, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def atomic_write_json(path: Path | str, obj) -> None:
    atomic_write_text(path, _finite_json(obj, path) + "\n")


def jsonl_lines(path: Path | str) -> Iterator[tuple[int, dict]]:
    """Each non-blank line of a JSONL file with its line number; a line that does not parse is named."""
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield number, _loads_finite(line, f"{path}, line {number}")
            except json.JSONDecodeError as error:
                raise UnreadableFile(f"{path}, line {number}: not JSON ({error}); a file cut mid-line is "
                                     "rebuilt by rerunning the job that wrote it") from None


def read_jsonl(path: Path | str) -> list[dict]:
    return [row for _, row in jsonl_lines(path)]


def atomic_write_jsonl(path: Path | str, rows: Iterable[dict]) -> None:
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        for number, row in enumerate(rows, 1):
            f.write(_finite_json(row, path, number) + "\n")


def read_json(path: Path | str):
    with open(path) as f:
        try:
            return _loads_finite(f.read(), str(path))
        except json.JSONDecodeError as error:
            raise UnreadableFile(f"{path}: not JSON ({error})") from None


def sha256_file(path: Path | str, chunk_bytes: int = 16 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()
