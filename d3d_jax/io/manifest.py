"""Checksum manifests: a JSON file inside a checkpoint directory listing every file's size and
sha256, so damage (a truncated upload, a flipped byte, an emptied directory) is found by name
before Orbax reads the bytes — Orbax/OCDBT neither checks its data files nor fails readably.

``write_manifest(dir, extra)`` runs once the checkpoint is complete and lands atomically (temp
file + ``os.replace``); ``verify_manifest(dir)`` returns ``(manifest, None)`` or ``(None,
problem)`` with a short phrase such as ``"state/d/ab12 has 100 bytes, expected 200"``.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable

from d3d_jax.config import ConfigError

MANIFEST_FILE = "d3d_manifest.json"
_FORMAT = "d3d_jax.manifest/v1"
_CHUNK = 8 << 20


class CheckpointError(ConfigError):
    """A checkpoint is damaged or does not fit the run; the message says which and what to do."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)  # releases the GIL: files hash in parallel threads
    return h.hexdigest()


def _body_digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def file_digests(root: Path, skip: Iterable[str] = ()) -> dict[str, dict]:
    """``{relative path: {size, sha256}}`` of every file under ``root`` but ``skip`` and the manifest."""
    skip = set(skip) | {MANIFEST_FILE}
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.relative_to(root).as_posix() not in skip
                   and not p.name.startswith(MANIFEST_FILE))
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(files)))) as ex:
        hashes = list(ex.map(sha256_file, files))
    return {p.relative_to(root).as_posix(): {"size": p.stat().st_size, "sha256": h} for p, h in zip(files, hashes)}


def write_manifest(root: str | os.PathLike, extra: dict[str, Any] | None = None,
                   skip: Iterable[str] = ()) -> Path:
    """Hash every file under ``root`` (but ``skip``) into ``root/d3d_manifest.json``, atomically."""
    root = Path(root)
    body = {"format": _FORMAT, "files": file_digests(root, skip), **(extra or {})}
    body["self_sha256"] = _body_digest(body)
    path, tmp = root / MANIFEST_FILE, root / (MANIFEST_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(body, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_manifest(root: str | os.PathLike) -> tuple[dict | None, str | None]:
    """``(manifest, None)`` when the manifest is present and matches its own checksum."""
    path = Path(root) / MANIFEST_FILE
    if not path.is_file():
        return None, f"no checksum manifest ({MANIFEST_FILE}; the save never finished)"
    try:
        body = json.loads(path.read_text())
        claimed = body.pop("self_sha256")
        ok = body.get("format") == _FORMAT and isinstance(body.get("files"), dict)
    except (ValueError, KeyError, AttributeError, UnicodeDecodeError):
        return None, f"{MANIFEST_FILE} is not a readable manifest"
    if not ok or claimed != _body_digest(body):
        return None, f"{MANIFEST_FILE} fails its own checksum"
    return body, None


def verify_manifest(root: str | os.PathLike) -> tuple[dict | None, str | None]:
    """Check every listed file's size (all first: cheap), then its sha256."""
    root = Path(root)
    body, problem = read_manifest(root)
    if problem:
        return None, problem
    files = body["files"]
    for rel, meta in files.items():
        p = root / rel
        if not p.is_file():  # a FIFO or device in its place would block the checksum's read
            return None, f"{rel} is {'not a regular file' if p.exists() else 'missing'}"
        if p.stat().st_size != meta["size"]:
            return None, f"{rel} has {p.stat().st_size} bytes, expected {meta['size']}"
    rels = list(files)
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(rels)))) as ex:
        hashes = list(ex.map(lambda r: sha256_file(root / r), rels))
    for rel, h in zip(rels, hashes):
        if h != files[rel]["sha256"]:
            return None, f"{rel} fails its sha256 check (bytes changed since the save)"
    return body, None
