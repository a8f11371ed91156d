"""Crash-safe file output: everything is written under a temporary name, then renamed into place."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

from moeshrink.core.errors import MoeshrinkError


class UnwritableFile(MoeshrinkError, OSError):
    """A write that failed for want of room (a full disk or quota, a read-only filesystem): named by the file
    it was for."""


_OUT_OF_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}  # the write's own fault, not its input's


class UnreadableFile(MoeshrinkError, ValueError):
    """A JSON or JSONL file that does not parse: cut mid-write, or not what its name says."""


def temporary_sibling(path: Path) -> Path:
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


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
        if isinstance(error, OSError) and error.errno in _OUT_OF_ROOM and not isinstance(error, MoeshrinkError):
            raise UnwritableFile(error.errno, f"{path}: not written ({error.strerror}); nothing was left "
                                 "under its name") from error
        raise


def atomic_write_text(path: Path | str, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def atomic_write_json(path: Path | str, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def jsonl_lines(path: Path | str) -> Iterator[tuple[int, dict]]:
    """Each non-blank line of a JSONL file with its line number; a line that does not parse is named."""
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as error:
                raise UnreadableFile(f"{path}, line {number}: not JSON ({error}); a file cut mid-line is "
                                     "rebuilt by rerunning the job that wrote it") from None


def read_jsonl(path: Path | str) -> list[dict]:
    return [row for _, row in jsonl_lines(path)]


def atomic_write_jsonl(path: Path | str, rows: Iterable[dict]) -> None:
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=False) + "\n")


def read_json(path: Path | str):
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as error:
            raise UnreadableFile(f"{path}: not JSON ({error})") from None


def sha256_file(path: Path | str, chunk_bytes: int = 16 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()
