"""``infer/bench.py eval`` (``add_arguments`` + ``main``, the bench command contract): Table 1 for any target + drafter (HF Qwen3 dirs or param checkpoints).

    python infer/bench.py eval --target /models/Qwen3-8B --drafter /models/d3d-8b \\
        --benchmarks humaneval gsm8k=/data/gsm8k/test.jsonl mtbench=/data/mt_bench/question.jsonl \\
        --samples 80 --max-new-tokens 2048 --out runs/eval

On a CPU-only host ``infer/bench.py`` gives the process two host devices for this command
(``--cpu-devices``), so async places target and drafter on disjoint devices by default.

Every flag sets a field of :class:`~d3d_jax.config.evaluation.EvalConfig` (``--config FILE`` and
``key=value`` overrides too, e.g. ``decoder.branch_fanout=3``).

Writes ``results.json``, ``table.md`` and the plots under ``--out`` and prints the table.
Exit status 3 when any sync/async/auto output differs from plain greedy decoding.
"""

from __future__ import annotations

import argparse
import functools
import os
from pathlib import Path

from d3d_jax.config.evaluation import TEMPLATES, EvalConfig, EvalSettings
from d3d_jax.config.flags import (add_auto_flags, add_config_arguments, add_device_flags, add_kv_flags, add_model_flags,
                                  config_flag, load_command_config, parse_geometries)
from d3d_jax.errors import UsageError


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    ap.description = __doc__
    ap.formatter_class = argparse.RawDescriptionHelpFormatter
    add_config_arguments(ap, "eval.yaml")
    flag = functools.partial(config_flag, ap)
    add_model_flags(ap, mode=False)
    flag("--benchmarks", key="eval.benchmarks", nargs="+",
         help="NAME or NAME=PATH (gsm8k, math500, aime25, humaneval, mbpp, livecodebench, mtbench, shakespeare, "
              "stdlib; default humaneval)")
    flag("--samples", key="eval.samples", type=int, help="per benchmark (fewest prompt-length buckets; default 16)")
    flag("--max-new-tokens", key="eval.max_new_tokens", type=int, help="default 256")
    flag("--allow-beyond-context", key="eval.allow_beyond_context", action="store_true",
         help="let prompt + max-new-tokens run past the target's max_position_embeddings")
    flag("--block-size", key="decoder.block_size", type=int, help="default: the drafter's config")
    flag("--modes", key="eval.modes", help="of plain, sync, async, auto (default plain,sync,async)")
    flag("--template", key="eval.template", choices=TEMPLATES)
    flag("--branch-positions", key="decoder.branch_positions", type=int, help="async C (default min(12, B))")
    flag("--branch-fanout", key="decoder.branch_fanout", type=int, help="async F (default 2)")
    flag("--async-sweep", key="eval.async_sweep", type=parse_geometries, help="C×F points, e.g. 4x2,8x2,12x2")
    add_auto_flags(ap)
    add_kv_flags(ap, EvalConfig)
    flag("--hf-peer", key="eval.hf_peer", action="store_true", help="also transformers assisted generation")
    flag("--concurrency", key="eval.concurrency", type=int,
         help="requests in flight in one long-lived decoder per mode (default 1: batch 1)")
    add_device_flags(ap, default="every mode; async by default: disjoint halves when there are two "
                                 "or more devices")
    flag("--out", key="eval.out", help="default runs/eval")
    return ap


def check_limits(cfg: EvalConfig, target, longest: int, block: int) -> None:
    """Before any decoding: the longest prompt + max_new_tokens fits the target, the branch pack is sane."""
    from d3d_jax.decoding.branches import BranchLayout
    from d3d_jax.io.records import check_context

    run = cfg.eval
    check_context(longest, run.max_new_tokens, target.config.context_length,
                  model=f"--target {cfg.models.target}", allow_beyond=run.allow_beyond_context,
                  hint="--allow-beyond-context")
    if "async" in run.modes:
        a = cfg.mode_settings("async", block)
        BranchLayout(block, a.branch_positions, a.branch_fanout).validate()


