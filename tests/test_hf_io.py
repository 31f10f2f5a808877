"""HF export / import: transformers reloads what we write; bad input fails with one clear error;
the tokenizer gets ``<|MASK|>`` and the embedding grows when the id does not fit."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import Qwen3ForCausalLM

from d3d_jax.config import ConfigError, ModelConfig
from d3d_jax.errors import ModelFileError, NonFiniteError
from d3d_jax.io import safetensors_io as st
from d3d_jax.io.hf import ensure_token_fits, load_qwen3, load_tokenizer, save_qwen3
from d3d_jax.model.qwen3 import init_model

TOL = 1e-4
TIED = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, tie_word_embeddings=True)
UNTIED = ModelConfig(vocab_size=80, hidden_size=24, intermediate_size=48, num_layers=2, num_heads=3,
                     num_kv_heads=1, head_dim=8, tie_word_embeddings=False, rope_theta=1e4,
                     mask_token_id=79, block_size=4)


def hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens)), use_cache=False).logits.float().numpy()


@nnx.jit
def forward(model, tokens):
    return model(tokens)


def randomise_norms(model):
    """Norm scales start at 1; random ones make a mis-exported scale visible."""
    rng = np.random.default_rng(0)
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param) and path[-1] == "scale":
            var[...] = jnp.asarray(1 + 0.5 * rng.standard_normal(var[...].shape), var[...].dtype)
    return model


@pytest.mark.parametrize("cfg,shard", [(TIED, None), (UNTIED, "6KB")], ids=["tied", "untied-sharded"])
def test_export_reloads_in_transformers_with_same_logits(tmp_path, cfg, shard):
    model = randomise_norms(init_model(cfg, seed=3))
    save_qwen3(model, tmp_path, max_shard_size=shard)
    if shard:
        assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    hf = Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16))
    ours = np.asarray(forward(model, jnp.asarray(tokens)))
    assert np.abs(ours - hf_logits(hf, tokens)).max() <= TOL
    # and our own loader reads the export back to the very same parameters
    again = load_qwen3(tmp_path)
    assert again.config == cfg
    assert np.abs(np.asarray(forward(again, jnp.asarray(tokens))) - ours).max() == 0.0


def test_export_bf16_and_extra_config(tmp_path):
    model = init_model(UNTIED, seed=4)
    save_qwen3(model, tmp_path, dtype="bfloat16", extra_config={"d3d_note": "drafter"})
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["mask_token_id"] == 79 and written["block_size"] == 4 and written["d3d_note"] == "drafter"
    header, _ = st.read_header(tmp_path / "model.safetensors")
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    # transformers upcast to f32 and ours reading the same bf16 file upcast to f32 agree
    hf = Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = load_qwen3(tmp_path, dtype="float32")
    assert ours.config.mask_token_id == 79 and ours.config.block_size == 4
    tokens = np.random.default_rng(1).integers(0, 80, (1, 12))
    assert np.abs(np.asarray(forward(ours, jnp.asarray(tokens))) - hf_logits(hf, tokens)).max() <= TOL
    # with no dtype given, the checkpoint's own (bf16) is used
    assert load_qwen3(tmp_path).config.param_dtype == "bfloat16"


# ---- bad input ------------------------------------------------------------------------------
@pytest.fixture()
def good_dir(tmp_path):
    save_qwen3(init_model(TIED, seed=0), tmp_path / "good")
    return tmp_path / "good"


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_directory_without_config_json(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_qwen3(tmp_path)
    with pytest.raises(ConfigError, match="not a directory"):
        load_qwen3(tmp_path / "missing")


def test_other_model_type(good_dir):
    edit_config(good_dir, model_type="llama")
    with pytest.raises(ConfigError, match="model_type: expected 'qwen3', got 'llama'"):
        load_qwen3(good_dir)


def test_missing_tensor(good_dir):
    f = st.SafetensorsFile(good_dir / "model.safetensors")
    tensors = {k: np.array(f.get(k)) for k in f.keys() if k != "model.layers.1.mlp.up_proj.weight"}
    del f
    st.write_file(good_dir / "model.safetensors", tensors)
    with pytest.raises(ValueError, match=r"tensor model.layers.1.mlp.up_proj.weight is missing"):
        load_qwen3(good_dir)


def test_mis_shaped_tensor(good_dir):
    edit_config(good_dir, intermediate_size=80)  # the tensors were written for 64
    with pytest.raises(ValueError) as err:
        load_qwen3(good_dir)
    msg = str(err.value)
    assert "model.layers.0.mlp.gate_proj.weight" in msg and "(64, 32)" in msg and "(80, 32)" in msg


def test_more_layers_in_weights_than_in_config(good_dir):
    edit_config(good_dir, num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"tensor model.layers.1.\S+ belongs to a layer beyond num_hidden_layers=1"):
        load_qwen3(good_dir)


@pytest.mark.parametrize("key,value,expected", [
    ("hidden_size", "wide", "config.json.hidden_size: expected an integer"),
    ("num_key_value_heads", 3, "config.json.num_key_value_heads"),
    ("num_hidden_layers", 0, "config.json.num_hidden_layers: must be > 0"),
    ("rms_norm_eps", -1.0, "config.json.rms_norm_eps: must be > 0"),
])
def test_bad_config_value_names_the_key(good_dir, key, value, expected):
    edit_config(good_dir, **{key: value})
    with pytest.raises(ConfigError, match=expected):
        load_qwen3(good_dir)


def test_safetensors_cut_in_half_names_file_tensor_and_truncation(good_dir):
    path = good_dir / "model.safetensors"
    header, start = st.read_header(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    cut = len(data) // 2 - start  # bytes of the data section left
    first = min((v["data_offsets"][1], k) for k, v in header.items()
                if k != "__metadata__" and v["data_offsets"][1] > cut)[1]
    with pytest.raises(ModelFileError) as e:
        load_qwen3(good_dir)
    msg = str(e.value)
    assert msg.startswith(f"{path}: tensor {first} needs bytes ") and msg.endswith(
        f"which holds only {cut}: the file is truncated")
    path.write_bytes(data[: start - 10])  # inside the header
    with pytest.raises(ModelFileError, match="the header claims .* bytes but the file has .*: the file is truncated"):
        st.SafetensorsFile(path)


@pytest.mark.parametrize("entry,expected", [
    ({"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}, "20 bytes do not hold shape [2, 3] of F32"),
    ({"dtype": "F32", "shape": [2, -3], "data_offsets": [0, 24]}, "is not a list of non-negative integers"),
    ({"dtype": "F32", "shape": [6], "data_offsets": [8, 0]}, "is not [begin, end] with 0 <= begin <= end"),
    ({"dtype": "F32", "shape": [6]}, "is not [begin, end]"),
    ("F32", "header entry needs 'dtype', 'shape' and 'data_offsets'"),
])
def test_safetensors_header_entries_are_checked_against_the_file(tmp_path, entry, expected):
    blob = json.dumps({"w": entry}).encode()
    (tmp_path / "x.safetensors").write_bytes(len(blob).to_bytes(8, "little") + blob + bytes(24))
    with pytest.raises(ModelFileError) as e:
        st.SafetensorsFile(tmp_path / "x.safetensors")
    assert str(e.value).startswith(f"{tmp_path / 'x.safetensors'}: tensor w") and expected in str(e.value)


def test_config_json_field_types_name_the_file(good_dir):
    for key, value, expected in (("eos_token_id", "end", "config.json.eos_token_id: expected int | list[int], got 'end'"),
                                 ("vocab_size", True, "config.json.vocab_size: expected an integer, got True"),
                                 ("rope_parameters", {"rope_type": "default", "rope_theta": float("inf")},
                                  "config.json.rope_theta: must be > 0 and finite"),
                                 ("hidden_size", "32", "config.json.hidden_size: expected an integer, got '32'")):
        edit_config(good_dir, **{key: value})
        with pytest.raises(ConfigError) as e:
            load_qwen3(good_dir)
        assert str(e.value).startswith(f"{good_dir / 'config.json'}: ") and expected in str(e.value)
        save_qwen3(init_model(TIED, seed=0), good_dir)
    (good_dir / "config.json").write_bytes(b'{"model_type": "qwen3", \xff}')
    with pytest.raises(ConfigError, match="config.json: not valid JSON"):
        load_qwen3(good_dir)


def test_export_refuses_non_finite_weights(tmp_path):
    from d3d_jax.io.checkpoint import save_params

    model = init_model(TIED, seed=0)
    w = model.layers.mlp.up_proj.kernel  # stacked: layer 1's rows
    w[...] = w[...].at[1, 3, 5].set(jnp.nan).at[1, 0, 0].set(jnp.inf)
    for save in (save_qwen3, save_params):
        with pytest.raises(NonFiniteError, match=r"not exported: parameter layers.1.mlp.up_proj.kernel has 2 "
                                                 r"NaN/inf values of 2048"):
            save(model, tmp_path / save.__name__)
        assert not (tmp_path / save.__name__).exists()  # refused before anything was written


def test_no_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TIED.to_hf_dict()))
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_qwen3(tmp_path)


def test_save_rejects_bad_dtype(tmp_path):
    with pytest.raises(ConfigError, match="dtype"):
        save_qwen3(init_model(TIED), tmp_path, dtype="int8")


# ---- tokenizer and MASK ---------------------------------------------------------------------
def build_tokenizer_dir(path, words):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>"] + words)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<eos>").save_pretrained(path)
    return len(vocab)


def test_load_tokenizer_adds_mask_at_first_unused_id(tmp_path):
    n = build_tokenizer_dir(tmp_path / "tok", ["the", "cat", "sat"])
    tok, mask_id = load_tokenizer(tmp_path / "tok")
    assert mask_id == n
    assert tok.convert_ids_to_tokens(mask_id) == "<|MASK|>"
    assert tok("the <|MASK|> sat")["input_ids"] == [2, mask_id, 4]
    assert mask_id in tok.all_special_ids
    # a tokenizer saved with the token keeps its id
    save_qwen3(init_model(TIED), tmp_path / "tok2", tokenizer=tok)  # saved beside the weights
    tok2, mask_id2 = load_tokenizer(tmp_path / "tok2")
    assert mask_id2 == mask_id and len(tok2) == len(tok)
    with pytest.raises(ModelFileError, match="not a tokenizer directory"):
        load_tokenizer(tmp_path / "nowhere")
    # a directory without tokenizer files is refused (AutoTokenizer would build a near-empty one)
    with pytest.raises(ModelFileError, match=r"no tokenizer here \(none of tokenizer.json"):
        load_tokenizer(tmp_path)
    # the tokenizer's vocabulary must fit the model's (checked before <|MASK|> is added)
    assert load_tokenizer(tmp_path / "tok", vocab_size=n)[1] == n
    with pytest.raises(ModelFileError, match=rf"has {n} tokens but the model's vocab_size is {n - 1}"):
        load_tokenizer(tmp_path / "tok", vocab_size=n - 1)


def test_mask_id_inside_padded_embedding_needs_no_resize():
    # Qwen3's case: the tokenizer ends below the (padded) embedding size.
    model = init_model(TIED)
    fitted = ensure_token_fits(model, 90, block_size=16)
    assert fitted.config.vocab_size == 96 and fitted.config.mask_token_id == 90
    assert fitted.config.block_size == 16
    assert fitted.embed_tokens.embedding[...] is model.embed_tokens.embedding[...]


@pytest.mark.parametrize("cfg", [TIED, UNTIED], ids=["tied", "untied"])
def test_mask_id_beyond_vocab_resizes_embedding(cfg):
    model = init_model(cfg, seed=5)
    new_id = cfg.vocab_size + 3
    grown = ensure_token_fits(model, new_id, multiple=8)
    v = grown.config.vocab_size
    assert v % 8 == 0 and v > new_id and grown.config.mask_token_id == new_id
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 10)))
    before = np.asarray(forward(model, tokens))
    after = np.asarray(forward(grown, tokens))
    # old tokens' logits over the old vocabulary are unchanged
    assert np.abs(after[..., :cfg.vocab_size] - before).max() <= 1e-6
    # the new rows are the mean embedding
    emb = np.asarray(grown.embed_tokens.embedding[...])
    np.testing.assert_allclose(emb[new_id], emb[:cfg.vocab_size].mean(0), atol=1e-6)
    # the grown model can embed the new id
    out = np.asarray(forward(grown, jnp.asarray([[1, new_id]])))
    assert out.shape == (1, 2, v) and np.isfinite(out).all()


# ---- the tokenizer loads without AutoTokenizer where AutoTokenizer would pick the same class -----
DEMO = __import__("pathlib").Path(__file__).resolve().parents[1] / "artifacts" / "demo"
TEXTS = ["to be or not to be", "<|im_start|>user\nhi<|im_end|>\n", "héllo  wörld\n\n\t!", "<|MASK|><|MASK|>x", ""]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "to be?"},
        {"role": "assistant", "content": "or not"}, {"role": "user", "content": "héllo"}]


@pytest.mark.parametrize("where", ["models/target", "drafters/small", "tokenizer"])
def test_the_demo_tokenizers_load_directly_and_behave_as_autotokenizers(where):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from d3d_jax.io.hf import _tokenizer_loader, open_tokenizer

    path = DEMO / where
    assert _tokenizer_loader(path) is PreTrainedTokenizerFast  # the import-free path is the one taken
    ours, ref = open_tokenizer(path), AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    assert type(ours) is type(ref) and len(ours) == len(ref) and ours.get_vocab() == ref.get_vocab()
    assert (ours.special_tokens_map, ours.all_special_ids, ours.chat_template, ours.model_max_length,
            ours.padding_side) == (ref.special_tokens_map, ref.all_special_ids, ref.chat_template,
                                   ref.model_max_length, ref.padding_side)
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), text
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert ours(TEXTS, padding=True)["input_ids"] == ref(TEXTS, padding=True)["input_ids"]
    if ref.chat_template is not None:
        for kw in ({"add_generation_prompt": True}, {"add_generation_prompt": True, "enable_thinking": False}, {}):
            want = ref.apply_chat_template(CHAT, tokenize=False, **kw)
            assert ours.apply_chat_template(CHAT, tokenize=False, **kw) == want and "to be?" in want
    mask_tok, mask_id = load_tokenizer(path)  # the demo tokenizers have <|MASK|>: its id, nothing added
    assert mask_id == ref.convert_tokens_to_ids("<|MASK|>") == 3 and len(mask_tok) == len(ref)


def test_other_tokenizer_directories_still_go_through_autotokenizer(tmp_path):
    from transformers import AutoTokenizer

    from d3d_jax.io.hf import _tokenizer_loader

    for name in ("qwen2", "plain", "remote", "badconfig"):
        d = tmp_path / name
        d.mkdir()
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (d / f).write_bytes((DEMO / "models/target" / f).read_bytes())
    (tmp_path / "qwen2/config.json").write_text('{"model_type": "qwen2"}')  # AutoTokenizer overrides the class
    cfg = json.loads((DEMO / "models/target/tokenizer_config.json").read_text())
    (tmp_path / "plain/tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "Qwen2Tokenizer"}))
    (tmp_path / "remote/tokenizer_config.json").write_text(json.dumps({**cfg, "auto_map": {"AutoTokenizer": ["x.Y", None]}}))
    (tmp_path / "badconfig/config.json").write_text("{")
    assert all(_tokenizer_loader(tmp_path / n) is AutoTokenizer for n in ("qwen2", "plain", "remote", "badconfig"))


# ---- weights checked as they load -------------------------------------------------------------
def _rewrite(path, change):
    """The safetensors file at ``path`` with ``change(header, data)`` applied to its header and bytes."""
    header, start = st.read_header(path)
    data = bytearray(path.read_bytes()[start:])
    change(header, data)
    blob = json.dumps(header).encode()
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + bytes(data))


@pytest.mark.parametrize("on_host", [True, False], ids=["read-on-host", "device-program"])
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "per-layer"])
@pytest.mark.parametrize("name,value", [("model.norm.weight", np.nan),
                                        ("model.layers.1.self_attn.k_norm.weight", np.inf),
                                        ("model.layers.0.mlp.down_proj.weight", -np.inf)])
def test_a_non_finite_weight_is_refused_naming_file_and_tensor(good_dir, stacked, name, value, on_host,
                                                                 monkeypatch):
    """Was: a NaN in one element of a norm weight loaded and decoded to token 0, exit 0.  Both
    ways of looking: weights in host memory read there, elsewhere by one device program."""
    from d3d_jax.io import weight_checks

    monkeypatch.setattr(weight_checks, "_on_host", lambda x: on_host)
    monkeypatch.setattr(weight_checks, "HOST_CHUNK", 3)  # the bad fourth element in a later chunk
    path = good_dir / "model.safetensors"

    def poison(header, data):
        begin = header[name]["data_offsets"][0] + 4 * 3  # float32: the fourth element
        data[begin:begin + 4] = np.float32(value).tobytes()

    _rewrite(path, poison)
    with pytest.raises(ModelFileError) as e:
        load_qwen3(good_dir, stacked=stacked)
    assert str(e.value).startswith(f"{path}: tensor {name} has 1 NaN/inf values of ") and "\n" not in str(e.value)


@pytest.mark.parametrize("stored,label", [("bfloat16", "I16"), ("float16", "I16"), ("float32", "I32")])
def test_a_float_tensor_relabelled_as_integers_is_refused_not_cast(tmp_path, stored, label):
    """Was: bf16 bytes relabelled I16 (same byte count, so the header's sizes agree) loaded as
    integers cast to float (mean |w| 16,384 against 0.03), exit 0."""
    save_qwen3(init_model(TIED, seed=0), tmp_path / "m", dtype=stored)
    path, name = tmp_path / "m" / "model.safetensors", "model.layers.1.mlp.up_proj.weight"
    _rewrite(path, lambda header, data: header[name].update(dtype=label))
    with pytest.raises(ModelFileError) as e:
        load_qwen3(tmp_path / "m")
    assert str(e.value).startswith(f"{path}: tensor {name} is stored as int{8 * st._DTYPES[label].itemsize}, "
                                   "not a floating-point type"), str(e.value)


def test_weights_gathered_into_numpy_are_checked_on_the_host():
    """An export checks the copy it gathered from the devices, numpy arrays: read where they lie
    (was: an AttributeError on ``is_fully_addressable`` ended a two-process export)."""
    from d3d_jax.io.weight_checks import first_nonfinite

    bad = np.ones((2, 5), np.float32)
    bad[1, 3] = np.nan
    pure = {"embed": np.zeros((4, 3), np.float32), "layers": {"w": bad}}
    found = first_nonfinite(pure)
    assert found is not None and found[0][-1] == "w" and found[2:] == (1, 5)
    assert first_nonfinite({"a": np.zeros(3, np.float32)}) is None
