"""Tests for d3d_jax/training/pruning.py (spec §3) against brute-force / hand-rolled references."""

from __future__ import annotations

import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from d3d_jax.bench.generator import Generator
from flax import nnx

from d3d_jax.config import ModelConfig
from d3d_jax.model.kv_cache import init_cache
from d3d_jax.model.masks import block_meta, causal_meta, default_meta
from d3d_jax.model.qwen3 import init_model, layer_at, per_layer, remove_layers, stacked
from d3d_jax.training import data as data_lib
from d3d_jax.training import prune_run, pruning

TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=2,
                   num_kv_heads=1, head_dim=16, max_position_embeddings=256, mask_token_id=63,
                   block_size=4)


# ---------------------------------------------------------------------------------------
# η closed form (spec §3.3) vs brute force
# ---------------------------------------------------------------------------------------
def _gap(q, y):
    others = np.delete(q, y)
    return q[y] - others.max()


def _accepts_by_anchor(seqs, anchors, acc):
    """Per sequence, the accept count of the block anchored at each position (0 elsewhere)."""
    tables = []
    for r, (s, anc) in enumerate(zip(seqs, anchors)):
        table = np.zeros(len(s), np.int64)
        table[anc] = acc[r, :len(anc)]
        tables.append(table)
    return tables


def test_margin_eta_equals_brute_force_and_meets_margin():
    rng = np.random.default_rng(0)
    grid = np.linspace(0.0, 1.0, 20001)
    qs, ys, ms = [], [], []
    for i in range(300):
        alpha = [0.05, 0.3, 1.0, 5.0][i % 4]
        q = rng.dirichlet(np.full(12, alpha))
        y = int(np.argmax(q)) if i % 3 == 0 else int(rng.integers(12))
        qs.append(q), ys.append(y), ms.append([0.0, 0.05, 0.3, 0.7, 1.0][i % 5])
    # Edge cases: already one-hot on y; zero mass on y; ties.
    qs += [np.eye(12)[3], np.eye(12)[5], np.full(12, 1 / 12)]
    ys += [3, 3, 0]
    ms += [0.5, 0.5, 0.2]
    q = jnp.asarray(np.stack(qs), jnp.float32)
    y = jnp.asarray(ys)
    m = jnp.asarray(ms, jnp.float32)
    eta = np.asarray(pruning.margin_eta(q, y, m))
    q_tilde = np.asarray(pruning.adjusted_teacher(q, y, m))
    for i in range(len(qs)):
        qi = np.asarray(qs[i], np.float64)
        mixed = (1 - grid[:, None]) * qi[None] + grid[:, None] * np.eye(12)[ys[i]][None]
        gaps = mixed[:, ys[i]] - np.max(np.delete(mixed, ys[i], axis=1), axis=1)
        ok = np.nonzero(gaps >= ms[i] - 1e-12)[0]
        brute = grid[ok[0]] if ok.size else 1.0
        assert abs(eta[i] - brute) <= 1.5e-4, (i, eta[i], brute)
        assert _gap(q_tilde[i], ys[i]) >= ms[i] - 1e-5
        assert abs(q_tilde[i].sum() - 1) < 1e-5 and q_tilde[i].min() >= 0


# ---------------------------------------------------------------------------------------
# Layer removal == layer skipping (independent skip loop)
# ---------------------------------------------------------------------------------------
def _forward_skipping(model, tokens, meta, skip):
    x = model.embed(tokens)
    for i in range(model.config.num_layers):
        if i != skip:
            x, _, _ = layer_at(model, i)(x, meta, None)
    return model.logits(model.norm(x))


def test_removed_layer_gives_same_logits_as_skipped_layer():
    model = init_model(TINY, seed=1)
    tokens = jax.random.randint(jax.random.key(0), (2, 11), 0, TINY.vocab_size)
    meta = default_meta(2, 11)
    for l in range(TINY.num_layers):
        pruned = remove_layers(model, [l])
        assert pruned.config.num_layers == TINY.num_layers - 1
        np.testing.assert_allclose(np.asarray(pruned(tokens, meta)),
                                   np.asarray(_forward_skipping(model, tokens, meta, l)),
                                   atol=1e-6, rtol=1e-6)
    # skipping nothing reproduces the model itself (the reference loop is faithful)
    np.testing.assert_allclose(np.asarray(model(tokens, meta)),
                               np.asarray(_forward_skipping(model, tokens, meta, -1)), atol=1e-6)


