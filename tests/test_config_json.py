"""config.json honoured or refused (d3d_jax/config/hf_config.py, config/rope.py, model/rope.py):
every field that changes the maths gives transformers' logits, or one line naming the field.

The reference is transformers' own ``Qwen3ForCausalLM`` built from the same dict (weights drawn
large enough that a wrong frequency moves the logits far past the tolerance).  The fuzz mutates
every such field (each one at least once per run, then random pairs and triples), seeded; a
mutant transformers cannot build must be refused by us too.
"""
import json
import random

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from d3d_jax.config import ConfigError, ModelConfig
from d3d_jax.io.hf import build_from_tensors

TOL = 1e-4
SEED = 21
BASE = dict(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=48,
            rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, attention_bias=False,
            attention_dropout=0.0, hidden_act="silu", use_sliding_window=False, sliding_window=None,
            max_window_layers=28, layer_types=["full_attention"])
LENGTH = 64  # past max_position_embeddings and every original_max_position_embeddings below
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


class DictTensors:
    """A transformers state dict behind the loader's ``keys/shape/get`` interface."""

    def __init__(self, state_dict):
        self.arrays = {k: v.detach().float().numpy() for k, v in state_dict.items()}

    def keys(self):
        return self.arrays.keys()

    def __contains__(self, name):
        return name in self.arrays

    def shape(self, name):
        return self.arrays[name].shape

    def get(self, name):
        return self.arrays[name]


def transformers_logits(hf: dict, tokens: np.ndarray):
    """``(logits, model)`` of transformers' Qwen3 for ``hf``, or ``(exception, None)``."""
    try:
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(Qwen3Config(**json.loads(json.dumps(hf)))).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(1 + 0.5 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
            return model(torch.tensor(tokens), use_cache=False).logits.numpy(), model
    except Exception as e:  # transformers raises many types for a config it cannot build
        return e, None


def ours_logits(hf: dict, model, tokens: np.ndarray) -> np.ndarray:
    ours = build_from_tensors(ModelConfig.from_hf_dict(json.loads(json.dumps(hf))), DictTensors(model.state_dict()))
    return np.asarray(ours(jnp.asarray(tokens)))


def _tokens(vocab: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, vocab, (1, LENGTH))


def _plain_rope(hf: dict) -> dict:
    out = {k: v for k, v in hf.items() if k != "rope_scaling"}
    out["rope_parameters"] = {"rope_type": "default", "rope_theta": hf.get("rope_theta", 10000.0)}
    return out


ROPE_FORMS = {
    "yarn via rope_scaling beside a default rope_parameters (Qwen3's long-context instructions)": {"rope_scaling": YARN},
    "yarn via rope_parameters": {"rope_parameters": {**YARN, "rope_theta": 10000.0}},
    "yarn with mscale, beta and no truncation": {"rope_scaling": {
        "rope_type": "yarn", "factor": 8, "mscale": 0.7, "mscale_all_dim": 1.0, "beta_fast": 16,
        "truncate": False, "original_max_position_embeddings": 16}},
    "yarn factor from the context ratio": {"rope_parameters": {"rope_type": "yarn", "factor": None,
                                                               "original_max_position_embeddings": 12}},
    "legacy type key, linear": {"rope_scaling": {"type": "linear", "factor": 2}},
    "dynamic NTK beyond the context": {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
    "llama3": {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16}},
    "longrope past its original length": {"rope_parameters": {
        "rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 3.0, 4.0, 6.0],
        "original_max_position_embeddings": 24}},
}


@pytest.mark.parametrize("name", list(ROPE_FORMS))
def test_every_rope_scaling_form_gives_transformers_logits(name):
    hf = {**BASE, **ROPE_FORMS[name]}
    tokens = _tokens(hf["vocab_size"])
    want, model = transformers_logits(hf, tokens)
    got = ours_logits(hf, model, tokens)
    assert np.abs(got - want).max() <= TOL, np.abs(got - want).max()
    # and the scaling matters here: plain RoPE is far off (what the loader used to do)
    plain = build_from_tensors(ModelConfig.from_hf_dict(_plain_rope(hf)), DictTensors(model.state_dict()))
    assert np.abs(np.asarray(plain(jnp.asarray(tokens))) - want).max() > 100 * TOL


def test_yarn_export_reloads_in_transformers_as_yarn(tmp_path):
    from d3d_jax.io.hf import load_qwen3, save_qwen3

    hf = {**BASE, "rope_scaling": YARN}
    tokens = _tokens(hf["vocab_size"])
    want, model = transformers_logits(hf, tokens)
    ours = build_from_tensors(ModelConfig.from_hf_dict(hf), DictTensors(model.state_dict()))
    save_qwen3(ours, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())["rope_parameters"]
    assert written["rope_type"] == "yarn" and written["factor"] == 4.0
    again = Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        assert np.abs(again(torch.tensor(tokens), use_cache=False).logits.numpy() - want).max() <= TOL
    assert load_qwen3(tmp_path).config.rope_scaling == ours.config.rope_scaling


@pytest.mark.parametrize("changes, field", [
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rope_scaling": YARN, "rope_theta": None},
     "config.json.rope_scaling: replaces rope_parameters"),
    ({"attention_bias": True}, "config.json.attention_bias"),
    ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0, "layer_types": None},
     "config.json.use_sliding_window"),
    ({"hidden_act": "gelu"}, "config.json.hidden_act"),
    ({"partial_rotary_factor": 0.5}, "config.json.partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}}, "config.json.rope_parameters.rope_type"),
    ({"rope_scaling": {**YARN, "finetuned": True}}, "config.json.rope_scaling.finetuned"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "config.json.rope_parameters.full_attention"),
    ({"vocab_size": 64.0}, "config.json.vocab_size: expected an integer"),
    ({"eos_token_id": 99999}, "config.json.eos_token_id: 99999 is outside the vocabulary"),
    ({"quantization_config": {"quant_method": "fp8"}}, "config.json.quantization_config"),
])
def test_what_is_not_computed_is_refused_naming_the_field(changes, field):
    hf = {k: v for k, v in {**BASE, **changes}.items() if v is not None}
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf_dict(hf)
    assert str(e.value).startswith(field) and "\n" not in str(e.value), str(e.value)


