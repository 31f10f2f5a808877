"""Only regular files are opened as model, tokenizer, config and data files (d3d_jax/io/files.py):
a directory, FIFO, socket or device in their place is refused by name before any read.  The
reference is the file type itself (``os.mkfifo``, a bound socket, ``/dev/null``); each call runs
in a thread with a deadline, since the old failure was a read that never returned."""

from __future__ import annotations

import json
import os
import socket
import threading

import pytest

from d3d_jax.config import ModelConfig
from d3d_jax.errors import D3DError

CFG = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                  num_kv_heads=1, head_dim=8)
KINDS = {"fifo": "a FIFO (named pipe)", "directory": "a directory", "socket": "a socket",
         "device": "a character device"}


def _replace(path, kind: str, keep: list) -> None:
    """Put a special file of ``kind`` where ``path`` was."""
    if path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        keep.append(s)
    else:
        os.symlink("/dev/null", path)  # not /dev/zero: without the check its endless read fills memory


def _refused(call, path, kind) -> str:
    """The one-line message of the D3DError ``call()`` must raise within the deadline."""
    out = {}

    def run():
        try:
            call()
            out["result"] = "returned"
        except Exception as e:  # noqa: BLE001 - inspected below
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(20)
    if t.is_alive() and kind == "fifo":  # unblock the reader the old code left waiting
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    assert not t.is_alive(), f"{path}: still reading a {kind} after 20 s"
    e = out.get("error")
    assert isinstance(e, D3DError), (kind, out)
    assert "\n" not in str(e), str(e)
    return str(e)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from serve_fake import TOKENIZER

    from d3d_jax.io.hf import save_qwen3
    from d3d_jax.model.qwen3 import init_model

    out = tmp_path_factory.mktemp("files") / "model"
    save_qwen3(init_model(CFG, seed=0), out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((TOKENIZER / name).read_bytes())
    return out


def _copy(src, dst):
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def _cases():
    from d3d_jax.bench.evaluation.benchmarks import read_records
    from d3d_jax.config.base import read_yaml
    from d3d_jax.config.model import load_model_config
    from d3d_jax.io.checkpoint import load_model
    from d3d_jax.io.hf import open_tokenizer
    from d3d_jax.io.records import jsonl_lines
    from d3d_jax.training.data import load_lm_stream

    return {  # name -> (file to replace, the call that opens it) in a copy of the model directory
        "weights": ("model.safetensors", lambda d: load_model(d)),
        "index": ("model.safetensors.index.json", lambda d: load_model(d)),
        "config.json": ("config.json", lambda d: load_model(d)),
        "model config": ("config.json", lambda d: load_model_config(d)),
        "tokenizer": ("tokenizer.json", lambda d: open_tokenizer(d)),
        "tokenizer config": ("tokenizer_config.json", lambda d: open_tokenizer(d)),
        "yaml": ("run.yaml", lambda d: read_yaml(d / "run.yaml")),
        "jsonl data": ("train.jsonl", lambda d: list(jsonl_lines(d / "train.jsonl"))),
        "gzip data": ("train.jsonl.gz", lambda d: list(jsonl_lines(d / "train.jsonl.gz"))),
        "text data": ("train.txt", lambda d: load_lm_stream(d / "train.txt", object(), None)),
        "benchmark": ("bench.jsonl", lambda d: read_records(d / "bench.jsonl")),
    }


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("case", ["weights", "index", "config.json", "model config", "tokenizer", "tokenizer config",
                                  "yaml", "jsonl data", "gzip data", "text data", "benchmark"])
def test_a_special_file_in_place_of_an_input_is_refused_by_name(model_dir, tmp_path, case, kind):
    name, call = _cases()[case]
    d = _copy(model_dir, tmp_path / "m")
    if case == "index":
        (d / name).write_text(json.dumps({"weight_map": {"model.embed_tokens.weight": "model.safetensors"}}))
    keep: list = []
    _replace(d / name, kind, keep)
    try:
        message = _refused(lambda: call(d), d / name, kind)
        assert f"{d / name}: is {KINDS[kind]}, not a regular file" in message, message
    finally:
        for s in keep:
            s.close()


def test_a_regular_file_behind_a_symlink_still_opens(tmp_path):
    from d3d_jax.io.files import read_json

    (tmp_path / "real.json").write_text('{"a": 1}')
    os.symlink(tmp_path / "real.json", tmp_path / "link.json")
    assert read_json(tmp_path / "link.json") == {"a": 1}