# ---------------------------------------------------------------------------------------
# Offline τ vs the engine's anchoring (cached drafting forward, spec §4)
# ---------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _cached_block_argmax(graphdef, state, seq_1s, anchor, block_size, mask_id):
    """Draft one block as the engine does: committed tokens < anchor in the KV cache (rolled
    back by ``lengths``), then one forward over [x[anchor], MASK×(B-1)] seeing that cache."""
    model = nnx.merge(graphdef, state)
    s = seq_1s.shape[1]
    pos = jnp.arange(s, dtype=jnp.int32)[None]
    _, cache = model(seq_1s, causal_meta(pos, pos < anchor), cache=init_cache(model.config, 1, s))
    cache = cache.with_lengths(jnp.reshape(anchor, (1,)).astype(jnp.int32))
    block = jnp.full((1, block_size), mask_id, jnp.int32).at[0, 0].set(seq_1s[0, anchor])
    logits, _ = model(block, block_meta(jnp.reshape(anchor, (1, 1)), block_size), cache=cache)
    return jnp.argmax(logits[0], -1)


def _draft(model, seq, anchor):
    padded = np.zeros((1, 48), np.int32)
    padded[0, :len(seq)] = seq
    graphdef, state = nnx.split(model)
    return np.asarray(_cached_block_argmax(graphdef, state, jnp.asarray(padded), jnp.int32(anchor),
                                           TINY.block_size, TINY.mask_token_id))


def _simulated_greedy_response(model, prompt, rounds, rng):
    """A 'target greedy output' built round by round: the target accepts a chosen number of
    the drafter's tokens, then emits a different token (correction) or a bonus token."""
    bs, mask_id = TINY.block_size, TINY.mask_token_id
    seq, accepted = list(prompt), []
    for _ in range(rounds):
        draft = _draft(model, seq, len(seq) - 1)
        a = int(rng.integers(0, bs))
        seq += [int(t) for t in draft[1:a + 1]]
        if a < bs - 1:
            seq.append(int((draft[a + 1] + 1 + rng.integers(mask_id - 1)) % mask_id))
        else:
            seq.append(int(rng.integers(mask_id)))
        accepted.append(a)
    return seq, accepted


def test_offline_tau_replays_greedy_speculative_rounds_exactly():
    bs, mask_id = TINY.block_size, TINY.mask_token_id
    model = init_model(TINY, seed=2)
    rng = np.random.default_rng(0)
    seqs, prompt_lens, engine_accepts = [], [], []
    for i in range(2):
        prompt = [int(t) for t in rng.integers(0, mask_id, size=3 + i)]
        seq, acc = _simulated_greedy_response(model, prompt, 5, rng)
        seqs.append(seq), prompt_lens.append(len(prompt)), engine_accepts.append(acc)
    engine_tau = np.mean([a + 1 for acc in engine_accepts for a in acc])

    # Every possible anchor of the response, packed into one row per sequence.
    anchors = [list(range(p - 1, len(s) - 1)) for s, p in zip(seqs, prompt_lens)]
    batch = pruning.pack_dev_rows(seqs, prompt_lens, anchors, bs, mask_id, clean_len=32)
    _, acc = pruning.model_tau_sums(model, batch, bs)
    by_anchor = _accepts_by_anchor(seqs, anchors, acc)
    tau, rounds = pruning.trajectory_tau(by_anchor, [p - 1 for p in prompt_lens],
                                         [len(s) - 1 for s in seqs])
    assert rounds == sum(len(a) for a in engine_accepts)
    assert tau == pytest.approx(engine_tau, abs=1e-12)

    # Sampled full-block anchors (the dev-set measure) vs a brute-force loop of cached drafts.
    sampled = [data_lib.sample_anchors(rng, p, len(s), 6, bs)[0][:4] for s, p in zip(seqs, prompt_lens)]
    dev = pruning.pack_dev_rows(seqs, prompt_lens, sampled, bs, mask_id, clean_len=32)
    brute = []
    for s, anc in zip(seqs, sampled):
        for a in anc:
            draft = _draft(model, s, int(a))
            k = 0
            while k < bs - 1 and draft[k + 1] == s[a + k + 1]:
                k += 1
            brute.append(k + 1)
    details = pruning.OfflineTau([dev], bs).details(model)
    assert details["anchors"] == len(brute)
    assert details["tau"] == pytest.approx(np.mean(brute), abs=1e-9)
    assert details["tau"] > 1.5  # the construction makes acceptance non-trivial


