"""Stages (6) prune and (7) benchmark of the embedded-default pipeline (see ``d3d_jax.pipeline``)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np

from d3d_jax.bench.evaluation import benchmarks as B
from d3d_jax.bench.evaluation import plots
from d3d_jax.bench.evaluation import runner as R
from d3d_jax.config.evaluation import EvalSettings
from d3d_jax.io.chat import chat_prompt_ids


def prune(p) -> None:
    """Acceptance-guided progressive layer pruning (spec §3) of ``cfg.prune_drafter``, through the
    pruning module's run (offline τ on the dev split, distillation recovery in the training loop)."""
    from d3d_jax import config as C
    from d3d_jax.training import pruning

    c = p.cfg
    src = p.drafter_dir(c.prune_drafter)
    work = p.work / "prune"
    run_cfg = C.PruneRunConfig(
        prune=C.PruneConfig(drafter=str(src), out_dir=str(work), target_layers=c.prune_to_layers,
                            criterion="acceptance", compare_shortgpt=False, margin=c.prune_margin,
                            tau_measure="offline", export_rounds=True),
        mesh=C.MeshConfig(data=1, fsdp=1, tensor=1), num_devices=1, data=p.drafter_data(),
        objective=C.ObjectiveConfig(kind="d3d", gamma=c.drafter_gamma, ar_weight=1.0),
        optim=C.OptimConfig(name="adamw", learning_rate=c.drafter_learning_rate * 0.3,
                            final_learning_rate=c.drafter_learning_rate * 0.03),
        train=C.TrainConfig(steps=c.prune_recover_steps, log_every=25, async_checkpointing=False,
                            keep_checkpoints=1, aot_compile=False, out_dir=str(work / "train")))
    run_cfg.validate()
    report = pruning.run_pruning(run_cfg, tokenizer=p.tokenizer())
    final = report.get("final_export")
    if not final:
        raise RuntimeError(f"pruning exported no final model (report keys: {sorted(report)})")
    dest = p.drafter_dir(f"{c.prune_drafter}_pruned")
    shutil.copytree(Path(final) / "hf", dest, dirs_exist_ok=True)
    p.store_compact(dest)  # shipped in bfloat16, run in float32 (Pipeline.load)
    for f in ("pruning_report.json", "tau_vs_depth.png"):
        if (work / f).exists():
            shutil.copy(work / f, dest / f)
    before, after = p.load(src), p.load(dest)
    (dest / "result.json").write_text(json.dumps(
        {"pruned_from": c.prune_drafter, "layers": after.config.num_layers,
         "layers_before": before.config.num_layers, "offline_tau_dev": p.offline_tau(after),
         "offline_tau_before": p.offline_tau(before)}, indent=1, default=float))


# --------------------------------------------------------------------------------------------
# (7) benchmark
# --------------------------------------------------------------------------------------------
def _async_available() -> bool:
    from d3d_jax.decoding import engine

    return "async" in engine.MODES


def _suites(p) -> dict[str, list[B.Sample]]:
    c, tok = p.cfg, p.tokenizer()
    suites = {}
    for name in c.eval_benchmarks:
        samples = B.load_benchmark(name, template="plain", passage_chars=c.passage_chars)
        lengths = [len(chat_prompt_ids(tok, [{"role": "user", "content": s.turns[0]}])) for s in samples]
        keep = [i for i, n in enumerate(lengths) if n <= 384]
        suites[name] = B.select_by_length([samples[i] for i in keep], [lengths[i] for i in keep],
                                          c.eval_samples)
    return suites


def _settings(p, has_async: bool) -> EvalSettings:
    import jax

    c = p.cfg
    b = c.eval_block
    settings = EvalSettings(max_new_tokens=c.eval_max_new_tokens, block_size=b,
                              max_cache_len=384 + c.eval_max_new_tokens + 4 * max(b, *c.eval_compare_blocks),
                              modes=("plain", "sync", "async") if has_async else ("plain", "sync"),
                              async_options={"branch_positions": min(c.async_positions, b),
                                             "branch_fanout": c.async_fanout} if has_async else {})
    if has_async and jax.device_count() >= 2:  # spec §5: target and drafter on disjoint devices
        settings.async_options.update(target_devices=1, drafter_devices=1)
    return settings


