"""Asynchronous decoding (spec §5) end to end.

References: plain decoding (itself checked against transformers in test_engine) for greedy output;
the exact law of the first 3 tokens (test_engine's χ² helper) for sampling; the sync mode's
acceptance histogram for a model drafter (a hit branch must draft exactly what the sync drafter
would); counted calls for "a miss runs exactly one synchronous draft"; wall-clock timestamps
for the overlap of verify and packed forward on two devices.
"""

import json

import numpy as np
import jax
import pytest

from d3d_jax.config import ConfigError, ModelConfig
from d3d_jax.decoding import async_replay as A
from d3d_jax.decoding.engine import SamplingParams
from d3d_jax.bench.generator import Generator
from d3d_jax.model.qwen3 import init_model
from tiny_models import tiny_configs

generate = Generator()

VOCAB = 32
MASK = VOCAB - 1
BLOCK = 6
N_NEW = 24
N_PROMPTS = 20
BATCH = 4
# χ² sample size (pooled cells keep the approximation valid): at seed 11 async with the right rule
# gives p = 0.063, and with test_engine's biased point-mass rule p = 4e-75 (1e-29 at 1500 draws)
DRAWS = 3000


@pytest.fixture(scope="module")
def setup():
    tcfg, dcfg = tiny_configs(VOCAB, MASK)
    target = init_model(tcfg, seed=0)
    # sharpen the target so greedy output is varied, not a fixed point
    target.embed_tokens.embedding[...] = target.embed_tokens.embedding[...] * 8.0
    drafter = init_model(dcfg, seed=7)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, MASK, int(n)).tolist() for n in rng.integers(1, 10, N_PROMPTS)]
    plain = [o.token_ids for o in generate(target, prompts, mode="plain", max_new_tokens=N_NEW,
                                           batch_size=BATCH)]
    assert all(len(p) == N_NEW for p in plain)
    assert len({tuple(p) for p in plain}) > N_PROMPTS // 2
    return dict(target=target, drafter=drafter, prompts=prompts, plain=plain)


def _async(s, drafter, timeline=None, batch_size=BATCH, prompts=None, **kw):
    kw.setdefault("branch_positions", BLOCK)
    kw.setdefault("branch_fanout", 2)
    return generate(s["target"], prompts or s["prompts"], mode="async", drafter=drafter,
                    max_new_tokens=N_NEW, block_size=BLOCK, batch_size=batch_size,
                    timeline=timeline, **kw)


def _hits(timeline):
    hit = sum(h and a for r in timeline for h, a in zip(r["hit"], r["active"]))
    judged = sum(sum(r["active"]) for r in timeline)
    return hit, judged


@pytest.mark.parametrize("hit_rate", [1.0, 0.0, 0.5], ids=["force_hits", "force_misses", "mixed"])
def test_greedy_replay_async_equals_plain(setup, hit_rate):
    s = setup
    drafter = A.AsyncReplayDrafter(s["plain"], VOCAB, error_rate=0.3, hit_rate=hit_rate, seed=1)
    tl = []
    outs = _async(s, drafter, tl)
    assert [o.token_ids for o in outs] == s["plain"]
    if hit_rate == 0.5:  # and sync with the same drafter agrees (sync == plain: test_engine)
        sync = generate(s["target"], s["prompts"], mode="sync", drafter=drafter,
                        max_new_tokens=N_NEW, block_size=BLOCK, batch_size=BATCH)
        assert [o.token_ids for o in sync] == s["plain"]
    hit, judged = _hits(tl)
    syncs = sum(r["sync_draft"] for r in tl)
    assert judged > 50
    if hit_rate == 1.0:  # C = B: every outcome has a branch, and the coin always anticipates it
        assert hit == judged and syncs == 0
    elif hit_rate == 0.0:
        assert hit == 0 and syncs == sum(any(r["active"]) for r in tl)  # not after a batch's last round
    else:
        assert 0.2 * judged < hit < 0.9 * judged, (hit, judged)
    tau = np.mean([o.metrics["tau"] for o in outs])
    assert 1.5 < tau < BLOCK  # drafts really accepted and rejected
    if "hit_rate" in outs[0].metrics:  # per-request metrics (engine merges the runner's)
        assert abs(np.mean([o.metrics["hit_rate"] for o in outs]) - hit / judged) < 0.2