def test_importance_compiles_once_per_depth():
    model = init_model(TINY, seed=3)
    rng = np.random.default_rng(1)
    seqs = [[int(t) for t in rng.integers(0, 63, 20)] for _ in range(2)]
    dev = pruning.pack_dev_rows(seqs, [4, 4], [[3, 8, 12]] * 2, 4, 63, 24)
    tau_fn = pruning.OfflineTau([dev], 4)
    tau_fn(remove_layers(model, [0]))  # warm the depth-2 entry
    before = pruning._tau_core._cache_size()
    scores = pruning.acceptance_importance(model, tau_fn)
    assert len(scores) == 3
    assert pruning._tau_core._cache_size() == before
    for l in range(3):  # and each score is that candidate's τ
        assert scores[l] == tau_fn(remove_layers(model, [l]))


# ---------------------------------------------------------------------------------------
# Distillation loss vs a numpy loop; ShortGPT vs explicit cosine
# ---------------------------------------------------------------------------------------
def test_distillation_loss_matches_numpy_loop():
    rng = np.random.default_rng(2)
    b, s, n, bs, v = 2, 5, 3, 4, 7
    t = s + n * bs
    student = rng.normal(size=(b, t, v)).astype(np.float32)
    teacher = rng.normal(size=(b, t, v)).astype(np.float32)
    labels = rng.integers(0, v, size=(b, t)).astype(np.int32)
    slot = np.full((b, t), -1, np.int32)
    slot[:, s:] = np.tile(np.arange(bs), n)
    slot[1, s + 2 * bs + 2:] = -1  # a block cut short by the sequence end
    labels[1, s + 2 * bs + 2:] = -1
    ar_mask = np.zeros((b, t), bool)
    ar_mask[:, 2:s] = True
    m, gamma, lam = 0.2, 7.0, 0.5
    batch = {"labels": labels, "slot": slot, "ar_mask": ar_mask}
    loss, _ = pruning.distillation_loss_from_logits(jnp.asarray(student), jnp.asarray(teacher), batch,
                                                    margin=m, gamma=gamma, ar_weight=lam)
    cut, _ = pruning.distillation_loss_from_logits(jnp.asarray(student), jnp.asarray(teacher), batch,
                                                   margin=m, gamma=gamma, ar_weight=lam, block_tokens=n * bs)
    assert float(cut) == pytest.approx(float(loss), rel=1e-6)

    def softmax(x):
        e = np.exp(x - x.max())
        return e / e.sum()

    num = den = 0.0
    for i in range(b):
        for p in range(t):
            k, y = slot[i, p], labels[i, p]
            if k < 1:
                continue
            q = softmax(teacher[i, p].astype(np.float64))
            g = q[y] - np.delete(q, y).max()
            eta = min(max((m - g) / (1 - g), 0.0), 1.0)
            qt = (1 - eta) * q + eta * np.eye(v)[y]
            w = np.exp(-(k - 1) / gamma)
            num += w * -(qt * np.log(softmax(student[i, p].astype(np.float64)))).sum()
            den += w
    ar_terms = [-np.log(softmax(student[i, p].astype(np.float64)))[labels[i, p]]
                for i in range(b) for p in range(t) if ar_mask[i, p]]
    assert float(loss) == pytest.approx(num / den + lam * np.mean(ar_terms), rel=1e-5)


def test_shortgpt_block_influence_matches_explicit_cosine():
    model = init_model(TINY, seed=4)
    rng = np.random.default_rng(3)
    seqs = [[int(t) for t in rng.integers(0, 63, 14)] for _ in range(2)]
    dev = pruning.pack_dev_rows(seqs, [3, 3], [[2, 5], [4]], 4, 63, 16)
    bi = pruning.shortgpt_importance(model, [dev])
    meta = data_lib.batch_meta(dev)
    x = model.embed(jnp.asarray(dev["tokens"]))
    valid = np.asarray(dev["valid"])
    for l in range(model.config.num_layers):
        y, _, _ = layer_at(model, l)(x, meta, None)
        a, c = np.asarray(x, np.float64)[valid], np.asarray(y, np.float64)[valid]
        cos = (a * c).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(c, axis=-1)
        assert bi[l] == pytest.approx(1 - cos.mean(), abs=1e-5)
        x = y
    assert pruning.least_important("shortgpt", bi) == int(np.argmin(bi))
    with pytest.raises(ValueError, match="criterion"):
        pruning.least_important("fisher", bi)