def _sync_against(p, target, drafter, suites, settings, plain_runs, kw, block: int | None = None,
                  drafter_share: bool = False) -> dict:
    """Per suite: ``drafter``'s sync summary against the shared plain runs (ablations, other B),
    with the drafter's share of round time when asked."""
    s_set = B.dataclasses.replace(settings, modes=("sync",), block_size=block or settings.block_size,
                                  drafter_share_samples=int(drafter_share))
    res, raw = R.evaluate(target, drafter, p.tokenizer(), suites, s_set, **kw)
    out = {}
    for s in suites:
        out[s] = B.summarize({"plain": plain_runs[s], "sync": raw[s]["sync"]}, s_set.block_size)["sync"]
        if "drafter_share" in res[s]["sync"]:
            out[s]["drafter_share"] = res[s]["sync"]["drafter_share"]
    return out


def _ablations(p, target, suites, settings, report, plain_runs, kw) -> dict:
    """Every other drafter in sync mode against the same plain outputs (weights permitting)."""
    c = p.cfg
    ablations = {}
    for v in c.drafters:
        result = json.loads((p.drafter_dir(v.name) / "result.json").read_text())
        row = {"init": v.init, "ar_weight": v.ar_weight, "offline_tau_dev": result["offline_tau_dev"]["tau"]}
        if v.name in report["drafters"]:
            row["online"] = {s: {k: report["drafters"][v.name]["results"][s]["sync"].get(k)
                                 for k in ("tau", "speedup", "equals_plain")} for s in suites}
        elif p.weights_dir(v.name) is not None:
            summ = _sync_against(p, target, p.load(p.weights_dir(v.name)), suites, settings, plain_runs, kw)
            row["online"] = {s: {k: summ[s].get(k) for k in ("tau", "speedup", "equals_plain")} for s in suites}
        ablations[v.name] = row
    pr = p.drafter_dir(f"{c.prune_drafter}_pruned") / "result.json" if c.prune_drafter else None
    if pr is not None and pr.exists():
        ablations[f"{c.prune_drafter}_pruned"] = json.loads(pr.read_text())
    return ablations


def _hf_peer(p, suites, report, plain_runs) -> None:
    """transformers' assisted generation with the same target and drafter (AR assistant)."""
    from d3d_jax.bench.evaluation.assisted import hf_assisted_generation

    c, tok, main = p.cfg, p.tokenizer(), p.cfg.eval_drafters[0]
    for s, samples in suites.items():
        prompts = [chat_prompt_ids(tok, [{"role": "user", "content": x.turns[0]}]) for x in samples]
        peer = hf_assisted_generation(str(p.model_dir("target")), str(p.drafter_dir(main)), prompts,
                                      max_new_tokens=c.eval_max_new_tokens, eos_token_ids=p.eos_ids(),
                                      pad_token_id=p.special_ids()["pad"],
                                      reference_outputs=plain_runs[s].outputs, num_threads=1)
        report["drafters"][main]["results"][s]["hf_plain"] = peer["plain"]
        report["drafters"][main]["results"][s]["hf_assisted"] = peer["hf_assisted"]


def benchmark(p) -> dict:
    """Stage (7): Table 1 per eval drafter (plus the main drafter's sync at the compared block
    sizes), the ablations, the transformers peer and the async budget sweep; JSON, tables, plots."""
    import jax

    c, tok = p.cfg, p.tokenizer()
    t_start = time.time()
    target = p.load(p.model_dir("target"))
    suites = _suites(p)
    has_async = _async_available()
    settings = _settings(p, has_async)
    kw = dict(eos_token_ids=p.eos_ids(), mask_token_id=p.special_ids()["mask"], encode_fn=chat_prompt_ids)
    report: dict = {"suites": {k: len(v) for k, v in suites.items()}, "modes": list(settings.modes),
                    "devices": [str(d) for d in jax.devices()], "block_size_trained": c.block_size,
                    "async_available": has_async, "settings": vars(settings) | {}, "drafters": {}}
    plain_runs = None
    for dname in c.eval_drafters:
        drafter = p.load(p.drafter_dir(dname))
        res, raw = R.evaluate(target, drafter, tok, suites, settings, **kw)
        report["drafters"][dname] = {"layers": drafter.config.num_layers, "results": res}
        if plain_runs is None:
            plain_runs = {s: raw[s]["plain"] for s in raw}
            for b in c.eval_compare_blocks:  # the same drafter verifying another block size
                other = _sync_against(p, target, drafter, suites, settings, plain_runs, kw, block=b,
                                      drafter_share=True)
                for s in suites:
                    res[s][f"sync_b{b}"] = other[s]
    main = c.eval_drafters[0]
    report["ablations"] = _ablations(p, target, suites, settings, report, plain_runs, kw)
    if c.hf_peer:
        _hf_peer(p, suites, report, plain_runs)
    sweep = []
    if has_async and c.async_sweep:  # on the first suite
        first = next(iter(suites))
        grid = [(min(cc, settings.block_size), f) for cc, f in c.async_sweep]
        sweep = R.budget_sweep(target, p.load(p.drafter_dir(main)), tok, suites[first], settings,
                               list(dict.fromkeys(grid)), plain_runs[first], **kw)
    report["async_sweep"] = sweep
    report["eval_seconds"] = time.time() - t_start
    report["all_outputs_equal_plain"] = _all_equal(report)
    return _write_report(p, report, list(suites))


