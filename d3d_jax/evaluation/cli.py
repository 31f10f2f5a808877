"""``infer/bench.py eval`` (``add_arguments`` + ``main``, the bench command contract): Table 1 for any target + drafter (HF Qwen3 dirs or param checkpoints).

    python infer/bench.py eval --target /models/Qwen3-8B --drafter /models/d3d-8b \\
        --benchmarks humaneval gsm8k=/data/gsm8k/test.jsonl mtbench=/data/mt_bench/question.jsonl \\
        --samples 80 --max-new-tokens 2048 --out runs/eval

On a CPU-only host ``infer/bench.py`` gives the process two host devices for this command
(``--cpu-devices``), so async places target and drafter on disjoint devices by default.

Writes ``results.json``, ``table.md`` and the plots under ``--out`` and prints the table.
Exit status 3 when any sync/async/auto output differs from plain greedy decoding.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from d3d_jax.errors import UsageError


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    ap.description = __doc__
    ap.formatter_class = argparse.RawDescriptionHelpFormatter
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--tokenizer", default=None, help="tokenizer dir (default: the target's dir)")
    ap.add_argument("--benchmarks", nargs="+", default=["humaneval"],
                    help="NAME or NAME=PATH (gsm8k, math500, aime25, humaneval, mbpp, livecodebench, "
                         "mtbench, shakespeare, stdlib)")
    ap.add_argument("--samples", type=int, default=16, help="per benchmark (fewest prompt-length buckets)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--allow-beyond-context", action="store_true",
                    help="let prompt + max-new-tokens run past the target's max_position_embeddings")
    ap.add_argument("--block-size", type=int, default=None, help="default: the drafter's config")
    ap.add_argument("--modes", default="plain,sync,async", help="of plain, sync, async, auto")
    ap.add_argument("--template", choices=("standard", "plain"), default="standard")
    ap.add_argument("--branch-positions", type=int, default=None, help="async C (default min(12, B))")
    ap.add_argument("--branch-fanout", type=int, default=2, help="async F")
    ap.add_argument("--async-sweep", default="", help="C×F points, e.g. 4x2,8x2,12x2")
    ap.add_argument("--hf-peer", action="store_true", help="also transformers assisted generation")
    ap.add_argument("--concurrency", type=int, default=1,
                    help="requests in flight in one long-lived decoder per mode (default 1: batch 1)")
    ap.add_argument("--target-devices", type=int, default=None,
                    help="async: devices for the target (default: half of them when there are two or "
                         "more, so target and drafter run on disjoint devices; with one, both share it)")
    ap.add_argument("--drafter-devices", type=int, default=None,
                    help="async: devices for the drafter (default: the rest)")
    ap.add_argument("--dtype", default=None,
                    help="parameter/compute dtype of both models (default: each checkpoint's; on a CPU, "
                         "float32 is the fast one)")
    ap.add_argument("--out", default="runs/eval")
    return ap


def device_split(target_devices: int | None, drafter_devices: int | None, available: int
                 ) -> tuple[int | None, int | None]:
    """Async device counts: as given, or by default disjoint halves whenever two devices exist
    (None, None: one device, both share it).  Too many devices asked for is one UsageError."""
    if target_devices is None and drafter_devices is None:
        if available < 2:
            return None, None
        return available - available // 2, available // 2
    if target_devices is None or drafter_devices is None:
        given = target_devices if target_devices is not None else drafter_devices
        if given < 1 or given >= available:
            raise UsageError(f"--target-devices/--drafter-devices: {given} leaves no device for the "
                             f"other side ({available} devices)")
        rest = available - given
        return (given, rest) if target_devices is not None else (rest, given)
    if target_devices < 1 or drafter_devices < 1 or target_devices + drafter_devices > available:
        raise UsageError(f"--target-devices {target_devices} + --drafter-devices {drafter_devices}: "
                         f"need 1 or more each and at most {available} in all")
    return target_devices, drafter_devices


def check_limits(args, target, longest: int, block: int, modes: tuple[str, ...]) -> None:
    """Before any decoding: the longest prompt + max_new_tokens fits the target, the branch pack is sane."""
    from d3d_jax.decoding.branches import BranchLayout
    from d3d_jax.io.records import check_context

    check_context(longest, args.max_new_tokens, target.config.max_position_embeddings,
                  model=f"--target {args.target}", allow_beyond=args.allow_beyond_context,
                  hint="--allow-beyond-context")
    if "async" in modes:
        BranchLayout(block, args.branch_positions or min(12, block), args.branch_fanout).validate()


def main(args) -> int:
    if args.concurrency < 1:
        raise SystemExit(f"error: --concurrency must be >= 1, got {args.concurrency}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from d3d_jax import demo
    from d3d_jax.evaluation import benchmarks as B
    from d3d_jax.evaluation import plots
    from d3d_jax.io.checkpoint import load_model
    from d3d_jax.io.hf import eos_token_ids, load_tokenizer

    modes = tuple(m for m in args.modes.split(",") if m)
    if "plain" not in modes:
        raise UsageError("--modes must include plain (speedups and the equality check are against it)")
    target = load_model(args.target, dtype=args.dtype)
    tok, mask_id = load_tokenizer(args.tokenizer or args.target, target.config.vocab_size)
    drafter = load_model(args.drafter, dtype=args.dtype)
    mask_id = drafter.config.mask_token_id if drafter.config.mask_token_id is not None else mask_id
    block = args.block_size or drafter.config.block_size or 16
    eos_ids = eos_token_ids(target.config, tok)
    suites = {}
    for spec in args.benchmarks:
        name, _, path = spec.partition("=")
        samples = B.load_benchmark(name, path or None, template=args.template)
        lengths = [len(demo.chat_prompt_ids(tok, [{"role": "user", "content": s.turns[0]}])) for s in samples]
        suites[name] = B.select_by_length(samples, lengths, args.samples)
    longest = max(len(demo.chat_prompt_ids(tok, [{"role": "user", "content": t}]))
                  for ss in suites.values() for s in ss for t in s.turns[:1])
    check_limits(args, target, longest, block, modes)
    settings = B.EvalSettings(max_new_tokens=args.max_new_tokens, block_size=block, modes=modes,
                              concurrency=args.concurrency,
                              max_cache_len=-(-(2 * longest + 2 * args.max_new_tokens + 4 * block) // 64) * 64,
                              async_options={"branch_positions": args.branch_positions or min(12, block),
                                             "branch_fanout": args.branch_fanout} if "async" in modes else {})
    if "auto" in modes:
        from d3d_jax.decoding.auto import offline_tau

        settings.auto_options = {"prior_tau": offline_tau(args.drafter)}
    if "async" in modes:
        import jax

        td, dd = device_split(args.target_devices, args.drafter_devices, jax.device_count())
        if td is not None:
            settings.async_options.update(target_devices=td, drafter_devices=dd)
        print(f"[eval] async: target on {td or 1} device(s), drafter on "
              f"{dd if dd is not None else 'the same one'} ({jax.device_count()} {jax.default_backend()} "
              f"devices)", flush=True)
    kw = dict(eos_token_ids=eos_ids, mask_token_id=mask_id, encode_fn=demo.chat_prompt_ids)
    results, raw = B.evaluate(target, drafter, tok, suites, settings, **kw)
    report = {"target": args.target, "drafter": args.drafter, "results": results,
              "async_devices": {k: settings.async_options.get(k) for k in ("target_devices", "drafter_devices")}}
    if args.hf_peer:
        from d3d_jax.evaluation.assisted import hf_assisted_generation

        for s, samples in suites.items():
            prompts = [demo.chat_prompt_ids(tok, [{"role": "user", "content": x.turns[0]}]) for x in samples]
            peer = hf_assisted_generation(args.target, args.drafter, prompts, max_new_tokens=args.max_new_tokens,
                                          eos_token_ids=eos_ids, reference_outputs=raw[s]["plain"].outputs[:len(prompts)]
                                          if all(len(x.turns) == 1 for x in samples) else None)
            results[s]["hf_plain"], results[s]["hf_assisted"] = peer["plain"], peer["hf_assisted"]
    out = Path(args.out)
    if args.async_sweep and "async" in modes:
        grid = [tuple(int(v) for v in pt.split("x")) for pt in args.async_sweep.split(",")]
        first = next(iter(suites))
        report["async_sweep"] = B.budget_sweep(target, drafter, tok, suites[first], settings, grid,
                                               raw[first]["plain"], **kw)
        plots.budget_sweep(report["async_sweep"], out / "async_budget.png")
    B.write_json(report, out / "results.json")
    table = B.table1(results)
    (out / "table.md").write_text(table + "\n")
    plots.acceptance_histogram(results, out / "acceptance_histogram.png")
    plots.tau_per_slot(results, out / "tau_per_slot.png")
    print(table)
    ok = all(r[m].get("equals_plain", True) for r in results.values() for m in ("sync", "async", "auto") if m in r)
    print(f"all sync/async/auto outputs equal plain greedy: {ok}")
    return 0 if ok else 3