# ---------------------------------------------------------------------------------------
# Offline τ == the engine's greedy speculative τ on the target's greedy responses
# ---------------------------------------------------------------------------------------
def _context_mean_drafter(cfg: ModelConfig, seed: int):
    """A drafter whose block slots predict the most present context token: q = k = 0 (uniform
    attention), v / o identity, no MLP, zero MASK embedding.  With a target that repeats
    itself it is rejected early in a response and accepted fully later: mixed acceptance."""
    model = init_model(cfg, seed)
    d = cfg.hidden_size
    pure = per_layer(nnx.to_pure_dict(nnx.state(model)))
    pure["embed_tokens"]["embedding"] = pure["embed_tokens"]["embedding"].at[cfg.mask_token_id].set(0.0)
    for layer in pure["layers"].values():
        attn = layer["self_attn"]
        attn["q_proj"]["kernel"] = jnp.zeros_like(attn["q_proj"]["kernel"])
        attn["k_proj"]["kernel"] = jnp.zeros_like(attn["k_proj"]["kernel"])
        attn["v_proj"]["kernel"] = jnp.eye(d).reshape(d, cfg.num_kv_heads, cfg.head_dim)
        attn["o_proj"]["kernel"] = jnp.eye(d).reshape(cfg.num_heads, cfg.head_dim, d)
        layer["mlp"]["down_proj"]["kernel"] = jnp.zeros_like(layer["mlp"]["down_proj"]["kernel"])
    state = nnx.state(model)
    nnx.replace_by_pure_dict(state, stacked(pure))
    nnx.update(model, state)
    return model


def test_offline_tau_equals_engine_sync_tau_on_target_greedy_responses():
    from d3d_jax.decoding import engine
    from d3d_jax.decoding.metrics import summarize

    v, bs, max_new = 16, 4, 24
    target = init_model(ModelConfig(vocab_size=v, hidden_size=32, intermediate_size=64, num_layers=1,
                                    num_heads=2, num_kv_heads=1, head_dim=16,
                                    max_position_embeddings=128), 10)
    drafter = _context_mean_drafter(ModelConfig(
        vocab_size=v, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=2,
        head_dim=16, max_position_embeddings=128, mask_token_id=v - 1, block_size=bs), 20)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, v - 1, size=3 + 2 * i)] for i in range(4)]
    # Dev responses: the target's greedy output, one block longer than the decoded stretch
    # (the engine's last round counts its full a + 1 even where max_new_tokens cuts it).
    greedy = Generator()(target, prompts, mode="plain", max_new_tokens=max_new + bs)
    spec = Generator()(target, prompts, mode="sync", drafter=drafter, max_new_tokens=max_new,
                           block_size=bs, mask_token_id=v - 1)
    assert all(s.token_ids == g.token_ids[:max_new] for s, g in zip(spec, greedy))
    measured = summarize([o.metrics for o in spec])

    seqs = [p + g.token_ids for p, g in zip(prompts, greedy)]
    anchors = [list(range(len(p) - 1, len(s) - 1)) for s, p in zip(seqs, prompts)]
    batch = pruning.pack_dev_rows(seqs, [len(p) for p in prompts], anchors, bs, v - 1, clean_len=48)
    _, acc = pruning.model_tau_sums(drafter, batch, bs)
    by_anchor = _accepts_by_anchor(seqs, anchors, acc)
    tau, rounds = pruning.trajectory_tau(by_anchor, [len(p) - 1 for p in prompts],
                                         [len(p) - 1 + max_new for p in prompts])
    assert rounds == measured["rounds"]
    assert tau == pytest.approx(measured["tau"], abs=1e-12)
    hist = measured["accept_hist"]
    assert hist[0] > 0 and hist[-1] > 0  # both rejections and full acceptance occurred
    # the online option of the importance measure runs the same decoding
    online = pruning.online_tau(drafter, target, prompts, max_new_tokens=max_new, block_size=bs,
                                mask_token_id=v - 1)
    assert online == pytest.approx(tau, abs=1e-12)


