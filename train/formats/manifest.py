"""Checkpoint manifests: every file of a checkpoint with its size and SHA-256, written last.

A checkpoint directory is intact when each file its ``manifest.json`` lists is there with that size and, when
checked, that digest. The manifest is written after every other file (and before the directory is published),
so a checkpoint without one is incomplete. Sizes are checked in microseconds (truncated or deleted files);
digests read everything back, in threads (hashlib releases the GIL), and are checked on resume. SHA-256 so that
``sha256sum`` can confirm a file by hand. A checkpoint's writers hash their files as they write them
(``train/formats/durable.py``) and hand the entries in, so that a save reads nothing back.

The manifest also carries the checkpoint's format version (``FORMAT``); one without it is of format 1, the layout
before the version was recorded, which is today's.
"""
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from train.formats import durable

MANIFEST = "manifest.json"
FORMAT = 1  # raised when a change of the layout makes older code misread a checkpoint
_THREADS = min(8, os.cpu_count() or 1)


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write(directory: Path, known: dict[str, dict] | None = None) -> None:
    """Describe every file under ``directory`` (its sub-directories too) in ``manifest.json``, durably. ``known``:
    entries (``{"bytes", "sha256"}`` by relative name) the writers computed; any other file is hashed here."""
    known = known or {}
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    unknown = [p for p in files if p.relative_to(directory).as_posix() not in known]
    with ThreadPoolExecutor(_THREADS) as pool:
        hashed = dict(zip(unknown, pool.map(sha256, unknown)))
    entries = {}
    for p in files:
        name = p.relative_to(directory).as_posix()
        entries[name] = known.get(name) or {"bytes": p.stat().st_size, "sha256": hashed[p]}
    durable.write_text(directory / MANIFEST, json.dumps({"format": FORMAT, "files": entries}, indent=1))


def format_of(directory: Path) -> int | None:
    """The format version ``directory``'s manifest records (1 when it records none), or None without a readable
    manifest (``problem`` says why)."""
    try:
        return int(json.loads((directory / MANIFEST).read_text()).get("format", 1))
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def problem(directory: Path, digests: bool = True, share: tuple[int, int] = (0, 1)) -> str | None:
    """Why ``directory`` is not an intact checkpoint (the first file that is missing, of the wrong size or, with
    ``digests``, of the wrong SHA-256), or None when it is. ``share=(i, n)``: only the i-th of every n files (in the
    manifest's order), so that n processes check each file once between them."""
    try:
        entries = json.loads((directory / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return f"it has no {MANIFEST} (an interrupted save, or written by an older version)"
    except (OSError, ValueError, KeyError) as error:
        return f"its {MANIFEST} is unreadable ({error})"
    entries = {name: entries[name] for name in list(entries)[share[0]::share[1]]}
    for name, entry in entries.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != entry["bytes"]:
            return f"{name} is {size:,} bytes, the manifest says {entry['bytes']:,}"
    if digests:
        names = list(entries)
        with ThreadPoolExecutor(_THREADS) as pool:
            for name, digest in zip(names, pool.map(sha256, (directory / n for n in names))):
                if digest != entries[name]["sha256"]:
                    return f"{name} does not match its SHA-256 in the manifest (corrupted)"
    return None
