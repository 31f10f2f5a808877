r"""Regenerate every response with the target (spec §2.1): resumable, continuously batched, multi-host.

    python train/regenerate_data.py --target PATH --prompts prompts.jsonl --out data.jsonl \
        [--config regen.yaml] [--greedy] [--max-new-tokens N] [--batch-size N] [--seed N] \
        [--process-index I --process-count N] [key=value ...]

Rerun the same command after an interruption: only prompts whose ids are not in ``--out`` yet
are generated.  With several processes each writes ``<out stem>-<i>-of-<n><suffix>``; when all
have finished, ``--merge --process-count N --prompts FILE --out FILE`` joins them into ``--out``
and reports prompts still without a record.
Settings are ``d3d_jax.config.RegenerateConfig`` fields (YAML, flags, or ``key=value``); each
process loads the target onto ``mesh`` over its own ``num_devices`` devices (default: all).
Bad input ends in one line on stderr (exit 2: flags/config/paths, 1: file contents); ``--debug``
shows the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from d3d_jax.config import ATTENTION_CHOICES, RegenerateConfig, load_config  # noqa: E402


def check_before_loading(args, cfg):
    """Everything that can be checked without the weights; returns the tokenizer."""
    from d3d_jax.errors import UsageError
    from d3d_jax.io.checkpoint import stored_model_config
    from d3d_jax.io.hf import eos_token_ids, open_tokenizer
    from d3d_jax.io.pairing import check_pairing
    from d3d_jax.io import records

    if not os.path.isfile(args.prompts):
        raise UsageError(f"--prompts {args.prompts}: no such file")
    target_cfg = stored_model_config(args.target)
    records.check_context(1, cfg.max_new_tokens, target_cfg.context_length, model=args.target)
    tokenizer = open_tokenizer(args.tokenizer or args.target, vocab_size=target_cfg.vocab_size,
                               hint="" if args.tokenizer else " (pass --tokenizer DIR)")
    check_pairing(tokenizer, target_cfg, eos_ids=eos_token_ids(target_cfg, tokenizer))
    return tokenizer


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="HF Qwen3 directory or d3d_jax parameter checkpoint")
    ap.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --target)")
    ap.add_argument("--prompts", required=True, help="JSONL: messages / conversations / prompt per line")
    ap.add_argument("--out", required=True, help="output JSONL (appended to; resumable)")
    ap.add_argument("--config", action="append", default=[], help="YAML with RegenerateConfig fields")
    ap.add_argument("--greedy", action="store_true", default=None)
    ap.add_argument("--enable-thinking", action="store_true", default=None,
                    help="render prompts with the chat template's enable_thinking (thinking-mode responses)")
    ap.add_argument("--max-new-tokens", type=int)
    ap.add_argument("--batch-size", type=int, help="rows decoded together (a finished row takes the next prompt)")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--attention", choices=ATTENTION_CHOICES,
                    help="attention backend: auto (default: the fused kernels on GPU and TPU, xla on a CPU), xla or pallas")
    ap.add_argument("--target-devices", "--tensor-parallel-size", dest="target_devices", type=int,
                    help="the target tensor-parallel over this many of this process's devices (heads, MLP "
                         "and KV cache split): num_devices=N mesh.fsdp=1 mesh.tensor=-1")
    ap.add_argument("--max-records", type=int)
    ap.add_argument("--process-index", type=int)
    ap.add_argument("--process-count", type=int)
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--merge", action="store_true",
                    help="after every process finished: join the --process-count shard files into --out")
    ap.add_argument("--endpoint", help="an OpenAI-compatible server's API base URL (vLLM, SGLang, "
                                       "infer/serve.py), e.g. http://host:8000/v1, instead of loading --target")
    ap.add_argument("--api-key", default=None, help="the server's API key (default: $OPENAI_API_KEY)")
    ap.add_argument("--concurrency", type=int, help="--endpoint: requests in flight per process")
    ap.add_argument("--model", help="--endpoint: the served model's name (default: the server's first)")
    from d3d_jax import compile_cache

    compile_cache.add_flag(ap)
    ap.add_argument("overrides", nargs="*", help="key=value RegenerateConfig overrides")
    args = ap.parse_intermixed_args(argv)  # key=value before and after each --config

    flags = {"greedy": args.greedy, "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size,
             "seed": args.seed, "attention": args.attention, "max_records": args.max_records,
             "process_index": args.process_index, "process_count": args.process_count, "endpoint": args.endpoint,
             "concurrency": args.concurrency, "model": args.model, "enable_thinking": args.enable_thinking}
    overrides = [f"{k}={v}" for k, v in flags.items() if v is not None] + list(args.overrides)
    if args.target_devices is not None and args.target_devices < 1:
        ap.error(f"--target-devices: must be >= 1, got {args.target_devices}")
    if args.target_devices is not None:  # before the key=value overrides, which win
        overrides[:0] = [f"num_devices={args.target_devices}", "mesh.fsdp=1", "mesh.tensor=-1"]
    cfg = load_config(RegenerateConfig, args.config, overrides)
    if args.merge:
        import json

        from d3d_jax.training.regenerate import merge_shards

        if cfg.process_count is None:
            ap.error("--merge needs --process-count")
        result = merge_shards(args.out, cfg.process_count, args.prompts)
        print(json.dumps({**result, "missing": len(result["missing"]), "missing_ids": result["missing"][:50]}))
        return 0
    if cfg.endpoint:
        return _via_endpoint(args, cfg)
    if not args.target:
        ap.error("--target is required (except with --merge or --endpoint)")

    tokenizer = check_before_loading(args, cfg)

    import jax

    from d3d_jax.io.checkpoint import load_decoding_model
    from d3d_jax.parallel.sharding import make_mesh
    from d3d_jax.training import regenerate as rg

    programs = compile_cache.enable(args.compile_cache)  # before anything compiles: a rerun compiles nothing
    # This process's own devices only: other processes regenerate other prompts.
    devices = jax.local_devices()
    if cfg.num_devices > len(devices):
        raise UsageError(f"num_devices={cfg.num_devices} but this process has {len(devices)} devices")
    mesh = make_mesh(cfg.mesh, devices[: cfg.num_devices or len(devices)])
    # one module per layer, as the decoder runs it: the decoder reads these arrays, no copy
    dtype = rg.compute_dtype(cfg.dtype, mesh.devices.flat[0].platform)
    target = load_decoding_model(args.target, mesh=mesh, dtype=dtype, attention=cfg.attention)
    summary = rg.regenerate(target, tokenizer, args.prompts, args.out,
                            settings=rg.settings_from_config(cfg, args.target), batch_size=cfg.batch_size,
                            process_index=cfg.process_index,
                            process_count=cfg.process_count, target_path=args.target,
                            max_records=cfg.max_records, max_prompt_tokens=cfg.max_prompt_tokens,
                            cache_multiple=cfg.cache_multiple, progress=not args.no_progress,
                            max_skipped_fraction=cfg.max_skipped_fraction, enable_thinking=cfg.enable_thinking,
                            program_dir=programs)
    print(summary.format())
    return 0


def _via_endpoint(args, cfg) -> int:
    """The prompts through a running server: no weights here; a tokenizer only if given."""
    from d3d_jax.errors import UsageError
    from d3d_jax.io.hf import open_tokenizer
    from d3d_jax.training import regen_endpoint as ep
    from d3d_jax.training import regenerate as rg

    if not os.path.isfile(args.prompts):
        raise UsageError(f"--prompts {args.prompts}: no such file")
    tok_dir = args.tokenizer or args.target
    tokenizer = open_tokenizer(tok_dir) if tok_dir else None
    endpoint = ep.Endpoint(cfg.endpoint, cfg.model, args.api_key or os.environ.get("OPENAI_API_KEY"),
                           cfg.concurrency, cfg.request_timeout_s, cfg.retry_s)
    summary = ep.regenerate_via_endpoint(
        endpoint, args.prompts, args.out, settings=rg.settings_from_config(cfg, tok_dir), tokenizer=tokenizer,
        thinking=cfg.enable_thinking,
        process_index=cfg.process_index or 0, process_count=cfg.process_count or 1, max_records=cfg.max_records,
        max_skipped_fraction=cfg.max_skipped_fraction, progress=not args.no_progress)
    print(summary.format())
    return 0


if __name__ == "__main__":
    from d3d_jax.cli import run_cli

    sys.exit(run_cli(main))