# ---------------------------------------------------------------------------------------
# Config errors name the key
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("override,key", [
    ("prune.criterion=fisher", "prune.criterion"),
    ("prune.margin=1.5", "prune.margin"),
    ("prune.retention_floor=2", "prune.retention_floor"),
    ("prune.tau_measure=online", "prune.target"),
    ("data.dev_path=", "data.dev_path"),
    ("data.batch_size=3", "data.batch_size"),
])
def test_prune_config_errors_name_the_key(override, key):
    from d3d_jax.config import ConfigError, PruneRunConfig, load_config

    base = ["prune.drafter=d", "data.train_path=t.jsonl", "data.dev_path=d.jsonl", "num_devices=2",
            "mesh.fsdp=2", "data.packed_length=192", "data.num_anchors=8", "data.batch_size=8"]
    load_config(PruneRunConfig, ["configs/prune/tiny.yaml"], base)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(PruneRunConfig, ["configs/prune/tiny.yaml"], base + [override])


# ---------------------------------------------------------------------------------------
# End to end: train an over-deep drafter, prune one layer with the program, check the report
# ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_prune_drafter_program_keeps_tau_and_compares_rules(tmp_path, capsys):
    import importlib.util
    import json

    from d3d_jax import config as C
    from d3d_jax.io.checkpoint import load_model
    from d3d_jax.training import loop

    v, bs = 32, 4
    for name, n, seed in (("train", 64, 0), ("dev", 32, 1)):
        data_lib.write_jsonl(tmp_path / f"{name}.jsonl", data_lib.synthetic_records(
            n, vocab_size=v - 1, prompt_len=4, response_len=24, seed=seed))
    data = C.DataConfig(train_path=str(tmp_path / "train.jsonl"), dev_path=str(tmp_path / "dev.jsonl"),
                        packed_length=28 + 4 * bs, num_anchors=4, block_size=bs, batch_size=8,
                        dev_batches=2, mask_token_id=v - 1, first_block_anchor=False)
    # (anchors inside the response, the data this test's τ and retention figures were set on)
    # Three layers for a task one layer can learn: the drafter has layers to spare.
    model = C.ModelConfig(vocab_size=v, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=2,
                          num_kv_heads=1, head_dim=16, max_position_embeddings=128,
                          mask_token_id=v - 1, block_size=bs)
    train = C.TrainRunConfig(
        model=model, mesh=C.MeshConfig(data=1, fsdp=1, tensor=1), data=data, num_devices=1,
        optim=C.OptimConfig(name="adamw", learning_rate=3e-3, final_learning_rate=3e-4, warmup_steps=10),
        train=C.TrainConfig(steps=200, out_dir=str(tmp_path / "drafter"), log_every=50,
                            async_checkpointing=False, resume=False, export_params=False,
                            progress_bar=False, aot_compile=False))
    loop.run(train, log=lambda s: None)

    spec = importlib.util.spec_from_file_location("prune_drafter", "train/prune_drafter.py")
    program = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(program)
    out = tmp_path / "prune"
    rc = program.main([
        "--config", "configs/prune/tiny.yaml", f"prune.drafter={tmp_path / 'drafter/export/hf'}",
        f"prune.out_dir={out}", "prune.target_layers=2", "prune.progress_bar=false",
        f"data.train_path={data.train_path}", f"data.dev_path={data.dev_path}",
        f"data.packed_length={data.packed_length}", "data.num_anchors=4", f"data.block_size={bs}",
        f"data.mask_token_id={v - 1}", "data.first_block_anchor=false", "train.steps=80", "data.dev_batches=4",
        "optim.learning_rate=3e-3",
        "optim.final_learning_rate=3e-4"])
    assert rc == 0
    report = json.loads((out / "pruning_report.json").read_text())
    assert (out / "tau_vs_depth.png").stat().st_size > 0
    (rnd,) = report["rounds"]
    print(f"\npruning e2e: τ0={report['initial_tau']:.4f} τ without each layer={rnd['tau_without_layer']} "
          f"BI={['%.3f' % x for x in rnd['shortgpt_block_influence']]} removed={rnd['removed_layer']} "
          f"τ pruned={rnd['tau_pruned']:.4f} recovered={rnd['tau_recovered']:.4f} "
          f"retention={rnd['retention']:.4f}; shortgpt: {rnd['other_rule']}", file=sys.stderr)
    assert report["initial_tau"] > 3.0  # the drafter learned the task (τ ≤ B = 4)
    assert rnd["depth_after"] == 2 and report["final_depth"] == 2
    # importance = τ with that layer removed, and the deleted layer is the one costing least
    assert rnd["tau_pruned"] == max(rnd["tau_without_layer"])
    assert rnd["retention"] == pytest.approx(rnd["tau_recovered"] / report["initial_tau"])
    assert rnd["retention"] >= 0.99
    # ShortGPT compared at equal depth, after the same recovery
    other = rnd["other_rule"]
    assert other["rule"] == "shortgpt" and other["layer"] == int(np.argmin(rnd["shortgpt_block_influence"]))
    assert "tau_recovered" in other
    (cmp,) = report["rule_comparison"]
    assert cmp["depth"] == 2 and cmp["shortgpt_tau_recovered"] == other["tau_recovered"]
    assert cmp["acceptance_tau_recovered"] == rnd["tau_recovered"]
    # the round's HF export is the recovered 2-layer drafter: reloaded, it measures the same τ
    exported = load_model(str(out / "round_01" / "export" / "hf"))
    assert exported.config.num_layers == 2
    dev_ds, _ = data_lib.build_dataset(dataclasses.replace(data, block_size=bs), data.dev_path,
                                       mask_token_id=v - 1, seed=data.seed + 12345, shuffle=False)
    tau = pruning.OfflineTau(data_lib.take_batches(dev_ds, 4), bs)(exported)
    assert tau == pytest.approx(rnd["tau_recovered"], abs=1e-9)
    assert (out / "round_01" / "export" / "params").exists()


