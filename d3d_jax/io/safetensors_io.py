"""Minimal safetensors reader / writer on numpy memory maps.

Why not ``safetensors.numpy``: numpy has no bfloat16, so it cannot read the bf16 checkpoints
Qwen3 ships.  The format is small (8-byte little-endian header length, a JSON header of
``{name: {dtype, shape, data_offsets}}``, raw little-endian bytes), so we read it directly into
``ml_dtypes`` arrays backed by ``np.memmap``: a tensor is only paged in when it is converted,
which lets the loader place one parameter at a time on the mesh without holding the whole
checkpoint in host memory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Mapping

import ml_dtypes
import numpy as np

_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def read_header(path: str | os.PathLike) -> tuple[dict, int]:
    """``(header dict, byte offset where the tensor data starts)``."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        n = int.from_bytes(raw, "little")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not a safetensors file ({e})") from None
    return header, 8 + n


class SafetensorsFile:
    """Lazy tensors of one ``.safetensors`` file."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.header, self._start = read_header(self.path)
        self.header.pop("__metadata__", None)
        self._mmap: np.memmap | None = None

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{self.path}: tensor {name} has unsupported dtype {info['dtype']}")
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        begin, end = info["data_offsets"]
        buf = self._mmap[self._start + begin: self._start + end]
        return buf.view(_DTYPES[info["dtype"]]).reshape(info["shape"])


class SafetensorsDir:
    """All tensors of a directory: ``model.safetensors``, or shards listed by the index file,
    or (no index) every ``*.safetensors`` file in it."""

    def __init__(self, directory: str | os.PathLike):
        directory = Path(directory)
        index = directory / INDEX_FILE
        if index.exists():
            with open(index) as f:
                weight_map = json.load(f).get("weight_map", {})
            files = sorted(set(weight_map.values()))
        elif (directory / SINGLE_FILE).exists():
            files = [SINGLE_FILE]
        else:
            files = sorted(p.name for p in directory.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{directory}: no *.safetensors weights found")
        self._files: dict[str, SafetensorsFile] = {}
        self._where: dict[str, SafetensorsFile] = {}
        for name in files:
            if not (directory / name).exists():
                raise ValueError(f"{directory}: {INDEX_FILE} lists {name}, which does not exist")
            st = SafetensorsFile(directory / name)
            self._files[name] = st
            for key in st.keys():
                self._where[key] = st

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def keys(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name].shape(name)

    def get(self, name: str) -> np.ndarray:
        return self._where[name].get(name)


def write_file(path: str | os.PathLike, tensors: Mapping[str, np.ndarray]) -> None:
    """Write one safetensors file (``format: pt`` metadata, which transformers requires)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    arrays = []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype not in _NAMES:
            raise ValueError(f"tensor {name}: dtype {arr.dtype} cannot be stored in safetensors")
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())


def parse_size(size: int | str) -> int:
    """``"5GB"`` / ``"200KB"`` / ``"10MiB"`` / an int of bytes -> bytes."""
    if isinstance(size, int):
        return size
    s = str(size).strip().upper()
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    for unit, mult in units.items():
        if s.endswith(unit):
            try:
                return int(float(s[: -len(unit)]) * mult)
            except ValueError:
                break
    try:
        return int(s)
    except ValueError:
        raise ValueError(f"max_shard_size: cannot parse {size!r} (use e.g. 200KB, 5GB or bytes)") from None


def plan_shards(sizes: Iterable[tuple[str, int]], max_bytes: int | None) -> list[list[str]]:
    """Greedy split of named tensors (in order) into shards of at most ``max_bytes``
    (a single tensor larger than that gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes:
        if max_bytes is not None and shards[-1] and used + nbytes > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards
