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

from d3d_jax.config.limits import json_loads
from d3d_jax.errors import ModelFileError, UsageError
from d3d_jax.io.files import open_regular, read_json

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
    """``(header dict, byte offset where the tensor data starts)``, every entry checked against the
    file: its dtype, shape and byte range must be consistent and inside the file (a truncated
    download fails here, naming the file and the first tensor it cuts, before anything is read)."""
    with open_regular(path, "a safetensors file") as f:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(8)
        if len(raw) != 8:
            raise ModelFileError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        n = int.from_bytes(raw, "little")
        if n > size - 8:
            raise ModelFileError(f"{path}: the header claims {n} bytes but the file has {size} in all: "
                                 "the file is truncated or not a safetensors file")
        try:
            header = json_loads(f.read(n))
        except (ValueError, RecursionError) as e:
            raise ModelFileError(f"{path}: not a safetensors file (header: {str(e)[:200]})") from None
    if not isinstance(header, dict):
        raise ModelFileError(f"{path}: not a safetensors file (the header is not a JSON object)")
    data_size = size - 8 - n
    for name, info in header.items():
        if name != "__metadata__":
            _check_entry(path, name, info, data_size)
    return header, 8 + n


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_entry(path, name: str, info, data_size: int) -> None:
    where = f"{path}: tensor {name}"
    if not isinstance(info, dict) or not isinstance(info.get("dtype"), str):
        raise ModelFileError(f"{where}: header entry needs 'dtype', 'shape' and 'data_offsets'")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not (isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)):
        raise ModelFileError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise ModelFileError(f"{where}: data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end")
    begin, end = offsets
    if end > data_size:
        raise ModelFileError(f"{where} needs bytes {begin}..{end} of the data section, which holds only "
                             f"{data_size}: the file is truncated")
    dtype = _DTYPES.get(info["dtype"])
    if dtype is not None and end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
        raise ModelFileError(f"{where}: {end - begin} bytes do not hold shape {shape} of {info['dtype']}")


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
            raise ModelFileError(f"{self.path}: tensor {name} has unsupported dtype {info['dtype']}")
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
            body = read_json(index, "a safetensors index")
            weight_map = body.get("weight_map", {}) if isinstance(body, dict) else None
            if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
                raise ModelFileError(f"{index}: 'weight_map' must map tensor names to file names")
            files = sorted(set(weight_map.values()))
        elif (directory / SINGLE_FILE).exists():
            files = [SINGLE_FILE]
        else:
            files = sorted(p.name for p in directory.glob("*.safetensors"))
        if not files:
            raise ModelFileError(f"{directory}: no *.safetensors weights found")
        self._files: dict[str, SafetensorsFile] = {}
        self._where: dict[str, SafetensorsFile] = {}
        for name in files:
            if not (directory / name).exists():
                raise ModelFileError(f"{directory}: {INDEX_FILE} lists {name}, which does not exist")
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

    def file_of(self, name: str) -> Path:
        return self._where[name].path


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
        raise UsageError(f"max_shard_size: cannot parse {size!r} (use e.g. 200KB, 5GB or bytes)") from None


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