def test_progressive_loop_stops_below_retention_floor_and_keeps_last_good_model():
    model = init_model(TINY, seed=5)
    rng = np.random.default_rng(4)
    seqs = [[int(t) for t in rng.integers(0, 63, 14)] for _ in range(2)]
    dev = pruning.pack_dev_rows(seqs, [3, 3], [[2, 5], [4]], 4, 63, 16)
    tau_by_depth = {3: 4.0, 2: 3.9, 1: 3.0}
    calls = []

    def recover(student, name):
        calls.append((name, student.config.num_layers))
        return student

    best, report = pruning.prune_progressively(
        model, tau_fn=lambda m: tau_by_depth[m.config.num_layers], similarity_batches=[dev],
        recover=recover, target_layers=1, retention_floor=0.95, compare_shortgpt=True)
    assert [r["depth_after"] for r in report["rounds"]] == [2, 1]
    assert report["rounds"][0]["retention"] == pytest.approx(3.9 / 4.0)
    assert "retention floor" in report["stopped"]
    assert best.config.num_layers == 2 and report["final_depth"] == 2
    assert [c for c in calls if "shortgpt" not in c[0]] == [("round_01", 2), ("round_02", 1)]
    for r in report["rounds"]:  # ties in τ: the first layer; ShortGPT's pick recovered separately
        assert r["removed_layer"] == 0
        expect = "shortgpt" if r["other_rule"]["layer"] != 0 else None
        assert (f"round_{r['round']:02d}_shortgpt", r["depth_after"]) in calls or expect is None
    assert report["rounds"][1]["remaining_original_layers"] == [2]
    with pytest.raises(ValueError, match="criterion"):
        pruning.prune_progressively(model, tau_fn=lambda m: 1.0, similarity_batches=[dev],
                                    recover=recover, target_layers=1, criterion="fisher")


# ---------------------------------------------------------------------------------------
# Progressive pruning with distinct, known layer importances: the removal order, exactly
# ---------------------------------------------------------------------------------------
# τ of a 5-layer drafter as a function of which ORIGINAL layers remain: each missing layer costs
# its own amount, and layers 1 and 3 are redundant (either alone is cheap, both gone costs 1.0),
# so the greedy order depends on re-measuring every round: 1 (0.05), then 4 (layer 3 now costs
# 1.1), 0, 2 — remaining [3].  Scoring once from round 1's table would remove 1, 3, 4, 0.
_COST = (0.30, 0.05, 0.50, 0.10, 0.20)
# ShortGPT: layer l's residual branches (o_proj, down_proj) scaled by _SCALE[l], orders of magnitude
# apart, so its Block Influence 1 - cos(h_in, h_out) ranks layers by scale: 1, 3, 4, 2 — remaining [0].
_SCALE = (1.0, 0.01, 0.3, 0.03, 0.1)


def _table_tau(remaining: frozenset) -> float:
    missing = set(range(len(_COST))) - remaining
    return 4.0 - sum(_COST[i] for i in missing) - (1.0 if {1, 3} <= missing else 0.0)


def _scaled_residual_drafter():
    model = init_model(dataclasses.replace(TINY, num_layers=len(_SCALE)), seed=6)
    scale = jnp.asarray(_SCALE, jnp.float32)
    for lin in (model.layers.self_attn.o_proj, model.layers.mlp.down_proj):
        w = lin.kernel[...]
        lin.kernel[...] = w * scale.reshape((-1,) + (1,) * (w.ndim - 1))
    return model


