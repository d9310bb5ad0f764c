"""Files that are whole or absent: wingspan writes every file and directory under a temporary name beside
its final one and renames it into place, so an interruption never leaves a half-written one behind."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def temporary_sibling(path: Path, kind: str = "tmp", unique: bool = False) -> Path:
    """A hidden name beside `path`. The same name every time, so that the next write of `path` clears what an
    interrupted one left; with `unique` it carries the process id, for paths several processes may write at
    once (the shared model cache)."""
    return path.with_name(f".{path.name}.{os.getpid()}.{kind}" if unique else f".{path.name}.{kind}")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


@contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path to write the file to; it replaces `path` when the block succeeds and is removed
    when it fails."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(path)
    _remove(tmp)
    try:
        yield tmp
        tmp.replace(path)
    finally:
        _remove(tmp)


def write_text_atomically(path: str | Path, text: str) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


@contextmanager
def atomic_directory(path: str | Path, unique: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary directory to fill; when the block succeeds it replaces `path` (a directory
    already there is moved aside first and removed after), when it fails it is removed. `unique`: see
    `temporary_sibling`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = temporary_sibling(path, unique=unique), temporary_sibling(path, "old", unique=unique)
    _remove(tmp)
    tmp.mkdir()
    try:
        yield tmp
        if path.exists():
            path.rename(old)
        tmp.rename(path)
    finally:
        _remove(tmp)
        if old.exists() and not path.exists():  # the new one never arrived: put the old one back
            old.rename(path)
        _remove(old)
