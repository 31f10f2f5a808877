"""The embedded-default pipeline in miniature: every stage runs, reruns skip, outputs are checked."""
import gzip
import json

import pytest

from d3d_jax.config import ConfigError, PipelineConfig, load_config

MINI = "configs/pipelines/mini.yaml"


def test_bad_pipeline_configs_name_the_key():
    with pytest.raises(ConfigError, match=r"drafters\[0\].init"):
        load_config(PipelineConfig, [MINI], ["drafters=[{name: a, init: pretrained}]", "eval_drafters=[a]",
                                             "prune_drafter=''"])
    with pytest.raises(ConfigError, match="eval_drafters"):
        load_config(PipelineConfig, [MINI], ["eval_drafters=[nope]"])
    with pytest.raises(ConfigError, match="drafter_packed_length"):
        load_config(PipelineConfig, [MINI], ["drafter_packed_length=16"])
    for bad in ("{name: a, steps: 100, decay_steps: 200}", "{name: a, decay_steps: 50}"):
        with pytest.raises(ConfigError, match=r"drafters\[0\].decay_steps: must be within the variant's own steps"):
            load_config(PipelineConfig, [MINI], [f"drafters=[{bad}]", "eval_drafters=[a]", "prune_drafter=''"])


def test_quick_variant_shortens_every_stage_and_leaves_the_artifacts():
    cfg = load_config(PipelineConfig, ["configs/pipelines/demo.yaml"], [])
    quick = cfg.quick()
    quick.validate()
    assert quick.out_dir == "runs/quick/artifacts_demo"  # never the shipped out_dir
    assert (quick.target.steps, quick.small.steps) == (cfg.target.steps // 8, cfg.small.steps // 8)
    assert quick.target.model == cfg.target.model and quick.small.model == cfg.small.model
    assert quick.drafter_steps == cfg.drafter_steps // 8 and quick.regen_prompts == cfg.regen_prompts // 10
    for v, q in zip(cfg.drafters, quick.drafters):
        assert (q.name, q.init, q.ar_weight) == (v.name, v.init, v.ar_weight)
        assert q.steps is None if v.steps is None else q.steps == max(4, v.steps // 8)
        assert q.decay_steps is None if v.decay_steps is None else q.decay_steps == max(4, v.decay_steps // 8)
    assert any(v.decay_steps for v in cfg.drafters)  # the target drafter's cosine ends before its last step
    assert quick.eval_samples < cfg.eval_samples and not quick.hf_peer


@pytest.mark.slow
def test_mini_pipeline_end_to_end(tmp_path, capsys):
    from d3d_jax.pipeline import Context, missing, run

    out = tmp_path / "artifacts"
    cfg = load_config(PipelineConfig, [MINI], [f"out_dir={out}"])
    report = run(Context(cfg, work_dir=str(tmp_path / "work")))
    # Every stage left its output.
    for p in ("tokenizer/tokenizer.json", "models/target/config.json", "models/small/config.json",
              "data/regenerated_train.jsonl.gz", "data/regenerated_dev.jsonl.gz", "drafters/small/result.json",
              "drafters/small_l0/result.json", "pruning/result.json", "pruning/pruning_report.json",
              "pruning/recovery_curves.png", "online_tau.json"):
        assert (out / p).exists(), p
    # The benchmark writes under the work dir; the shipped results are left alone.
    for p in ("results.json", "table.md", "acceptance_histogram.png", "tau_per_slot.png", "dev_curves.png"):
        assert (tmp_path / "work" / "eval" / p).exists(), p
    assert not (out / "eval").exists()
    # Regeneration kept every prompt; responses are the target's own tokens.
    recs = [json.loads(x) for f in ("train", "dev")
            for x in gzip.decompress((out / f"data/regenerated_{f}.jsonl.gz").read_bytes()).splitlines()]
    assert len(recs) == 12 and all(r["response_token_ids"] for r in recs)
    # Pruning 2 -> 1 layer by both rules, each with its recovery curve (eval every step); the
    # unshipped eval-less drafter's weights moved to the work dir after stage 7 measured them.
    pruned = json.loads((out / "pruning/result.json").read_text())
    (row,) = pruned["depths"]
    assert pruned["initial_depth"] == 2 and row["depth"] == 1
    for rule in ("acceptance", "shortgpt"):
        assert len(row[rule]["layers"]) == 1 and 0 < row[rule]["retention"]
        if not row[rule]["shared"]:
            assert [c["step"] for c in row[rule]["recovery_curve"]] == [0, 1, 2]
    online = json.loads((out / "online_tau.json").read_text())["drafters"]
    assert set(online) == {"small", "small_l0", "small_acceptance_1", "small_shortgpt_1"}
    assert all(r["shakespeare"]["equals_plain"] and 1.0 <= r["shakespeare"]["tau"] <= 4.0 for r in online.values())
    assert not (out / "drafters/small_l0/model.safetensors").exists()
    assert (tmp_path / "work" / "drafters/small_l0/model.safetensors").exists()
    # Benchmark: the equality check ran on real outputs and passed; τ is in range.
    res = report["drafters"]["small"]["results"]
    for suite in ("shakespeare",):
        assert res[suite]["sync"]["equals_plain"] is True
        assert 1.0 <= res[suite]["sync"]["tau"] <= 4.0
        assert res[suite]["plain"]["new_tokens"] > 0
    assert report["all_outputs_equal_plain"]
    # Every row carries 1/τ and the drafter's share of round time; async ran on two devices and
    # reports the share of its packed forward that overlapped the verify.
    sync, asy = res["shakespeare"]["sync"], res["shakespeare"]["async"]
    b3 = res["shakespeare"]["sync_b3"]  # the same drafter verifying 3-token blocks
    assert b3["equals_plain"] is True and 1.0 <= b3["tau"] <= 3.0 and len(b3["accept_histogram"]) == 3
    assert sync["target_forwards_per_token"] == pytest.approx(sync["rounds"] / sync["new_tokens"])
    assert 0.0 < sync["drafter_share"] < 1.0 and 0.0 < asy["drafter_share"]
    assert 0.0 <= asy["overlap_fraction"] <= 1.0
    assert asy["verify_devices"] != asy["packed_devices"]
    # The target ships in bfloat16 with its tokenizer beside it (commands take the dir alone).
    tcfg = json.loads((out / "models/target/config.json").read_text())
    assert tcfg["torch_dtype"] == "bfloat16" and (out / "models/target/tokenizer.json").exists()
    assert report["built"]["online_tau"]["drafters"]["small_l0"]["shakespeare"]["equals_plain"] is True
    assert set(report["drafter_latency"]["depth_ms"]) == {"2", "1"}
    # The best drafter by online τ is timed in sync mode at the block size its τ was measured at
    # (the same τ) and at the benchmark's.
    best, timed = report["best_online"], report["best_timed"]
    assert timed["name"] == best["name"] and timed["block_size"] == best["block_size"]
    assert set(timed["blocks"]) == {str(best["block_size"]), str(cfg.eval_block)}
    at_trained = timed["blocks"][str(best["block_size"])]["shakespeare"]
    assert at_trained["tau"] == pytest.approx(best["shakespeare"]) and at_trained["equals_plain"] is True
    printed = capsys.readouterr().out
    assert f"`{best['name']}`, shakespeare τ" in printed
    assert f"sync at B = {cfg.eval_block}, timed here: shakespeare" in printed
    assert "| sync |" in printed and "| sync_b3 |" in printed and "Ablation arms" in printed
    assert "ShortGPT" in printed and "Drafting-forward latency" in printed
    assert "| overlap |" in printed
    # A rerun skips every build stage.
    capsys.readouterr()
    again = Context(cfg, work_dir=str(tmp_path / "work"))
    assert missing(again) == []
    run(again, evaluate=False)
    assert again.timings == {}
    assert capsys.readouterr().out.count("output exists, skipped") == 6 + len(cfg.drafters)  # stages 1-7
    # Without the training split (deleted to save space), with every drafter built, nothing reruns.
    (out / "data/regenerated_train.jsonl.gz").unlink()
    fresh = Context(cfg, work_dir=str(tmp_path / "work"))
    run(fresh, evaluate=False)
    assert fresh.timings == {}


DEMO = "configs/pipelines/demo.yaml"


def test_shipped_artifacts_are_every_stage_of_demo_yaml_and_the_results_describe_them(tmp_path):
    """``make demo`` on a fresh clone (nothing under runs/) only benchmarks, and the shipped
    results.json reports the drafters, pruning and online τ that ship beside it."""
    from pathlib import Path

    from d3d_jax.pipeline import Context, missing
    from d3d_jax.pipeline.prune import pruned_names

    cfg = load_config(PipelineConfig, [DEMO], [])
    p = Context(cfg, work_dir=str(tmp_path / "fresh-clone-work"))
    assert missing(p) == []
    for name in cfg.eval_drafters:  # the benchmark times these: their weights ship
        assert (p.drafter_dir(name) / "model.safetensors").exists(), name
    results = json.loads((Path(cfg.out_dir) / "eval/results.json").read_text())
    assert list(results["drafters"]) == list(cfg.eval_drafters)
    built = results["built"]
    assert built["drafters"] == {v.name: json.loads((p.drafter_dir(v.name) / "result.json").read_text())
                                 for v in cfg.drafters}
    assert built["online_tau"] == json.loads(p.online_path.read_text())
    assert set(built["online_tau"]["drafters"]) == {v.name for v in cfg.drafters} | set(pruned_names(p))
    assert ("pruning" in built) == bool(cfg.prune_drafter)
    # the target-initialised drafter pruned 8 -> 7 -> 6 by both rules, and each ablation
    # arm with a second seed at the same budget
    assert {"target", "small_s1", "small_l0_s1", "random_s1"} <= {v.name for v in cfg.drafters}
    assert [r["depth"] for r in built["pruning"]["depths"]] == [7, 6]
    assert set(pruned_names(p)) == {f"target_{rule}_{d}" for rule in ("acceptance", "shortgpt") for d in (7, 6)}
    assert results["all_outputs_equal_plain"] is True


def test_a_signal_stopped_training_stage_exits_128_plus_signal_and_says_how_to_resume(tmp_path):
    """The training loop returns early on SIGTERM (checkpoint saved, no export): the stage stops
    there with one line and the signal's status, not later on the missing export."""
    from types import SimpleNamespace

    from d3d_jax.cli import run_cli
    from d3d_jax.pipeline.runs import StageStopped, finished

    finished(SimpleNamespace(stop_signal=None, step=8), "drafter_x", 8, tmp_path)  # ran to the end
    with pytest.raises(StageStopped, match=r"'drafter_x' stopped by signal 15 at step 3 of 8, .*rerun") as e:
        finished(SimpleNamespace(stop_signal=15, step=3), "drafter_x", 8, tmp_path)

    def main(argv):
        raise e.value
    assert (e.value.exit_code, run_cli(main, [])) == (143, 143)
