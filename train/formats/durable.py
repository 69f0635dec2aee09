"""Files that survive a crash or a power cut: what is renamed into place was on disk first.

A file is written under a temporary name beside its final one, flushed, ``os.fsync``'d and only then renamed over
the final name; the rename itself is made durable by fsyncing the directory that holds it (without that, a power
cut can lose the rename although the data is on disk). A reader thus sees the old file or the whole new one, never
a part. While a file is written its SHA-256 is computed from the bytes on their way out, so that a checkpoint's
manifest needs no second read of what was just written (at V4.1's scale that read alone was half an hour).
"""
import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import torch


class _Hashing:
    """A binary file that hashes what goes through ``write``: all ``torch.save`` needs of a file object."""

    def __init__(self, file: BinaryIO):
        self.file, self.digest, self.bytes = file, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.digest.update(data)
        self.bytes += len(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def write(path: Path, fill: Callable[[BinaryIO], None]) -> dict:
    """``fill(file)`` writes ``path``'s bytes; they reach the disk under a temporary name, which is then renamed to
    ``path``. Returns the file's size and SHA-256 (``{"bytes", "sha256"}``, a manifest entry). The rename is durable
    once ``sync_dir(path.parent)`` has run (once for many files)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        hashing = _Hashing(f)
        fill(hashing)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return {"bytes": hashing.bytes, "sha256": hashing.digest.hexdigest()}


def save_tensors(obj, path: Path) -> dict:
    """``torch.save(obj)`` to ``path`` through ``write``."""
    return write(path, lambda f: torch.save(obj, f))


def write_text(path: Path, text: str, sync: bool = True) -> dict:
    """``text`` (UTF-8) to ``path`` through ``write``; ``sync``: the rename made durable at once."""
    entry = write(path, lambda f: f.write(text.encode()))
    if sync:
        sync_dir(path.parent)
    return entry


def sync_dir(directory: Path) -> None:
    """Make the renames and new entries of ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_dir(source: Path, target: Path) -> None:
    """Rename the directory ``source`` to ``target`` (an empty or absent one), durably."""
    os.replace(source, target)
    sync_dir(target.parent)