def eval_settings(cfg: EvalConfig, drafter_block: int | None, longest: int, devices: int) -> EvalSettings:
    """The runner's settings: every mode's decoder from the one ``decoder`` section (the same
    derived defaults as the server and generate), a cache that holds the longest conversation,
    and the device split (every mode's, or async's default halves)."""
    from d3d_jax.config.decoding import ASYNC_ONLY
    from d3d_jax.config.evaluation import AUTO_OPTIONS, DEVICE_OPTIONS
    from d3d_jax.decoding.settings import decoder_fields
    from d3d_jax.parallel.sharding import resolve_slices

    run, modes = cfg.eval, cfg.eval.modes
    block = cfg.mode_settings("plain", drafter_block).block_size
    settings = EvalSettings(max_new_tokens=run.max_new_tokens, block_size=block, modes=modes,
                            concurrency=run.concurrency,
                            max_cache_len=-(-(2 * longest + 2 * run.max_new_tokens + 4 * block) // 64) * 64)

    def options(mode: str, keys) -> dict:
        fields = decoder_fields(cfg.mode_settings(mode, drafter_block), cfg.models.drafter)
        return {k: v for k, v in fields.items() if k in keys}

    settings.device_options = {k: getattr(cfg.decoder, k) for k in DEVICE_OPTIONS
                               if getattr(cfg.decoder, k) is not None}
    if settings.device_options:  # a split that cannot be is refused before any model loads
        resolve_slices(devices=list(range(devices)), **settings.device_options)
    if "async" in modes:
        settings.async_options = options("async", ASYNC_ONLY)
        if not settings.device_options:  # async overlaps on disjoint halves by default
            t, d = resolve_slices(devices=list(range(devices)), halves=True)
            if t != d:
                settings.async_options.update(target_devices=len(t), drafter_devices=len(d))
    if "auto" in modes:
        settings.auto_options = options("auto", AUTO_OPTIONS)
    settings.validate()
    return settings


def _suites(cfg: EvalConfig, tok, encode) -> tuple[dict, int]:
    """``({benchmark: samples}, longest first-turn prompt in tokens)``."""
    from d3d_jax.bench.evaluation import benchmarks as B

    suites = {}
    for spec in cfg.eval.benchmarks:
        name, _, path = spec.partition("=")
        samples = B.load_benchmark(name, path or None, template=cfg.eval.template)
        lengths = [len(encode(tok, [{"role": "user", "content": s.turns[0]}])) for s in samples]
        suites[name] = B.select_by_length(samples, lengths, cfg.eval.samples)
    longest = max(len(encode(tok, [{"role": "user", "content": t}]))
                  for ss in suites.values() for s in ss for t in s.turns[:1])
    return suites, longest


def _hf_peer(cfg: EvalConfig, tok, suites, raw, results, eos_ids, encode) -> None:
    from d3d_jax.bench.evaluation.assisted import hf_assisted_generation

    for s, samples in suites.items():
        prompts = [encode(tok, [{"role": "user", "content": x.turns[0]}]) for x in samples]
        peer = hf_assisted_generation(cfg.models.target, cfg.models.drafter, prompts,
                                      max_new_tokens=cfg.eval.max_new_tokens, eos_token_ids=eos_ids,
                                      reference_outputs=raw[s]["plain"].outputs[:len(prompts)]
                                      if all(len(x.turns) == 1 for x in samples) else None)
        results[s]["hf_plain"], results[s]["hf_assisted"] = peer["plain"], peer["hf_assisted"]


def _write(report: dict, out: Path) -> str:
    from d3d_jax.bench.evaluation import benchmarks as B
    from d3d_jax.bench.evaluation import plots

    results = report["results"]
    B.write_json(report, out / "results.json")
    table = B.table1(results)
    (out / "table.md").write_text(table + "\n")
    plots.acceptance_histogram(results, out / "acceptance_histogram.png")
    plots.tau_per_slot(results, out / "tau_per_slot.png")
    return table


def load_drafter(cfg: EvalConfig, target, tok, tokenizer_mask_id: int, mesh=None):
    """``(drafter, mask id, eos ids)``, the drafter checked against target and tokenizer
    (``mesh``: loaded straight onto that slice)."""
    from d3d_jax.io.checkpoint import load_decoding_model
    from d3d_jax.io.hf import eos_token_ids
    from d3d_jax.io.pairing import check_pairing

    drafter = load_decoding_model(cfg.models.drafter, dtype=cfg.models.dtype, attention=cfg.models.attention,
                                  mesh=mesh)
    eos_ids = eos_token_ids(target.config, tok)
    mask = check_pairing(tok, target.config, drafter.config, eos_ids=eos_ids,
                         where=f"--drafter {cfg.models.drafter}")
    trained, block = drafter.config.block_size, cfg.decoder.block_size
    if block and trained and block > trained:
        raise UsageError(f"--block-size {block} is more than the drafter was trained for ({trained})")
    return drafter, tokenizer_mask_id if mask is None else mask, eos_ids


def main(args) -> int:
    cfg = load_command_config(EvalConfig, args)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import jax

    from d3d_jax.bench.evaluation import plots
    from d3d_jax.bench.evaluation import runner as R
    from d3d_jax.config.evaluation import DEVICE_OPTIONS
    from d3d_jax.io.chat import chat_prompt_ids as encode
    from d3d_jax.io.checkpoint import load_decoding_model
    from d3d_jax.io.hf import load_tokenizer
    from d3d_jax.parallel.sharding import model_meshes

    m = cfg.models
    # a split asked for: each model read straight onto its slice (async's, when async runs)
    t_mesh, d_mesh = model_meshes("async" if "async" in cfg.eval.modes else "sync", cfg.decoder.target_devices,
                                  cfg.decoder.drafter_devices)
    target = load_decoding_model(m.target, dtype=m.dtype, attention=m.attention, mesh=t_mesh)
    tok, mask_id = load_tokenizer(m.tokenizer or m.target, target.config.vocab_size)
    drafter, mask_id, eos_ids = load_drafter(cfg, target, tok, mask_id, d_mesh)
    suites, longest = _suites(cfg, tok, encode)
    check_limits(cfg, target, longest, cfg.mode_settings("plain", drafter.config.block_size).block_size)
    settings = eval_settings(cfg, drafter.config.block_size, longest, jax.device_count())
    split = {**settings.device_options, **{k: v for k, v in settings.async_options.items() if k in DEVICE_OPTIONS}}
    if "async" in settings.modes:
        td, dd = (split.get(k) for k in DEVICE_OPTIONS)
        print(f"[eval] async: target on {td or 1} device(s), drafter on "
              f"{dd if dd is not None else 'the same one'} ({jax.device_count()} {jax.default_backend()} "
              f"devices)", flush=True)
    kw = dict(eos_token_ids=eos_ids, mask_token_id=mask_id, encode_fn=encode)
    results, raw = R.evaluate(target, drafter, tok, suites, settings, **kw)
    report = {"target": m.target, "drafter": m.drafter, "attention": target.config.attention_backend,
              "results": results,
              "async_devices": {k: split.get(k) for k in DEVICE_OPTIONS}}
    if cfg.eval.hf_peer:
        _hf_peer(cfg, tok, suites, raw, results, eos_ids, encode)
    out = Path(cfg.eval.out)
    if cfg.eval.async_sweep and "async" in settings.modes:
        first = next(iter(suites))
        report["async_sweep"] = R.budget_sweep(target, drafter, tok, suites[first], settings, cfg.eval.async_sweep,
                                               raw[first]["plain"], **kw)
        plots.budget_sweep(report["async_sweep"], out / "async_budget.png")
    print(_write(report, out))
    ok = all(r[m].get("equals_plain", True) for r in results.values() for m in ("sync", "async", "auto") if m in r)
    print(f"all sync/async/auto outputs equal plain greedy: {ok}")
    return 0 if ok else 3