def _original_layers(model, fingerprints) -> frozenset:
    """Which original layers a (pruned) model holds, identified by their q_proj weights."""
    found = [next(i for i, f in enumerate(fingerprints)
                  if np.array_equal(np.asarray(q), f)) for q in model.layers.self_attn.q_proj.kernel[...]]
    assert len(set(found)) == len(found)
    return frozenset(found)


def _known_order_drafter():
    """The scaled-residual drafter, a dev batch for ShortGPT's similarities, and τ from the table
    of its layers (found by their weights, whatever the pruning left)."""
    model = _scaled_residual_drafter()
    fingerprints = list(np.asarray(model.layers.self_attn.q_proj.kernel[...]))
    rng = np.random.default_rng(5)
    seqs = [[int(t) for t in rng.integers(0, 63, 14)] for _ in range(2)]
    dev = pruning.pack_dev_rows(seqs, [3, 3], [[2, 5], [4]], 4, 63, 16)
    return model, dev, lambda m: _table_tau(_original_layers(m, fingerprints))


@pytest.mark.parametrize("criterion,order", [("acceptance", [1, 4, 0, 2]), ("shortgpt", [1, 3, 4, 2])])
def test_progressive_pruning_removes_layers_in_known_importance_order(criterion, order):
    model, dev, tau_fn = _known_order_drafter()
    _, report = pruning.prune_progressively(
        model, tau_fn=tau_fn, similarity_batches=[dev], recover=lambda student, name: student,
        target_layers=1, criterion=criterion)

    rounds = report["rounds"]
    assert [r["removed_original_layer"] for r in rounds] == order
    remaining = list(range(len(_COST)))
    for r, removed in zip(rounds, order):
        # the report's renumbered index points at that original layer of the round's parent
        assert r["removed_layer"] == remaining.index(removed)
        # every remaining layer re-scored on the current model, against the table
        assert r["tau_without_layer"] == [_table_tau(frozenset(remaining) - {l}) for l in remaining]
        table_pick = max(remaining, key=lambda l: _table_tau(frozenset(remaining) - {l}))
        scale_pick = min(remaining, key=lambda l: _SCALE[l])
        picks = {"acceptance": table_pick, "shortgpt": scale_pick}
        assert remaining[int(np.argmin(r["shortgpt_block_influence"]))] == scale_pick
        assert r["other_rule"]["original_layer"] == picks[r["other_rule"]["rule"]]
        remaining.remove(removed)
        assert r["remaining_original_layers"] == remaining
        assert r["tau_recovered"] == _table_tau(frozenset(remaining))
    assert report["final_depth"] == 1


# ---------------------------------------------------------------------------------------
# Every round distils from the fixed, UNPRUNED drafter (spec §3.3), not the previous round's model
# ---------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=0)
def _packed_q(graphdef, state, batch):
    """The model's softmax over a packed training batch (jitted: eager forwards cost seconds)."""
    return jax.nn.softmax(nnx.merge(graphdef, state)(batch["tokens"], data_lib.batch_meta(batch)), axis=-1)


def _q(model, batch):
    return np.asarray(_packed_q(*nnx.split(model), batch))


