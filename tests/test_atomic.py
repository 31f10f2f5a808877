"""Exports replaced whole (d3d_jax/io/atomic.py): a failure or a kill at any point of an HF or a
param export leaves the previous export byte for byte, and a swap cut between its two renames is
finished or undone by the next export."""
import errno

import numpy as np
import pytest

from d3d_jax.config import ModelConfig
from d3d_jax.errors import ResourceError
from d3d_jax.io import atomic
from d3d_jax.io import safetensors_io as st
from d3d_jax.io.checkpoint import load_model, save_params
from d3d_jax.io.hf import save_qwen3
from d3d_jax.io.manifest import verify_manifest
from d3d_jax.model.qwen3 import init_model

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, tie_word_embeddings=False)


def snapshot(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def models():
    return init_model(CFG, seed=1), init_model(CFG, seed=2)


def test_hf_export_failing_midway_leaves_the_old_export_whole(tmp_path, models, monkeypatch):
    old, new = models
    out = tmp_path / "hf"
    save_qwen3(old, out, max_shard_size="20KB")
    (out / "result.json").write_text("{}")  # a file the export does not own
    before = snapshot(out)
    assert sum(n.startswith("model-") for n in before) > 2
    real, written = st.write_file, []

    def disk_full_after_one_shard(path, arrays):
        if written:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(path)
        return real(path, arrays)

    monkeypatch.setattr(st, "write_file", disk_full_after_one_shard)
    with pytest.raises(ResourceError, match=f"^{out}: No space left on device \\(errno 28\\); what was written"):
        save_qwen3(new, out, max_shard_size="20KB")
    monkeypatch.setattr(st, "write_file", real)
    assert snapshot(out) == before  # not one byte of the old export changed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no partial directory left
    np.testing.assert_array_equal(np.asarray(load_model(out).lm_head.kernel[...]), np.asarray(old.lm_head.kernel[...]))
    save_qwen3(new, out)  # one file now: the old shards go, the foreign file stays
    names = sorted(snapshot(out))
    assert names == ["config.json", "model.safetensors", "result.json"], names
    np.testing.assert_array_equal(np.asarray(load_model(out).lm_head.kernel[...]), np.asarray(new.lm_head.kernel[...]))


def test_param_export_failing_before_its_manifest_leaves_the_old_one_intact(tmp_path, models, monkeypatch):
    import d3d_jax.io.checkpoint as ck

    old, new = models
    out = tmp_path / "params"
    save_params(old, out)
    before = snapshot(out)

    def full(root, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ck, "write_manifest", full)
    with pytest.raises(ResourceError, match="No space left on device"):
        save_params(new, out)
    assert snapshot(out) == before and verify_manifest(out)[1] is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params"]


@pytest.mark.parametrize("landed", [False, True])
def test_a_swap_killed_between_its_renames_is_finished_or_undone(tmp_path, landed):
    final = tmp_path / "export"
    partial, previous = atomic.staging_paths(final)
    previous.mkdir()
    (previous / "w").write_text("old")
    if landed:  # killed after the new export was renamed into place
        final.mkdir()
        (final / "w").write_text("new")
    partial.mkdir()  # and a half-written one from another kill
    (partial / "w").write_text("half")
    with atomic.staged_directory(final) as tmp:
        assert list(tmp.iterdir()) == []  # a fresh directory, not the half-written one
        (tmp / "x").write_text("x")
    # carried over from the export in place (the new one if it had landed, else the old one)
    assert snapshot(final) == {"w": b"new" if landed else b"old", "x": b"x"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_an_output_path_that_is_a_file_is_one_error_naming_it(tmp_path, models):
    (tmp_path / "hf").write_text("not a directory")
    with pytest.raises(ResourceError, match=r"hf: is a file, not a directory"):
        save_qwen3(models[0], tmp_path / "hf")
