"""Stage 8, the benchmark (what ``make demo`` runs on the shipped checkpoints): Table 1 for each
shipped drafter (plain, sync, sync at the compared block sizes, async, transformers' assisted
generation), the best drafter by online τ in sync mode at its block size, the async budget sweep
and the drafting-forward latency by depth, timed here; the
ablations' and the pruned drafters' τ read from stages 5-7.  JSON, tables and plots."""

from __future__ import annotations

import json
import time

from d3d_jax.io.chat import chat_prompt_ids
from d3d_jax.config.evaluation import EvalSettings
from d3d_jax.bench.evaluation import runner as R
from d3d_jax.bench.evaluation import benchmarks as B
from d3d_jax.pipeline import measure, online, report
from d3d_jax.pipeline.context import Context


def _hf_peer(p: Context, suites: dict, results: dict, plain_runs: dict) -> None:
    """transformers' assisted generation with the same target and drafter (AR assistant)."""
    from d3d_jax.bench.evaluation.assisted import hf_assisted_generation

    c, tok, main = p.cfg, p.tokenizer(), p.cfg.eval_drafters[0]
    for s, samples in suites.items():
        prompts = [chat_prompt_ids(tok, [{"role": "user", "content": x.turns[0]}]) for x in samples]
        peer = hf_assisted_generation(str(p.model_dir("target")), str(p.drafter_dir(main)), prompts,
                                      max_new_tokens=c.eval_max_new_tokens, eos_token_ids=p.eos_ids(),
                                      pad_token_id=p.special_ids()["pad"],
                                      reference_outputs=plain_runs[s].outputs, num_threads=1)
        results[s]["hf_plain"] = peer["plain"]
        results[s]["hf_assisted"] = peer["hf_assisted"]


def _table1(p: Context, target, suites: dict, settings: EvalSettings) -> tuple[dict, dict]:
    """Every eval drafter in every mode; the first also at the compared block sizes."""
    from d3d_jax.io.pairing import check_pairing

    c, kw = p.cfg, measure.decode_kwargs(p)
    drafters, plain_runs = {}, None
    for dname in c.eval_drafters:
        drafter = p.load(p.drafter_dir(dname))
        check_pairing(p.tokenizer(), target.config, drafter.config, eos_ids=kw["eos_token_ids"],
                      where=str(p.drafter_dir(dname)))
        res, raw = R.evaluate(target, drafter, p.tokenizer(), suites, settings, **kw)
        drafters[dname] = {"layers": drafter.config.num_layers, "results": res}
        if plain_runs is None:
            plain_runs = {s: raw[s]["plain"] for s in raw}
            for b in c.eval_compare_blocks:  # the same drafter verifying another block size
                other = measure.sync_against(p, target, drafter, suites, settings, plain_runs, block=b,
                                             drafter_share=True)
                for s in suites:
                    res[s][f"sync_b{b}"] = other[s]
    return drafters, plain_runs


def _best_timed(p: Context, target, suites: dict, settings: EvalSettings, plain_runs: dict,
                best: dict | None) -> dict | None:
    """The best drafter by online τ (stage 7), timed in sync mode against the same plain runs at
    the block size its τ was measured at and at the benchmark's (a CPU pays a verify's compute
    per token); None when its weights are not here."""
    weights = online.candidates(p).get(best["name"]) if best else None
    if weights is None:
        return None
    drafter = p.load(weights)
    blocks = dict.fromkeys((best["block_size"], settings.block_size))
    return {"name": best["name"], "block_size": best["block_size"],
            "blocks": {str(b): measure.sync_against(p, target, drafter, suites, settings, plain_runs, block=b)
                       for b in blocks}}


def _built(p: Context) -> dict:
    """What stages 5-7 measured once: per drafter its result.json, pruning's result, online τ."""
    c = p.cfg
    out = {"drafters": {v.name: json.loads((p.drafter_dir(v.name) / "result.json").read_text())
                        for v in c.drafters if (p.drafter_dir(v.name) / "result.json").exists()}}
    if c.prune_drafter and (p.prune_dir / "result.json").exists():
        out["pruning"] = json.loads((p.prune_dir / "result.json").read_text())
    if p.online_path.exists():
        out["online_tau"] = json.loads(p.online_path.read_text())
    return out


def benchmark(p: Context) -> dict:
    import jax

    c = p.cfg
    t_start = time.time()
    target = p.load(p.model_dir("target"))
    suites = measure.suites(p)
    has_async = measure.async_available()
    settings = measure.eval_settings(p, has_async)
    out: dict = {"suites": {k: len(v) for k, v in suites.items()}, "modes": list(settings.modes),
                 "devices": [str(d) for d in jax.devices()], "block_size_trained": c.block_size,
                 "async_available": has_async, "settings": vars(settings) | {}}
    out["drafters"], plain_runs = _table1(p, target, suites, settings)
    if c.hf_peer:
        _hf_peer(p, suites, out["drafters"][c.eval_drafters[0]]["results"], plain_runs)
    out["async_sweep"] = []
    if has_async and c.async_sweep:  # on the first suite
        first = next(iter(suites))
        grid = [(min(cc, settings.block_size), f) for cc, f in c.async_sweep]
        out["async_sweep"] = R.budget_sweep(target, p.load(p.drafter_dir(c.eval_drafters[0])), p.tokenizer(),
                                            suites[first], settings, list(dict.fromkeys(grid)),
                                            plain_runs[first], **measure.decode_kwargs(p))
    built = _built(p)
    out["best_online"] = report.best_online(built, list(suites))
    out["best_timed"] = _best_timed(p, target, suites, settings, plain_runs, out["best_online"])
    if "pruning" in built:
        pr = built["pruning"]
        depths = list(range(pr["initial_depth"], min(r["depth"] for r in pr["depths"]) - 1, -1))
        out["drafter_latency"] = measure.drafter_latency(p, depths, c.block_size)
    out["built"] = built
    out["eval_seconds"] = time.time() - t_start
    out["all_outputs_equal_plain"] = report.all_equal(out)
    return report.write(p, out, list(suites))
