"""The decoding engine against independent references.

Greedy: plain and sync decoding reproduce transformers' ``generate(do_sample=False)`` token for
token (weights written by transformers, read by our loader) at batch 1 and 4, prompts of mixed
lengths, with three drafters.  Sampling: the joint law of the first 3 generated tokens, computed
exactly by enumerating every prefix, is what plain and sync sampling produce (χ² goodness of fit),
and the same test rejects deliberately wrong acceptance rules.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from scipy import stats
from transformers import Qwen3Config, Qwen3ForCausalLM

from d3d_jax.config import ModelConfig
from d3d_jax.decoding import verify as V
from d3d_jax.decoding.engine import ReplayDrafter, SamplingParams
from d3d_jax.bench.generator import Generator

generate = Generator()
from d3d_jax.io.hf import load_qwen3
from d3d_jax.model.qwen3 import init_model

VOCAB = 256
MASK_ID = VOCAB - 1
N_NEW = 24
BLOCK = 6
N_PROMPTS = 8  # the three extremes and five random lengths: batch 4 runs two full batches


@pytest.fixture(scope="module")
def greedy_setup(tmp_path_factory):
    torch.manual_seed(0)
    hf_cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         tie_word_embeddings=False, max_position_embeddings=256, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    hf = Qwen3ForCausalLM(hf_cfg).eval()
    path = tmp_path_factory.mktemp("target")
    hf.save_pretrained(path)
    target = load_qwen3(path)
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 13, N_PROMPTS)
    lengths[:3] = (1, 12, 5)  # the extremes are always present
    prompts = [rng.integers(0, MASK_ID, n).tolist() for n in lengths]
    refs = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              do_sample=False, max_new_tokens=N_NEW, min_new_tokens=N_NEW,
                              eos_token_id=None, pad_token_id=0)
            refs.append(out[0, len(p):].tolist())
    assert all(len(r) == N_NEW for r in refs)
    assert len({tuple(r) for r in refs}) == N_PROMPTS  # the weights give varied outputs
    drafter_cfg = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=1,
                              num_heads=2, num_kv_heads=1, head_dim=16, tie_word_embeddings=False,
                              mask_token_id=MASK_ID)
    drafters = {
        "random_model": init_model(drafter_cfg, seed=7),
        "replay_right": ReplayDrafter(refs, VOCAB, error_rate=0.0),
        "replay_70pct": ReplayDrafter(refs, VOCAB, error_rate=0.3, seed=1),
    }
    return dict(hf=hf, target=target, prompts=prompts, refs=refs, drafters=drafters)


@pytest.mark.parametrize("batch_size", [1, 4])
def test_plain_greedy_matches_transformers(greedy_setup, batch_size):
    s = greedy_setup
    outs = generate(s["target"], s["prompts"], max_new_tokens=N_NEW, batch_size=batch_size)
    assert [o.token_ids for o in outs] == s["refs"]
    assert all(o.finish_reason == "length" and o.metrics["tau"] == 1.0 for o in outs)


@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize("drafter", ["random_model", "replay_right", "replay_70pct"])
def test_sync_greedy_matches_transformers(greedy_setup, drafter, batch_size):
    s = greedy_setup
    outs = generate(s["target"], s["prompts"], mode="sync", drafter=s["drafters"][drafter],
                    max_new_tokens=N_NEW, batch_size=batch_size, block_size=BLOCK)
    assert [o.token_ids for o in outs] == s["refs"]
    hist = np.sum([o.metrics["accept_hist"] for o in outs], axis=0)
    tau = (hist * np.arange(1, BLOCK + 1)).sum() / hist.sum()
    if drafter == "replay_right":  # 24 tokens = 4 full blocks per prompt
        assert all(o.metrics["tau"] == BLOCK and o.metrics["rounds"] == N_NEW // BLOCK for o in outs)
    elif drafter == "replay_70pct":  # E[τ] = Σ_{k<B} 0.7^k ≈ 2.94 before truncation
        assert 2.3 < tau < 3.6, tau
    else:
        assert tau < 1.5, tau


def test_host_loop_equals_fused_loop_and_times_phases(greedy_setup):
    s = greedy_setup
    prompts, refs = s["prompts"][:4], s["refs"][:4]
    outs = generate(s["target"], prompts, mode="sync", drafter=s["drafters"]["replay_70pct"],
                    max_new_tokens=N_NEW, block_size=BLOCK, loop="host")
    assert [o.token_ids for o in outs] == refs
    assert outs[0].metrics["draft_s"] > 0 and outs[0].metrics["verify_s"] > 0


def _cut_at(tokens, stops):
    """Brute force: a continuation as one-token-at-a-time decoding ends it at the first stop id."""
    for j, t in enumerate(tokens):
        if t in stops:
            return tokens[: j + 1]
    return tokens


def test_eos_inside_accepted_block_and_length_cut(greedy_setup):
    s = greedy_setup
    # the first 4 prompts at batch 4: same shapes as the greedy tests, so nothing recompiles
    prompts, refs = s["prompts"][:4], s["refs"][:4]
    # an EOS id that first occurs mid-block (not a block's first or last token) in some row
    i, cut = next((i, j) for i, ref in enumerate(refs) for j in range(2, N_NEW - 2)
                  if j % BLOCK not in (0, BLOCK - 1) and ref[j] not in ref[:j])
    eos = refs[i][cut]
    with torch.no_grad():
        hf_out = s["hf"].generate(torch.tensor([prompts[i]]), do_sample=False, max_new_tokens=N_NEW,
                                  eos_token_id=eos, pad_token_id=0)[0, len(prompts[i]):].tolist()
    assert hf_out == refs[i][: cut + 1]
    expected = [_cut_at(r, {eos}) for r in refs]
    plain = generate(s["target"], prompts, max_new_tokens=N_NEW, eos_token_ids=[eos], batch_size=4)
    sync = generate(s["target"], prompts, mode="sync", drafter=s["drafters"]["replay_right"],
                    max_new_tokens=N_NEW, block_size=BLOCK, eos_token_ids=[eos], batch_size=4)
    assert [o.token_ids for o in plain] == [o.token_ids for o in sync] == expected
    assert sync[i].token_ids == hf_out
    assert plain[i].finish_reason == sync[i].finish_reason == "eos"
    # the EOS was a draft the verifier accepted together with the drafts after it
    assert sync[i].metrics["accept_hist"] == [0] * (BLOCK - 1) + [cut // BLOCK + 1]
    stop = generate(s["target"], prompts, mode="sync", drafter=s["drafters"]["replay_right"],
                    max_new_tokens=N_NEW, block_size=BLOCK, stop_token_ids=[eos], batch_size=4)
    assert stop[i].token_ids == hf_out and stop[i].finish_reason == "stop"
    # max_new_tokens in the middle of an accepted block (same cache length: no recompile)
    short = generate(s["target"], prompts, mode="sync", drafter=s["drafters"]["replay_right"],
                     max_new_tokens=BLOCK + 2, block_size=BLOCK, batch_size=4, max_cache_len=48)
    assert [o.token_ids for o in short] == [r[: BLOCK + 2] for r in refs]
    assert all(o.finish_reason == "length" for o in short)


def test_bad_inputs_fail_clearly(greedy_setup):
    s = greedy_setup
    t, p = s["target"], s["prompts"][:2]
    other = init_model(ModelConfig(vocab_size=VOCAB + 8, hidden_size=32, intermediate_size=64,
                                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                                   mask_token_id=3), 0)
    cases = [
        (dict(mode="sync", drafter=other), "differs from target vocab_size"),
        (dict(max_cache_len=8, block_size=4, prompts=[[1] * 9]), "longer than max_cache_len"),
        (dict(prompts=[[1, 2], []]), "prompt 1 is empty"),
        (dict(mode="sync", drafter=s["drafters"]["replay_right"], block_size=32, max_cache_len=16),
         "block_size 32 is larger than max_cache_len 16"),
        (dict(sampling=SamplingParams(temperature=-0.5)), "temperature must be >= 0"),
        (dict(sampling=SamplingParams(temperature=1.0, top_p=0.0)), "top_p must be in (0, 1]"),
        (dict(sampling=SamplingParams(temperature=1.0, top_p=1.5)), "top_p must be in (0, 1]"),
        (dict(sampling=SamplingParams(temperature=1.0, top_k=-1)), "top_k must be an integer >= 0"),
        (dict(mode="sync"), "needs a drafter"),
        (dict(mode="beam"), "decoder.mode: must be one of"),
        (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
        (dict(prompts=[[VOCAB]]), "outside the vocabulary"),
        (dict(prompts=[]), "prompts is empty"),
        (dict(max_cache_len=20, max_new_tokens=30), "max_cache_len 20 is too small"),
        (dict(mode="sync", drafter=init_model(ModelConfig(vocab_size=VOCAB, hidden_size=32,
                                                          intermediate_size=64, num_layers=1,
                                                          num_heads=2, num_kv_heads=1,
                                                          head_dim=16), 0)),
         "mask_token_id is unknown"),
    ]
    for kw, msg in cases:
        kw = dict(kw)
        prompts = kw.pop("prompts", p)
        with pytest.raises(ValueError) as e:
            generate(t, prompts, **kw)
        assert msg in str(e.value), (kw, str(e.value))


# --------------------------------------------------------------------------------------
# Sampling: distribution of the first 3 tokens (χ² against the exact law)
# --------------------------------------------------------------------------------------
SMALL_V = 6
DRAWS = 8000  # seed 11: the biased rules at p < 1e-250 (power to spare), the right ones 0.12-0.82
PROMPT = [1, 4, 2]
SAMPLING = SamplingParams(temperature=0.9, top_p=0.95, top_k=5)


def _peaky_model(seed: int, scale: float, mask_token_id=None):
    cfg = ModelConfig(vocab_size=SMALL_V, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, tie_word_embeddings=False,
                      mask_token_id=mask_token_id)
    model = init_model(cfg, seed)
    model.lm_head.kernel[...] = model.lm_head.kernel[...] * scale  # sharper, context-dependent p
    return model


@pytest.fixture(scope="module")
def sampling_setup():
    target = _peaky_model(0, 30.0)
    drafter = _peaky_model(5, 30.0, mask_token_id=SMALL_V - 1)
    # exact law: enumerate every 3-token continuation with the whole-sequence forward
    seqs = np.array([PROMPT + list(c) for c in itertools.product(range(SMALL_V), repeat=3)])
    logits = np.asarray(target(jnp.asarray(seqs)))
    probs = np.asarray(V.processed_probs(jnp.asarray(logits), SAMPLING))
    n = len(PROMPT)
    law = np.ones(len(seqs))
    for k in range(3):
        law *= probs[np.arange(len(seqs)), n - 1 + k, seqs[:, n + k]]
    assert np.isclose(law.sum(), 1.0, atol=1e-5)
    return dict(target=target, drafter=drafter, law=law)


def _chi2_pvalue(outs, law) -> float:
    idx = np.array([(o.token_ids[0] * SMALL_V + o.token_ids[1]) * SMALL_V + o.token_ids[2] for o in outs])
    counts = np.bincount(idx, minlength=len(law))
    expected = law * len(outs)
    big = expected >= 5  # pool rare cells so the χ² approximation holds
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    assert counts[law == 0].sum() == 0  # nothing outside the support of top-k/top-p
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


def _draws(s, seed, **kw):
    return generate(s["target"], [PROMPT] * DRAWS, sampling=SAMPLING, max_new_tokens=3, seed=seed,
                    block_size=4, **kw)


def wrong_point_mass_rule(logits, drafts, draft_probs, anchor_pos, row_keys, sampling):
    """Accept d with prob p(d), else resample from p (the correction may repeat d): biased."""
    w = logits.shape[1]
    p = V.processed_probs(logits, sampling)
    positions = anchor_pos[:, None] + 1 + jnp.arange(w, dtype=jnp.int32)[None]
    p_d = jnp.take_along_axis(p[:, : w - 1], drafts[..., None], axis=-1)[..., 0]
    u = V.uniform_keyed(V.position_keys(row_keys, positions[:, : w - 1], V.SALT_ACCEPT))
    accepted = V.leading_true(u < p_d)
    y = V.sample_keyed(V.position_keys(row_keys, positions, V.SALT_TARGET), p)
    return accepted, jnp.take_along_axis(y, accepted[:, None], axis=1)[:, 0]


def wrong_residual_rule(logits, drafts, draft_probs, anchor_pos, row_keys, sampling):
    """min(1, p/q) acceptance but the correction drawn from p instead of norm(max(0, p - q))."""
    return V.verify_sampled(logits, drafts, draft_probs, anchor_pos, row_keys, sampling,
                            residual_fn=lambda p, q: p)


@pytest.mark.parametrize("case", ["plain", "sync_point_mass", "sync_sampled_drafts",
                                  "wrong_point_mass", "wrong_residual"])
def test_first_three_tokens_follow_the_target_law(sampling_setup, case):
    s = sampling_setup
    sync = dict(mode="sync", drafter=s["drafter"])
    kw = {"plain": {},
          "sync_point_mass": sync,
          "sync_sampled_drafts": dict(sync, sample_drafts=True),
          "wrong_point_mass": dict(sync, acceptance_rule=wrong_point_mass_rule),
          "wrong_residual": dict(sync, sample_drafts=True, acceptance_rule=wrong_residual_rule)}[case]
    outs = _draws(s, seed=11, **kw)
    pvalue = _chi2_pvalue(outs, s["law"])
    if case.startswith("wrong"):
        assert pvalue < 1e-6, pvalue  # the test has power against a biased rule
    else:
        assert pvalue > 0.01, pvalue
    if case != "plain":  # drafts were really used: some accepted, some rejected
        hist = np.sum([o.metrics["accept_hist"] for o in outs], axis=0)
        assert hist[0] > 0 and hist[1:].sum() > 0, hist


def test_long_context_uses_attention_span_buckets(greedy_setup):
    """A 256-slot cache is attended in span buckets (128, 256): prompts that start past slot 128
    or cross it while generating still decode exactly like transformers, plain and sync."""
    from d3d_jax.model.kv_cache import span_buckets

    assert span_buckets(256) == (128, 256) and span_buckets(100) == (100,)
    s = greedy_setup
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, MASK_ID, n).tolist() for n in (140, 115)]
    refs = []
    with torch.no_grad():
        for p in prompts:
            out = s["hf"].generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                   do_sample=False, max_new_tokens=N_NEW, min_new_tokens=N_NEW,
                                   eos_token_id=None, pad_token_id=0)
            refs.append(out[0, len(p):].tolist())
    for mode, drafter in (("plain", None), ("sync", s["drafters"]["random_model"])):
        kw = {} if drafter is None else dict(drafter=drafter, block_size=BLOCK)
        outs = generate(s["target"], prompts, mode=mode, max_new_tokens=N_NEW, max_cache_len=256,
                        batch_size=1, **kw)
        assert [o.token_ids for o in outs] == refs, mode
