"""Files that are whole or absent: wingspan writes every file and directory under a temporary name beside
its final one and renames it into place, so an interruption never leaves a half-written one behind.

What arrives gets the user's normal mode (the umask's), whatever wrote it: safetensors writes its files 0600,
which a serving process run by another user could not read.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from wingspan.errors import DataError


def temporary_sibling(path: Path, kind: str = "tmp", unique: bool = False) -> Path:
    """A hidden name beside `path`. The same name every time, so that the next write of `path` clears what an
    interrupted one left; with `unique` it carries the process id, for paths several processes may write at
    once (the shared model cache)."""
    return path.with_name(f".{path.name}.{os.getpid()}.{kind}" if unique else f".{path.name}.{kind}")


def sha256_of(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def current_umask() -> int:
    """The process's umask: read from /proc where it is there, since reading it otherwise means setting it
    (and a file another thread created in between would get that mode)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    umask = os.umask(0o077)
    os.umask(umask)
    return umask


def normal_mode(directory: bool = False) -> int:
    """The mode a plain `open()` or `mkdir()` gives under the process's umask."""
    return (0o777 if directory else 0o666) & ~current_umask()


def give_normal_modes(path: Path) -> None:
    """`path` (a file, or a directory and everything in it) with the modes the umask gives."""
    if path.is_dir():
        path.chmod(normal_mode(directory=True))
        for child in path.rglob("*"):
            if not child.is_symlink():
                child.chmod(normal_mode(directory=child.is_dir()))
    else:
        path.chmod(normal_mode())


def inside(directory: Path, name: str, where: str) -> Path:
    """`directory / name` for a name read from a file (a manifest, a pointer), refused when it leads elsewhere."""
    path = directory / name
    if Path(name).is_absolute() or ".." in Path(name).parts or not name.strip():
        raise DataError(f"{where}: names {name!r}, which is not a file inside {directory}")
    return path


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
        give_normal_modes(tmp)
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
        give_normal_modes(tmp)
        if path.exists():
            path.rename(old)
        tmp.rename(path)
    finally:
        _remove(tmp)
        if old.exists() and not path.exists():  # the new one never arrived: put the old one back
            old.rename(path)
        _remove(old)