def test_greedy_model_drafter_async_equals_plain_and_sync(setup):
    """A random model drafter: output identical to plain and sync, and — since each hit branch
    drafts what the sync drafter would from that prefix — the same acceptance history as sync."""
    s = setup
    sync = generate(s["target"], s["prompts"], mode="sync", drafter=s["drafter"],
                    max_new_tokens=N_NEW, block_size=BLOCK, batch_size=BATCH)
    tl = []
    outs = _async(s, s["drafter"], tl, branch_positions=4, branch_fanout=3)
    assert [o.token_ids for o in sync] == s["plain"]
    assert [o.token_ids for o in outs] == s["plain"]
    hit, judged = _hits(tl)
    assert 0 < hit < judged
    # an all-accept hit would shorten the next block; a random drafter never accepts everything
    assert all(max(np.nonzero(o.metrics["accept_hist"])[0]) < BLOCK - 1 for o in sync)
    assert [o.metrics["accept_hist"] for o in outs] == [o.metrics["accept_hist"] for o in sync]


def test_a_miss_runs_exactly_one_sync_draft_and_a_hit_none(setup):
    """The synchronous draft runs on the device under ``lax.cond`` (only when a row missed); the
    branch that drafts also counts (``sync_drafts``), so the count is of drafts really run."""
    s = setup
    # C = 1: only the all-accept branch, so hits shorten the next block (draft_len = B-2)
    drafter = A.AsyncReplayDrafter(s["plain"], VOCAB, error_rate=0.1, hit_rate=0.5, seed=2)
    tl = []
    outs = _async(s, drafter, tl, batch_size=1, prompts=s["prompts"][:3], branch_positions=1)
    assert [o.token_ids for o in outs] == s["plain"][:3]
    per_round = [(r["hit"][0], r["sync_draft"]) for r in tl if r["active"][0]]
    assert any(h for h, _ in per_round) and any(not h for h, _ in per_round)
    assert all(sd == (not h) for h, sd in per_round)
    drafts_run = sum(o.metrics["sync_drafts"] for o in outs)  # batch_size 1: one batch per output
    assert drafts_run == sum(not h for h, _ in per_round)


@pytest.mark.slow
def test_sampling_chi2_async(setup):
    """Sampling: async follows the target's exact law (χ²) and, with position-keyed randomness,
    reproduces plain sampling token for token."""
    import test_engine as TE

    target = TE._peaky_model(0, 30.0)
    drafter = TE._peaky_model(5, 30.0, mask_token_id=TE.SMALL_V - 1)
    import itertools
    import jax.numpy as jnp
    from d3d_jax.decoding import verify as V
    seqs = np.array([TE.PROMPT + list(c) for c in itertools.product(range(TE.SMALL_V), repeat=3)])
    probs = np.asarray(V.processed_probs(target(jnp.asarray(seqs)), TE.SAMPLING), np.float64)
    n = len(TE.PROMPT)
    law = np.prod([probs[np.arange(len(seqs)), n - 1 + k, seqs[:, n + k]] for k in range(3)], axis=0)
    kw = dict(sampling=TE.SAMPLING, max_new_tokens=3, seed=11, block_size=4)
    tl = []
    outs = generate(target, [TE.PROMPT] * DRAWS, mode="async", drafter=drafter,
                    branch_positions=3, branch_fanout=2, timeline=tl, **kw)
    pvalue = TE._chi2_pvalue(outs, law)
    assert pvalue > 0.01, pvalue
    hist = np.sum([o.metrics["accept_hist"] for o in outs], axis=0)
    assert hist[0] > 0 and hist[1:].sum() > 0, hist
    hit, judged = _hits(tl)
    assert 0 < hit < judged
    plain = generate(target, [TE.PROMPT] * DRAWS, mode="plain", **kw)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


@pytest.mark.slow
def test_verify_and_packed_forward_in_flight_together_on_two_devices():
    cfg = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=32, mask_token_id=255)
    target, drafter = init_model(cfg, seed=0), init_model(cfg, seed=1)
    devs = jax.devices()
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8]] * 4
    kw = dict(mode="async", drafter=drafter, max_new_tokens=12, block_size=8, branch_positions=4,
              branch_fanout=2, target_devices=[devs[0]], drafter_devices=[devs[1]])
    generate(target, prompts, **kw)  # compile first: the timed run measures scheduling only
    tl = []
    generate(target, prompts, timeline=tl, **kw)
    assert len(tl) >= 6
    assert all(r["verify_devices"] == {devs[0]} and r["packed_devices"] == {devs[1]} for r in tl)
    # both dispatched before either was ready: [dispatch, ready] intervals overlap
    overlap = [max(r["verify_dispatch"], r["packed_dispatch"]) < min(r["verify_ready"], r["packed_ready"])
               and r["packed_dispatched"] < r["verify_ready"] for r in tl]
    assert np.mean(overlap) >= 0.8, [(r["packed_dispatched"] - r["verify_dispatch"],
                                     r["verify_ready"] - r["verify_dispatch"]) for r in tl]
    # each round's overlap is the intersection of its verify and packed-forward intervals
    for r in tl:
        assert 0.0 <= r["overlap_s"] <= r["packed_ready"] - r["packed_dispatch"] + 1e-9
        assert r["overlap_s"] <= r["verify_ready"] - r["verify_dispatch"] + 1e-9
    # ... and the run reports their share of the packed-forward time: > 0 on disjoint devices,
    # exactly 0 when both share one (the packed forward then starts after the verify)
    m = generate(target, prompts, timeline=[], **kw)[0].metrics
    assert 0.0 < m["overlap_fraction"] <= 1.0 and m["overlap_s"] <= m["packed_s"]
    assert m["verify_devices"] == [str(devs[0])] and m["packed_devices"] == [str(devs[1])]
    shared = {**kw, "target_devices": [devs[0]], "drafter_devices": [devs[0]]}
    generate(target, prompts, **shared)
    assert generate(target, prompts, timeline=[], **shared)[0].metrics["overlap_fraction"] == 0.0


