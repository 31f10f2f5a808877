"""Typed configs: YAML + key=value overrides, HF config.json (old and new RoPE layouts), the
shipped model / mesh configs, and errors that name the key."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

from d3d_jax.config import (CONFIG_DIR, ConfigError, MeshConfig, ModelConfig, load_config,
                            load_model_config)
from d3d_jax.model.qwen3 import abstract_model

HF_BASE = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
           "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
           "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 40960,
           "bos_token_id": 151643, "eos_token_id": 151645}


@dataclasses.dataclass(frozen=True)
class RunSketch:
    """A run config shaped like the programs' ones: nested sections plus scalars."""
    model: ModelConfig = ModelConfig()
    mesh: MeshConfig = MeshConfig()
    seed: int = 0

    def validate(self):
        self.model.validate("model")
        self.mesh.validate("mesh")


# ---- YAML + overrides ---------------------------------------------------------------------
def test_yaml_by_name_and_overrides_are_typed():
    cfg = load_model_config("tiny", ["num_layers=2", "rope_theta=1e4", "tie_word_embeddings=false"])
    assert cfg.num_layers == 2 and cfg.rope_theta == 1e4 and cfg.tie_word_embeddings is False
    assert cfg.hidden_size == 256  # untouched keys come from tiny.yaml


def test_base_yaml_nested_sections_and_dotted_overrides():
    cfg = load_config(RunSketch, [CONFIG_DIR / "base.yaml"],
                      ["model.num_layers=1", "mesh.tensor=2", "seed=7", "model=models/tiny-drafter.yaml"])
    assert cfg.seed == 7 and cfg.mesh.tensor == 2 and cfg.mesh.fsdp == -1
    assert cfg.model.hidden_size == 128  # the drafter yaml replaced tiny.yaml ...
    cfg2 = load_config(RunSketch, [CONFIG_DIR / "base.yaml"], ["model.num_layers=1"])
    assert cfg2.model.num_layers == 1 and cfg2.model.hidden_size == 256


def test_include_and_later_files_win(tmp_path):
    (tmp_path / "a.yaml").write_text("seed: 1\nmodel:\n  hidden_size: 64\n  head_dim: 16\n")
    (tmp_path / "b.yaml").write_text("include: a.yaml\nseed: 2\n")
    (tmp_path / "c.yaml").write_text("model:\n  num_layers: 3\n")
    cfg = load_config(RunSketch, [tmp_path / "b.yaml", tmp_path / "c.yaml"])
    assert (cfg.seed, cfg.model.hidden_size, cfg.model.num_layers) == (2, 64, 3)


def test_model_overrides_merge_into_the_yaml_model_file():
    """``model.X=…`` on a config whose ``model:`` names a file changes X and keeps the file's other
    keys (it used to replace the whole section: ``packed_length: 6144 exceeds
    model.max_position_embeddings=4096``, the default)."""
    from d3d_jax.config import TrainRunConfig

    path = CONFIG_DIR / "train/d3d-8b.yaml"
    cfg = load_config(TrainRunConfig, [path], ["num_devices=64", "model.num_layers=2",
                                               "model.remat_policy=save_dots"])
    assert (cfg.model.num_layers, cfg.model.remat_policy) == (2, "save_dots")
    assert (cfg.model.hidden_size, cfg.model.max_position_embeddings, cfg.model.mask_token_id) == (
        4096, 40960, 151669)  # qwen3-8b.yaml (included by d3d-drafter-8b.yaml) and the drafter file
    # the README's command: on this CPU the only complaint left is the platform, not the shapes
    with pytest.raises(ConfigError, match="model.attention_backend: 'pallas' needs gpu"):
        load_config(TrainRunConfig, [path], ["num_devices=64", "model.attention_backend=pallas"])
    # a later file given for the section still replaces it whole
    cfg = load_config(TrainRunConfig, [path], ["num_devices=64", "model=models/qwen3-4b.yaml"])
    assert (cfg.model.hidden_size, cfg.model.mask_token_id) == (2560, None)


@pytest.mark.parametrize("platform,head_dim,want", [
    ("cpu", 128, "xla"), ("gpu", 128, "pallas"), ("gpu", 48, "xla"), ("tpu", 128, "pallas"), ("tpu", 64, "xla")])
def test_decoding_attention_auto_picks_the_fused_kernels_where_they_run(monkeypatch, platform, head_dim, want):
    """--attention auto: the kernels on GPU/TPU for a head width their tiles take, else xla; a
    backend asked for by name is refused by the key where it cannot run."""
    from d3d_jax.config import model as M

    monkeypatch.setattr(M, "_platform", lambda: platform)
    cfg = ModelConfig(num_heads=4, num_kv_heads=2, head_dim=head_dim)
    assert M.decoding_attention("auto", cfg) == want
    assert M.decoding_attention("xla", cfg) == "xla"
    if want == "xla":
        with pytest.raises(ConfigError, match="models.attention: 'pallas'"):
            M.decoding_attention("pallas", cfg)
    with pytest.raises(ConfigError, match="models.attention: must be one of auto|xla|pallas"):
        M.decoding_attention("flash", cfg)