def test_absent_fields_take_transformers_defaults():
    hf = {k: v for k, v in BASE.items() if k not in ("head_dim", "max_position_embeddings", "rope_theta",
                                                     "rope_parameters")}
    cfg = ModelConfig.from_hf_dict(hf)
    want = Qwen3Config(**hf)
    assert (cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta) == (
        want.head_dim, want.max_position_embeddings, want.rope_parameters["rope_theta"]) == (128, 32768, 10000.0)


# ---- the fuzz ------------------------------------------------------------------------------
_LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 3.0, 4.0, 6.0],
             "original_max_position_embeddings": 24}
ROPE_VALUES = [
    {"rope_type": "default", "rope_theta": 500.0}, {"rope_type": "linear", "factor": 3.0},
    {"rope_type": "linear"}, {"rope_type": "linear", "factor": 0.5}, {"rope_type": "dynamic", "factor": 2},
    YARN, {**YARN, "attention_factor": 1.3, "beta_slow": 2}, {"rope_type": "yarn", "factor": 2.0},
    {**YARN, "factor": "4"}, {**YARN, "truncate": "no"}, _LONGROPE, {**_LONGROPE, "short_factor": [1.0, 2.0]},
    {**_LONGROPE, "factor": 4.0}, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
    {"rope_type": "nope"}, {"type": "linear", "factor": 2.0}, {}, None, "yarn", [1], {**YARN, "extra": 1},
    {"rope_type": "default", "partial_rotary_factor": 0.5},
]
# Every config.json field that changes the maths, with values to try (valid and not).
SCHEMA = {
    "vocab_size": [64, 80, 0, -3, 64.0, "64", None, True],
    "hidden_size": [32, 40, 0, 32.0, None],
    "intermediate_size": [48, 20, 0, -1, 48.5],
    "num_hidden_layers": [1, 2, 0, None, 1.0],
    "num_attention_heads": [4, 2, 8, 3, 0],
    "num_key_value_heads": [2, 1, 4, 3, None, 0],
    "head_dim": [8, 4, 16, 6, 7, 2, None, "<delete>"],
    "max_position_embeddings": [48, 16, 512, 0, "<delete>"],
    "rms_norm_eps": [1e-6, 1e-3, 0.5, 0.0, 1, "1e-6", None],
    "tie_word_embeddings": [True, False, 1, "true"],
    "rope_theta": [10000.0, 1e6, 50.0, 1, 0.0, -1.0, "1e4", None, "<delete>"],
    "rope_parameters": ROPE_VALUES,
    "rope_scaling": ROPE_VALUES,
    "partial_rotary_factor": [1.0, 0.5],
    "original_max_position_embeddings": [16, 40],
    "attention_bias": [False, True, 0],
    "attention_dropout": [0.0, 0.1, 0],
    "hidden_act": ["silu", "gelu", None],
    "use_sliding_window": [False, True],
    "sliding_window": [4, None, 1000, "a"],
    "max_window_layers": [0, 1, 28, None],
    "layer_types": [["full_attention"], ["sliding_attention"], ["full_attention"] * 2, "full", None],
    "quantization_config": [{"quant_method": "fp8"}, None],
    "model_type": ["qwen3", "llama"],
}
PAIRS, TRIPLES = 10, 6