@pytest.mark.parametrize("kw,err,msg", [
    (dict(branch_positions=BLOCK + 1), ConfigError, "branch_positions"),
    (dict(branch_positions=0), ConfigError, "branch_positions"),
    (dict(branch_fanout=0), ConfigError, "branch_fanout"),
    (dict(target_devices="01", drafter_devices="12"), ConfigError, "overlap"),
    (dict(target_devices=5, drafter_devices=5), ConfigError, "devices exist"),
    (dict(sample_drafts=True, sampling=SamplingParams(temperature=1.0)), ValueError, "sample_drafts"),
    (dict(branch_fan_out=2), ValueError, "unknown decoder options"),
])
def test_bad_inputs_fail_clearly(setup, kw, err, msg):
    kw = dict(kw)
    kw.setdefault("branch_positions", 4)
    devs = jax.devices()
    for key in ("target_devices", "drafter_devices"):
        if isinstance(kw.get(key), str):
            kw[key] = [devs[int(c)] for c in kw[key]]
    with pytest.raises(err, match=msg):
        generate(setup["target"], setup["prompts"][:1], mode="async", drafter=setup["drafter"],
                 max_new_tokens=4, block_size=BLOCK, **kw)


def test_generate_cli_async_flags(setup, tmp_path, capsys):
    """infer/generate.py --mode async --branch-positions C --branch-fanout F: same ids as plain;
    a bad C is one clear error."""
    import importlib.util
    from pathlib import Path

    from d3d_jax.errors import UsageError
    from d3d_jax.io.hf import save_qwen3

    spec = importlib.util.spec_from_file_location(
        "generate_cli", Path(__file__).resolve().parent.parent / "infer" / "generate.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    save_qwen3(setup["target"], tmp_path / "t")
    save_qwen3(setup["drafter"], tmp_path / "d", extra_config={"block_size": BLOCK})
    base = ["--target", str(tmp_path / "t"), "--max-new-tokens", "12", "--json", "--ignore-eos"]
    base += sum([["--prompt-ids", ",".join(map(str, p))] for p in setup["prompts"][:3]], [])

    def ids(mode_args):
        capsys.readouterr()
        cli.main(base + mode_args)
        lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
        return [r["token_ids"] for r in lines if "token_ids" in r], [r for r in lines if "metrics" in r]

    plain, _ = ids(["--mode", "plain"])
    asy, recs = ids(["--mode", "async", "--drafter", str(tmp_path / "d"), "--branch-positions", "3",
                     "--branch-fanout", "2"])
    assert asy == plain and len(plain) == 3
    assert recs[0]["metrics"]["n_async"] == BLOCK * ((3 - 1) * 2 + 2)
    with pytest.raises(UsageError, match="branch_positions"):
        cli.main(base + ["--mode", "async", "--drafter", str(tmp_path / "d"), "--branch-positions",
                         str(BLOCK + 1)])
    with pytest.raises(UsageError, match="needs --mode async"):
        cli.main(base + ["--mode", "plain", "--branch-fanout", "2"])


# --------------------------------------------------------------------------------------
# All-accept hits with a real model drafter (constructed weights, exactly predictable)
# --------------------------------------------------------------------------------------
V16, B4 = 16, 4


VOTE = 1.0 + np.arange(V16) / 64.0  # token t's weight in the drafter's vote (no exact ties)


def _majority_models():
    """A target that repeats its input token, and a 1-layer drafter whose every MASK slot predicts
    the token of largest weighted count among those it can see.

    Target: attention and MLP write nothing, so the logits are the one-hot input embedding.
    Drafter: q = k = 0 gives uniform attention over the visible tokens; v (the vote weights) and
    o are diagonal on one-hot embeddings (MASK embeds to 0), so a MASK slot holds the weighted
    counts.  After a prompt ``[a]*k + [x]`` the target emits x forever; the drafter proposes a
    until x outweighs a, then whole blocks: all-accept hits follow."""
    cfg = ModelConfig(vocab_size=V16, hidden_size=V16, intermediate_size=8, num_layers=1,
                      num_heads=1, num_kv_heads=1, head_dim=V16, tie_word_embeddings=False,
                      mask_token_id=V16 - 1)
    eye = np.eye(V16, dtype=np.float32)
    target, drafter = init_model(cfg, 0), init_model(cfg, 1)
    for m in (target, drafter):
        m.embed_tokens.embedding[...] = eye
        m.lm_head.kernel[...] = eye
        m.layers.mlp.down_proj.kernel[...] = 0.0
    target.layers.self_attn.o_proj.kernel[...] = 0.0
    attn = drafter.layers.self_attn  # stacked: [1, ...] (one layer)
    attn.q_proj.kernel[...] = 0.0
    attn.k_proj.kernel[...] = 0.0
    attn.v_proj.kernel[...] = (eye * VOTE)[None, :, None, :]
    attn.o_proj.kernel[...] = eye[None, None]
    drafter.embed_tokens.embedding[...] = eye * (np.arange(V16) < V16 - 1)[:, None]
    return target, drafter


def _expected_rounds(prompt: list[int], n_new: int, asynchronous: bool):
    """(accepted, draft_len) per round for a prompt [a]*k + [x].  The block verified in round j
    (from 1) was drafted seeing k a's and j x's (sync: j-1 committed + the anchor; async: the
    correction branch of round j-1 sees the same), so drafts turn to x in the first round with
    j·w_x > k·w_a; before, each round rejects at the first draft.  Async: after the first
    all-accept hit every block is shortened to B-2 real drafts."""
    a, x, k = prompt[0], prompt[-1], len(prompt) - 1
    turn = int(k * VOTE[a] / VOTE[x]) + 1  # the first round whose drafts are x
    rounds, tokens = [], 0
    while tokens < n_new:
        j = len(rounds) + 1
        if j < turn:
            rounds.append((0, B4 - 1))
        elif j == turn or not asynchronous:
            rounds.append((B4 - 1, B4 - 1))
        else:
            rounds.append((B4 - 2, B4 - 2))
        tokens += rounds[-1][0] + 1
    return rounds


def test_all_accept_hits_with_a_model_drafter():
    target, drafter = _majority_models()
    ks = [1, 2, 3, 5]
    prompts = [[9] * k + [2] if i % 2 == 0 else [12] * k + [5] for i, k in enumerate(ks)]
    n_new = 24
    kw = dict(max_new_tokens=n_new, block_size=B4, batch_size=len(prompts))
    plain = [o.token_ids for o in generate(target, prompts, **kw)]
    assert plain == [[p[-1]] * n_new for p in prompts]
    sync = generate(target, prompts, mode="sync", drafter=drafter, **kw)
    tl = []
    asy = generate(target, prompts, mode="async", drafter=drafter, branch_positions=B4,
                   branch_fanout=2, timeline=tl, **kw)
    assert [o.token_ids for o in sync] == [o.token_ids for o in asy] == plain
    for row, (prompt, s_out, a_out) in enumerate(zip(prompts, sync, asy)):
        for out, asynchronous in ((s_out, False), (a_out, True)):
            rounds = _expected_rounds(prompt, n_new, asynchronous)
            hist = np.bincount([a for a, _ in rounds], minlength=B4).tolist()
            assert out.metrics["accept_hist"] == hist, (row, asynchronous)
        assert s_out.metrics["accept_hist"][B4 - 1] > 0  # the sync drafter accepts full blocks
        # async, round by round: accepted, real drafts of the verified block, and hits
        rounds = _expected_rounds(prompt, n_new, True)
        assert rounds[0][0] == 0 and (B4 - 1, B4 - 1) in rounds  # rejections, then a full block
        running = [r for i, r in enumerate(tl) if i == 0 or tl[i - 1]["active"][row]]
        assert [(r["accepted"][row], r["draft_len"][row]) for r in running] == rounds
        judged = [r for r in running if r["active"][row]]  # rounds after which the row goes on
        assert all(r["hit"][row] for r in judged)  # incl. every all-accept round
        assert a_out.metrics["hits"] == len(rounds) - 1 and a_out.metrics["misses"] == 0
    assert sum(r["sync_draft"] for r in tl) == 0