@pytest.mark.slow
def test_every_pruning_round_distils_from_the_unpruned_drafter(tmp_path, monkeypatch):
    from d3d_jax.config import PruneRunConfig, load_config
    from d3d_jax.io.checkpoint import load_model

    v, bs, steps = 32, 4, 2
    for name, seed in (("train", 0), ("dev", 1)):
        data_lib.write_jsonl(tmp_path / f"{name}.jsonl", data_lib.synthetic_records(
            16, vocab_size=v - 1, prompt_len=4, response_len=12, seed=seed))
    cfg3 = dataclasses.replace(TINY, vocab_size=v, mask_token_id=v - 1)
    drafter, reference = init_model(cfg3, seed=7), init_model(cfg3, seed=7)  # reference: untouched copy

    # Record what the recovery loss really sees: teacher and student logits and the batch, per step.
    seen = []
    real_loss = pruning.distillation_loss_from_logits

    def spy(student_logits, teacher_logits, batch, **kw):
        jax.debug.callback(lambda s, t, b: seen.append(jax.tree.map(np.asarray, (s, t, b))),
                           jax.lax.stop_gradient(student_logits), teacher_logits, batch)
        return real_loss(student_logits, teacher_logits, batch, **kw)

    monkeypatch.setattr(pruning, "distillation_loss_from_logits", spy)
    out = tmp_path / "prune"
    cfg = load_config(PruneRunConfig, ["configs/prune/tiny.yaml"], [
        "prune.drafter=passed-in", f"prune.out_dir={out}", "prune.target_layers=1",
        "prune.retention_floor=0", "prune.compare_shortgpt=false", "prune.progress_bar=false",
        f"data.train_path={tmp_path / 'train.jsonl'}", f"data.dev_path={tmp_path / 'dev.jsonl'}",
        f"data.packed_length={16 + 2 * bs}", "data.num_anchors=2", f"data.block_size={bs}",
        "data.batch_size=4", "data.dev_batches=1", f"data.mask_token_id={v - 1}",
        f"train.steps={steps}", "optim.learning_rate=1e-2", "train.log_every=100"])
    report = prune_run.run_pruning(cfg, drafter=drafter, log=lambda s: None)
    assert [r["depth_after"] for r in report["rounds"]] == [2, 1]
    assert len(seen) == 2 * steps  # callbacks run in step order: round 1's steps, then round 2's
    round_1_model = load_model(str(out / "round_01" / "export" / "hf"))  # what round 2 started from

    tol = 2e-5  # the train step's forward vs a separately compiled one of the same weights
    for i, (student, teacher, batch) in enumerate(seen):
        rnd = 1 + i // steps
        q_unpruned = _q(reference, batch)
        q_teacher = np.asarray(jax.nn.softmax(teacher, axis=-1))
        np.testing.assert_allclose(q_teacher, q_unpruned, atol=tol,
                                   err_msg=f"round {rnd} step {i % steps}: teacher != the unpruned drafter")
        # Power: the models a wrong teacher would be differ from the unpruned one by far more than
        # the tolerance — the round's student before any update (its parent minus a layer) and,
        # in round 2, the previous round's recovered model.
        if i % steps == 0:
            gap = np.abs(np.asarray(jax.nn.softmax(student, axis=-1)) - q_unpruned).max()
            print(f"round {rnd}: |q(student at step 0) - q(unpruned)|max = {gap:.2e}", file=sys.stderr)
            assert gap > 50 * tol
        if rnd == 2:
            gap = np.abs(_q(round_1_model, batch) - q_unpruned).max()
            print(f"round 2: |q(round-1 model) - q(unpruned)|max = {gap:.2e}", file=sys.stderr)
            assert gap > 50 * tol


def test_shortgpt_comparison_prunes_its_own_line_at_every_depth_with_the_same_recovery():
    """With ``compare_shortgpt`` the other rule prunes its own line of descent: at every depth its
    layers are exactly what ShortGPT alone would have kept, its τ is the table's for those layers,
    and it gets one recovery per round like the main line (shared while both pick the same layer)."""
    model, dev, tau_fn = _known_order_drafter()
    calls = []

    def recover(student, name):
        calls.append((name, student.config.num_layers))
        return student

    _, report = pruning.prune_progressively(
        model, tau_fn=tau_fn, similarity_batches=[dev], recover=recover, target_layers=1,
        compare_shortgpt=True)
    kept_a, kept_s = list(range(5)), list(range(5))
    for r, (a, s) in zip(report["rounds"], zip([1, 4, 0, 2], [1, 3, 4, 2])):
        kept_a.remove(a)
        kept_s.remove(s)
        o = r["other_rule"]
        assert (r["removed_original_layer"], o["original_layer"]) == (a, s)
        assert o["remaining_original_layers"] == kept_s
        assert o["tau_recovered"] == _table_tau(frozenset(kept_s))
        assert o["shared"] == (kept_a == kept_s)
    assert [r["other_rule"]["shared"] for r in report["rounds"]] == [True, False, False, False]
    # one recovery per round per line; the shared first round is recovered once
    assert calls == [("round_01", 4), ("round_02", 3), ("round_02_shortgpt", 3), ("round_03", 2),
                     ("round_03_shortgpt", 2), ("round_04", 1), ("round_04_shortgpt", 1)]
    rows = report["rule_comparison"]
    assert [row["shortgpt_tau_recovered"] for row in rows] == [r["other_rule"]["tau_recovered"]
                                                               for r in report["rounds"]]
    assert rows[1]["acceptance_layers"] == [0, 2, 3] and rows[1]["shortgpt_layers"] == [0, 2, 4]