def mutants(rng: random.Random) -> list[dict]:
    """Each field once with a random value, then random pairs and triples of fields."""
    fields = list(SCHEMA)
    groups = [[f] for f in fields] + [rng.sample(fields, 2) for _ in range(PAIRS)] + [
        rng.sample(fields, 3) for _ in range(TRIPLES)]
    out = []
    for group in groups:
        hf = json.loads(json.dumps(BASE))
        for f in group:
            value = rng.choice(SCHEMA[f])
            if value == "<delete>":
                hf.pop(f, None)
            else:
                hf[f] = json.loads(json.dumps(value))
        out.append((group, hf))
    return out


def check_mutant(group: list[str], hf: dict) -> str:
    """``"equal"`` or ``"refused"``; an AssertionError for anything else."""
    vocab = hf.get("vocab_size") if isinstance(hf.get("vocab_size"), int) and hf.get("vocab_size", 0) > 0 else 64
    tokens = _tokens(vocab)
    want, model = transformers_logits(hf, tokens)
    try:
        got = ours_logits(hf, model, tokens) if model is not None else ModelConfig.from_hf_dict(hf)
    except ConfigError as e:
        msg = str(e)
        assert "\n" not in msg and (msg.startswith("config.json.") or msg.startswith("model_type")), (group, msg)
        return "refused"
    assert model is not None, (group, hf, "transformers cannot build it, but it was accepted:", want)
    assert got.shape == want.shape and np.abs(got - want).max() <= TOL, (group, np.abs(got - want).max())
    return "equal"


def test_fuzz_config_json_fields_against_transformers():
    rng = random.Random(SEED)
    outcomes = {"equal": 0, "refused": 0}
    for group, hf in mutants(rng):
        outcomes[check_mutant(group, hf)] += 1
    assert min(outcomes.values()) >= 8, outcomes  # the mutations reach both outcomes


def test_yarn_extends_the_context_the_length_checks_allow():
    yarn = ModelConfig.from_hf_dict({**BASE, "max_position_embeddings": 40, "rope_scaling": YARN})
    assert yarn.context_length == 4 * 16 == 64  # factor × original length, past max_position_embeddings
    assert ModelConfig.from_hf_dict(BASE).context_length == 48
