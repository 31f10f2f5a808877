"""A target split over two devices and a drafter on a third, in every mode: ``infer/generate.py``
and ``infer/serve.py`` (subprocesses with four host devices; the server in sync) give transformers' greedy tokens
and its prompt log-probabilities, with each device holding about half of the target's weights."""

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from d3d_jax.config import ModelConfig
from d3d_jax.demo.tokenizer import train_tokenizer
from d3d_jax.io.checkpoint import save_params
from d3d_jax.io.hf import load_tokenizer
from d3d_jax.model.qwen3 import init_model

ROOT = Path(__file__).resolve().parent.parent
VOCAB, N_NEW = 320, 10
PROMPTS = [[5, 9, 14, 3, 77, 21], [40, 41, 42]]
SPLIT = ["--target-devices", "2", "--drafter-devices", "1"]


def _env() -> dict:
    """Four host devices (the session's other XLA flags kept), this checkout's code."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count=4"])
    return env


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    target_dir = tmp_path_factory.mktemp("split-target")
    train_tokenizer(["to be or not to be, that is the question", "all the world's a stage"] * 20, 300, target_dir)
    _, mask_id = load_tokenizer(target_dir)
    torch.manual_seed(3)
    # 4 heads over 2 KV heads: both split over the two devices of the target's slice
    hf = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6})).eval()
    with torch.no_grad():  # weights large enough that greedy outputs vary (the default init repeats a token)
        for name, p in hf.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.3)
    hf.save_pretrained(target_dir)
    drafter_dir = tmp_path_factory.mktemp("split-drafter")
    save_params(init_model(ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=1,
                                       num_heads=2, num_kv_heads=1, head_dim=16, mask_token_id=mask_id,
                                       block_size=4), 3), drafter_dir)
    return dict(hf=hf, target=target_dir, drafter=drafter_dir)


def _hf_greedy(hf, prompt):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=N_NEW, min_new_tokens=N_NEW,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


_DRIVER = """
import contextlib, importlib.util, io, json, sys
spec = importlib.util.spec_from_file_location("generate_cli", "infer/generate.py")
cli = importlib.util.module_from_spec(spec); spec.loader.exec_module(cli)
for argv in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.main(argv)
    print(json.dumps([json.loads(line) for line in out.getvalue().splitlines()]), flush=True)
"""


def test_generate_in_every_mode_on_a_split_gives_the_greedy_tokens(dirs):
    base = ["--target", str(dirs["target"]), "--max-new-tokens", str(N_NEW), "--ignore-eos", "--json",
            "--compile-cache", "none", *[a for p in PROMPTS for a in ("--prompt-ids", ",".join(map(str, p)))]]
    runs = {mode: base + ["--mode", mode] + ([] if mode == "plain" else ["--drafter", str(dirs["drafter"])]) + SPLIT
            for mode in ("plain", "sync", "auto", "async")}
    # one process for the four runs: the programs of one mode are reused by the next
    out = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(list(runs.values()))], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    results = dict(zip(runs, (json.loads(line) for line in out.stdout.splitlines())))
    expected = [_hf_greedy(dirs["hf"], p) for p in PROMPTS]
    assert len(set(map(tuple, expected))) == 2 and all(len(set(e)) > 2 for e in expected)  # outputs vary
    for mode, rows in results.items():
        assert [r["token_ids"] for r in rows] == expected, mode
        r = rows[0]
        assert r["target_devices"] == 2, mode
        # async: the drafter on its own device; sync and auto run it in the target's programs
        assert r["drafter_devices"] == {"plain": 0, "async": 1}.get(mode, 2), mode
        assert r["target_param_bytes_per_device"] <= 0.6 * r["target_param_bytes"], mode


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def test_server_on_a_split_serves_greedy_tokens_and_scores_prompts(dirs):
    """Sync (the fastest mode; generate's test above covers async's own slice too)."""
    from d3d_jax.bench.serve import ServerProcess

    mode = "sync"
    server = ServerProcess(["--target", str(dirs["target"]), "--drafter", str(dirs["drafter"]), "--mode", mode,
                            "--dtype", "float32", "--num-slots", "2", "--max-model-len", "64",
                            "--warmup-max-prompt", "0", "--compile-cache", "none", "--served-model-name", "x", *SPLIT],
                           timeout_s=600, env=_env())
    try:
        assert "target_devices=2 drafter_devices=2 " in server.ready  # sync: the drafter in the target's programs
        for prompt in PROMPTS:
            expected = _hf_greedy(dirs["hf"], prompt)
            got = _post(server.url, dict(model="x", prompt=prompt, max_tokens=N_NEW, temperature=0,
                                         ignore_eos=True, return_token_ids=True))["choices"][0]
            assert got["token_ids"] == expected
            # the prompt scored by the target the decoder holds (its slice's copy, not a second one)
            scored = _post(server.url, dict(model="x", prompt=prompt + expected, echo=True,
                                            logprobs=0, max_tokens=0))["choices"][0]["logprobs"]["token_logprobs"]
            with torch.no_grad():
                full = torch.tensor([prompt + expected])
                ref = torch.log_softmax(dirs["hf"](full).logits[0].float(), -1)
            want = [float(ref[i - 1, t]) for i, t in enumerate(full[0].tolist()) if i]
            np.testing.assert_allclose(scored[1:], want, rtol=1e-4, atol=1e-4)
    finally:
        server.stop()


def test_decoder_and_prompt_scorer_read_the_loaded_split_in_place(dirs):
    """Loaded onto the split's meshes, the target is the decoder's and the scorer's very arrays:
    no device holds a second copy (no compile: nothing runs)."""
    import jax
    from flax import nnx

    from d3d_jax.decoding import engine
    from d3d_jax.io.checkpoint import load_decoding_model
    from d3d_jax.parallel.sharding import bytes_per_device, model_meshes
    from d3d_jax.serving.scoring import PromptScorer, decoder_params

    t_mesh, _ = model_meshes("plain", 2, 1)
    target = load_decoding_model(dirs["target"], mesh=t_mesh)
    loaded = jax.tree.leaves(nnx.state(target))
    dec = engine.make_decoder(target, mode="plain", num_slots=1, max_cache_len=32, target_devices=2,
                              drafter_devices=1)
    placed = dec.param_leaves()[0]
    assert len(placed) == len(loaded) and all(a is b for a, b in zip(placed, loaded))
    scorer = PromptScorer(target, 16, params=decoder_params(dec, target))
    assert all(a is b for a, b in zip(jax.tree.leaves(scorer.params), loaded))
    assert {d.id for x in loaded for d in x.sharding.device_set} == {0, 1}
    assert bytes_per_device(loaded) <= 0.6 * sum(x.nbytes for x in loaded)