@pytest.mark.parametrize("override,key", [
    ("model.num_layers=many", "model.num_layers: expected an integer"),
    ("model.num_kv_heads=3", "model.num_kv_heads: num_heads=4 must be a multiple"),
    ("model.param_dtype=int4", "model.param_dtype: must be one of"),
    ("model.head_dim=7", "model.head_dim: must be even"),
    ("model.mask_token_id=999999", "model.mask_token_id: 999999 is outside the vocabulary"),
    ("model.num_layerz=2", "model.num_layerz: unknown key"),
    ("mesh.fsdp=0", "mesh.fsdp: must be >= 1 or -1"),
    ("seed=1.5", "seed: expected an integer"),
    ("model.num_layers", "overrides must look like key=value"),
])
def test_invalid_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace("(", r"\(")):
        load_config(RunSketch, [], [override])


def test_missing_yaml_file():
    with pytest.raises(ConfigError, match="config file not found"):
        load_model_config("no-such-model")


# ---- HF config.json -----------------------------------------------------------------------
def test_hf_new_and_old_rope_layouts_agree(tmp_path):
    new = dict(HF_BASE, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    old = dict(HF_BASE, rope_theta=1e6, rope_scaling=None)
    a, b = ModelConfig.from_hf_dict(new), ModelConfig.from_hf_dict(old)
    assert a == b and a.rope_theta == 1e6
    assert (a.num_layers, a.num_heads, a.num_kv_heads, a.head_dim) == (36, 32, 8, 128)
    assert a == load_model_config("qwen3-8b", ["param_dtype=float32", "dtype=float32"])
    # from a directory, with overrides on top
    (tmp_path / "config.json").write_text(json.dumps(old))
    c = load_model_config(tmp_path, ["num_layers=2"])
    assert c.num_layers == 2 and c.rope_theta == 1e6
    # our own export round-trips
    assert ModelConfig.from_hf_dict(a.to_hf_dict()) == a


def test_hf_head_dim_defaults_to_hidden_over_heads():
    hf = {k: v for k, v in HF_BASE.items() if k != "head_dim"}
    assert ModelConfig.from_hf_dict(hf).head_dim == 4096 // 32


@pytest.mark.parametrize("change,message", [
    ({"model_type": "llama"}, "model_type: expected 'qwen3'"),
    ({"rope_parameters": {"rope_type": "nope", "factor": 4.0}}, "rope_type: 'nope' is not supported"),
    ({"hidden_size": None}, "config.json.hidden_size: null is not allowed"),
    ({"intermediate_size": "big"}, "config.json.intermediate_size: expected an integer"),
    ({"num_key_value_heads": 5}, "config.json.num_key_value_heads"),
    ({"rope_theta": -1.0}, "config.json.rope_theta: must be > 0"),
    ({"attention_bias": True}, "config.json.attention_bias: true is not supported"),
    ({"use_sliding_window": True}, "config.json.use_sliding_window"),
])
def test_hf_bad_values_name_the_key(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict(dict(HF_BASE, **change))


def test_hf_directory_without_config_json(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_model_config(tmp_path)


# ---- shipped configs ------------------------------------------------------------------------
# Non-embedding parameter counts published on the Qwen3 model cards.
PUBLISHED_NON_EMBEDDING = {"qwen3-0.6b": 0.44e9, "qwen3-1.7b": 1.4e9, "qwen3-4b": 3.6e9,
                           "qwen3-8b": 6.95e9, "qwen3-32b": 31.2e9}


@pytest.mark.parametrize("name", list(PUBLISHED_NON_EMBEDDING))
def test_real_qwen3_shapes_have_the_published_sizes(name):
    cfg = load_model_config(name)
    assert cfg.vocab_size == 151936 and cfg.param_dtype == "bfloat16"
    # layers are identical: count a one-layer model's parameters and scale the layer part
    one = nnx.to_pure_dict(nnx.state(abstract_model(dataclasses.replace(cfg, num_layers=1)), nnx.Param))
    size = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(tree))
    total = size(one) + (cfg.num_layers - 1) * size(one["layers"])
    embedding = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    published = PUBLISHED_NON_EMBEDDING[name]
    digits = 2 if published < 1e9 or published == 6.95e9 else 1  # as printed on the cards
    assert round((total - embedding) / 1e9, digits) == round(published / 1e9, digits), name
    assert cfg.tie_word_embeddings == (name in ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b"))


@pytest.mark.parametrize("key", ["target_devices", "drafter_devices"])
@pytest.mark.parametrize("cls", ["TrainRunConfig", "RegenerateConfig", "PruneRunConfig"])
def test_a_mesh_device_split_is_refused_naming_the_decoder_field(key, cls):
    """The target/drafter split is the decoder's: a mesh section that names it (read by no
    command) is refused, and the error says where the setting lives."""
    import d3d_jax.config as C

    with pytest.raises(ConfigError, match=rf"mesh.{key}: not a setting here: it is decoder.{key} \(--"):
        load_config(getattr(C, cls), [], [f"mesh.{key}=2"])


def test_every_shipped_model_and_mesh_config_loads():
    models = sorted((CONFIG_DIR / "models").glob("*.yaml"))
    meshes = sorted((CONFIG_DIR / "meshes").glob("*.yaml"))
    assert len(models) >= 7 and len(meshes) >= 4
    for p in models:
        load_model_config(p)
    drafter = load_model_config("tiny-drafter")
    tiny = load_model_config("tiny")
    assert drafter.vocab_size == tiny.vocab_size and drafter.hidden_size < tiny.hidden_size
    for p in meshes:
        load_config(MeshConfig, [p])
    assert load_model_config("d3d-drafter-1.7b").mask_token_id == 151669