def _write_report(p, report: dict, suites: list[str]) -> dict:
    c, eval_dir = p.cfg, p.eval_dir
    B.write_json(report, eval_dir / "results.json")
    methods = ("plain", "sync", *(f"sync_b{b}" for b in c.eval_compare_blocks), "async", "hf_assisted")
    tables = [B.table1(d["results"], methods=methods,
                       title=f"**Drafter `{name}` ({d['layers']} layers), B = {c.eval_block}**")
              for name, d in report["drafters"].items()]
    tables.append(ablation_table(report["ablations"], suites))
    text = "\n\n".join(tables)
    (eval_dir / "table.md").write_text(text + "\n")
    res_main = report["drafters"][c.eval_drafters[0]]["results"]
    plots.acceptance_histogram(res_main, eval_dir / "acceptance_histogram.png")
    plots.tau_per_slot(res_main, eval_dir / "tau_per_slot.png")
    if report["async_sweep"]:
        plots.budget_sweep(report["async_sweep"], eval_dir / "async_budget.png")
    plots.tau_bars([(k, v["offline_tau_dev"] if isinstance(v["offline_tau_dev"], float)
                     else v["offline_tau_dev"]["tau"]) for k, v in report["ablations"].items()],
                   eval_dir / "ablations_offline_tau.png", "Offline τ on the dev split per drafter")
    print(text, flush=True)
    print(f"all sync/async outputs equal plain greedy: {report['all_outputs_equal_plain']}", flush=True)
    print(f"[pipeline] results in {eval_dir}", flush=True)
    if p.update_artifacts:
        _copy_results(eval_dir, p.shipped_eval_dir)
    return report


def _copy_results(src: Path, dst: Path) -> None:
    """Replace the shipped reference results with this run's (``--update-artifacts``)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file():
            shutil.copy2(f, dst / f.name)
    print(f"[pipeline] --update-artifacts: shipped results in {dst} replaced", flush=True)


def _all_equal(report: dict) -> bool:
    ok = True
    for d in report["drafters"].values():
        for s, modes in d["results"].items():
            for m in modes:
                if (m.startswith("sync") or m == "async") and "error" not in modes[m] \
                        and not modes[m].get("equals_plain", False):
                    ok = False
    for r in report.get("async_sweep", []):
        ok = ok and bool(r.get("equals_plain"))
    for a in report.get("ablations", {}).values():
        for o in (a.get("online") or {}).values():
            if "equals_plain" in o:
                ok = ok and bool(o["equals_plain"])
    return ok


def ablation_table(ablations: dict, suites: list[str]) -> str:
    head = ("| Drafter | init | λ | offline τ (dev) | " + " | ".join(f"{s} sync τ" for s in suites)
            + " | target fwd/token |")
    rows = [head, "|" + "---|" * (5 + len(suites))]
    for name, a in ablations.items():
        if "variant" in a or "init" in a:
            off = a["offline_tau_dev"]
            off = off if isinstance(off, float) else off["tau"]
            taus = [(a.get("online", {}).get(s, {}) or {}).get("tau") for s in suites]
            cells = [f"{t:.2f}" if t else "not shipped" for t in taus]
            known = [t for t in taus if t]
            inv = f"{np.mean([1 / t for t in known]):.3f}" if known else "–"
            rows.append(f"| {name} | {a.get('init', '')} | {a.get('ar_weight', '')} | {off:.2f} | "
                        + " | ".join(cells) + f" | {inv} |")
        else:  # pruned
            rows.append(f"| {name} | pruned {a['layers_before']}→{a['layers']} layers | | "
                        f"{a['offline_tau_dev']['tau']:.2f} (before {a['offline_tau_before']['tau']:.2f}) | "
                        + " | ".join("" for _ in suites) + " | |")
    return "**Ablations**\n" + "\n".join(rows)
