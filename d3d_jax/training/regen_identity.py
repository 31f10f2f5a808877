"""What a regenerated record says made it, and where its responses end: the target's identity
(its config and a cheap fingerprint of its weights, or of the parameters of an in-memory model),
the chat template's, and the end-of-turn ids the decoder stops at.  Resuming a run compares the
first two with the records already written (:func:`~d3d_jax.training.regen_output.check_compatible`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from d3d_jax.errors import ModelFileError
from d3d_jax.io.files import read_json


def _sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _weights_fingerprint(path: Path) -> str:
    """Names, sizes and first/last 64 KiB of every file under ``path`` (cheap, changes with weights)."""
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for p in files:
        size = p.stat().st_size
        h.update(f"{p.relative_to(path) if p != path else p.name}\x00{size}\x00".encode())
        with open(p, "rb") as f:
            h.update(f.read(1 << 16))
            if size > 1 << 17:
                f.seek(size - (1 << 16))
                h.update(f.read())
    return h.hexdigest()


def target_identity(target, path: str | os.PathLike | None = None) -> dict:
    """``{"path", "config_sha256", "weights_sha256"}`` naming the model that wrote a record.

    With no path (an in-memory model) the weights hash covers the parameter bytes themselves.
    """
    cfg = dataclasses.asdict(target.config)
    for key in ("gradient_checkpointing", "remat_policy"):  # change memory, not outputs
        cfg.pop(key, None)
    if cfg.get("attention_backend") == "xla":  # the default leaves older records' hashes as they were
        cfg.pop("attention_backend")
    if path is not None and Path(path).exists():
        weights = _weights_fingerprint(Path(path))
    else:
        from flax import nnx
        import jax

        h = hashlib.sha256()
        for leaf in jax.tree_util.tree_leaves(nnx.to_pure_dict(nnx.state(target, nnx.Param))):
            h.update(np.asarray(leaf).tobytes())
        weights = h.hexdigest()
    return {"path": str(Path(path).resolve()) if path is not None else "<in-memory>",
            "config_sha256": _sha256_json(cfg), "weights_sha256": weights}


def stop_token_ids(target, tokenizer, target_path: str | os.PathLike | None = None) -> tuple[int, ...]:
    """End-of-turn ids: the model's and tokenizer's eos, ``<|im_end|>``, generation_config.json's."""
    ids: list[int] = []

    def add(v):
        if v is None:
            return
        for x in (v if isinstance(v, (list, tuple)) else [v]):
            if isinstance(x, int) and x >= 0 and x not in ids:
                ids.append(x)

    add(target.config.eos_token_id)
    add(tokenizer.eos_token_id)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if im_end is not None and im_end != tokenizer.unk_token_id:
        add(im_end)
    if target_path is not None and (Path(target_path) / "generation_config.json").exists():
        gen = read_json(Path(target_path) / "generation_config.json", "generation_config.json")
        add(gen.get("eos_token_id") if isinstance(gen, dict) else None)
    if not ids:
        raise ModelFileError("no end-of-turn token: the target config and tokenizer name no eos token")
    return tuple(ids)


def template_identity(tokenizer, enable_thinking: bool = False) -> dict:
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else json.dumps(
        tokenizer.chat_template, sort_keys=True)
    return {"add_generation_prompt": True, "enable_thinking": bool(enable_thinking),
            "chat_template_sha256": hashlib.sha256((template or "").encode()).hexdigest()}
