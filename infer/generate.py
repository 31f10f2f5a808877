#!/usr/bin/env python
"""Generate with plain, synchronous, asynchronous or auto speculative decoding.

  infer/generate.py --target PATH [--drafter PATH] --mode plain|sync|async|auto
                    (--prompt TEXT | --prompt-ids 1,2,3 | --prompts-file FILE.jsonl) ...

PATH is an HF Qwen3 directory or an exported d3d_jax parameter checkpoint.  A drafter's
config carries ``mask_token_id`` and ``block_size``; ``--mask-token-id`` / ``--block-size``
override or supply them.  A prompts file holds one JSON object per line with ``prompt_ids`` (token
ids), ``prompt`` (text) or ``messages`` (chat turns; the chat template is applied with
``enable_thinking=False``).  ``--json`` prints one JSON object per prompt.
Every flag but the prompts sets a field of d3d_jax/config/generate.py's GenerateConfig; ``--config
FILE`` and ``key=value`` overrides (``decoder.branch_fanout=3``) set them too (files, flags, overrides).
The longest prompt plus ``--max-new-tokens`` must fit each model's ``max_position_embeddings``
(``--allow-beyond-context`` lifts that).  Bad input ends in one line on stderr (exit 2: flags and
paths, 1: file contents); ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from d3d_jax.errors import DataError, RecordError, UsageError  # noqa: E402
from d3d_jax.io import records  # noqa: E402


BENCHMARK_ONLY_FLAGS = ("--simulate-tau", "--simulate-hit-rate", "--simulate-seed")
BENCHMARK_ONLY_OPTIONS = ("acceptance_rule", "acceptance_override")


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every flag but the prompts sets a :class:`~d3d_jax.config.generate.GenerateConfig` field."""
    from d3d_jax.config import (GenerateConfig, add_auto_flags, add_config_arguments, add_device_flags, add_model_flags,
                                config_flag)
    from d3d_jax.config.flags import add_kv_flags

    add_config_arguments(p, "generate.yaml")
    flag = functools.partial(config_flag, p)
    add_model_flags(p)
    src = p.add_argument_group("prompts (any mix; at least one)")
    src.add_argument("--prompt", action="append", default=[], help="text prompt (repeatable)")
    src.add_argument("--prompt-ids", action="append", default=[], help="comma-separated ids (repeatable)")
    src.add_argument("--prompts-file", default=None, help="JSONL: prompt_ids | prompt | messages")
    src.add_argument("--chat", action="store_true", help="wrap --prompt texts as a user turn in the chat template")
    flag("--max-new-tokens", key="generate.max_new_tokens", type=int, help="default 128")
    flag("--allow-beyond-context", key="generate.allow_beyond_context", action="store_true",
         help="let prompt + max-new-tokens run past the model's max_position_embeddings")
    flag("--temperature", key="generate.temperature", type=float, help="default 0: greedy")
    flag("--top-p", key="generate.top_p", type=float)
    flag("--top-k", key="generate.top_k", type=int)
    flag("--seed", key="generate.seed", type=int)
    flag("--batch-size", key="decoder.num_slots", type=int, help="default: every prompt in one batch")
    flag("--block-size", key="decoder.block_size", type=int, help="default: the drafter's config, else 16")
    flag("--mask-token-id", key="generate.mask_token_id", type=int, help="default: the drafter's config")
    flag("--max-cache-len", key="decoder.max_cache_len", type=int, help="default: what the prompts need")
    flag("--eos-ids", key="generate.eos_ids", help="comma-separated; default: config + tokenizer EOS")
    flag("--ignore-eos", key="generate.ignore_eos", action="store_true")
    flag("--stop-ids", key="generate.stop_ids", help="comma-separated extra stop token ids")
    flag("--sample-drafts", key="decoder.sample_drafts", action="store_true", help="sample drafts from q (sampling only)")
    flag("--loop", key="generate.loop", choices=("device", "host"),
         help="device: fused on-device loop; host: per-round loop that times draft/verify")
    asy = p.add_argument_group("async mode (spec §5)")
    asy.add_argument("--branch-positions", dest="decoder.branch_positions", type=int, default=argparse.SUPPRESS,
                     help="C: rejection slots 1..C-1 get branches (default min(12, block size))")
    asy.add_argument("--branch-fanout", dest="decoder.branch_fanout", type=int, default=argparse.SUPPRESS,
                     help="F: alternatives per slot (default 2)")
    add_auto_flags(p)
    add_kv_flags(p, GenerateConfig)
    add_device_flags(p)
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="extra DecoderConfig field (repeatable), e.g. --option row_buckets=[1,4]")
    flag("--json", key="generate.json", action="store_true", help="one JSON object per prompt")
    from d3d_jax import compile_cache

    compile_cache.add_flag(p)
    flag("--show-special-tokens", key="generate.show_special_tokens", action="store_true",
         help="keep special tokens (EOS, <|im_end|>...) in the text; by default they are "
              "skipped, as the server, OpenAI, vLLM and transformers' skip_special_tokens do")
    return p


def parse_args(argv=None):
    """``(args, GenerateConfig)``: ``--config`` files, then the flags, then ``key=value`` overrides."""
    from d3d_jax.config import GenerateConfig, load_command_config

    p = add_arguments(argparse.ArgumentParser(description=__doc__,
                                              formatter_class=argparse.RawDescriptionHelpFormatter))
    argv = sys.argv[1:] if argv is None else list(argv)
    # simulated acceptance fakes τ and hit rate: it exists for benchmarks and nowhere else
    def refuse(name):
        p.error(f"{name} is benchmark-only (simulated acceptance): use infer/bench.py "
                f"gpu|engine|async --simulate-tau/--simulate-hit-rate")

    for a in argv:  # before parsing, which would only say "unrecognized arguments"
        if a.split("=", 1)[0] in BENCHMARK_ONLY_FLAGS:
            refuse(a.split("=", 1)[0])
    args = p.parse_intermixed_args(argv)
    for o in args.option:
        if o.split("=", 1)[0].strip() in BENCHMARK_ONLY_OPTIONS:
            refuse(f"--option {o.split('=', 1)[0].strip()}")
    check_limits(args)
    return args, load_command_config(GenerateConfig, args)


def check_limits(args) -> None:
    """Every number a flag gives, against what the program can do (:mod:`d3d_jax.config.limits`),
    named by its flag (a flag's destination is the config field it sets)."""
    from d3d_jax.config import limits as L

    given = lambda key, default: getattr(args, key, default)  # noqa: E731  (flags not given are absent)
    L.check_sampling("--", temperature=given("generate.temperature", 0.0), top_p=given("generate.top_p", 1.0),
                     top_k=given("generate.top_k", 0), seed=given("generate.seed", 0),
                     max_new_tokens=given("generate.max_new_tokens", 1))
    for flag, key, lo, hi in (("--batch-size", "decoder.num_slots", 1, L.MAX_SLOTS),
                              ("--block-size", "decoder.block_size", 2, L.MAX_BLOCK_SIZE),
                              ("--max-cache-len", "decoder.max_cache_len", 2, L.MAX_CACHE_LEN),
                              ("--mask-token-id", "generate.mask_token_id", 0, L.INT32_MAX),
                              ("--branch-positions", "decoder.branch_positions", 2, L.MAX_BLOCK_SIZE),
                              ("--branch-fanout", "decoder.branch_fanout", 1, L.MAX_SLOTS)):
        if given(key, None) is not None:
            L.require_int(given(key, None), flag, lo, hi)


def _ids(text: str, what: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise UsageError(f"{what}: expected comma-separated integers, got {text!r}") from None


def collect_prompts(args, tokenizer, vocab_size: int) -> list[list[int]]:
    def need_tok(what):
        if tokenizer is None:
            raise UsageError(f"{what} needs a tokenizer: pass --tokenizer DIR (the target directory has none)")
        return tokenizer

    def encode_text(text):
        tok = need_tok("a text prompt")
        if args.chat:
            return encode_messages([{"role": "user", "content": text}])
        return tok.encode(text, add_special_tokens=False)

    def encode_messages(messages):
        tok = need_tok("a chat prompt")
        try:
            out = tok.apply_chat_template(records.chat_messages(messages), tokenize=True,
                                          add_generation_prompt=True, enable_thinking=False)
        except RecordError:
            raise
        except Exception as e:  # the template rejected the turns
            raise RecordError(f"chat template failed: {e}") from None
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    prompts = [encode_text(t) for t in args.prompt]
    prompts += [_ids(t, "--prompt-ids") for t in args.prompt_ids]
    if args.prompts_file:
        for n, raw in records.jsonl_lines(args.prompts_file):
            try:
                prompts.append(_file_prompt(records.decode_line(raw), vocab_size, encode_messages, encode_text))
            except RecordError as e:
                raise DataError(f"{args.prompts_file}:{n}: {e}") from None
    if not prompts:
        raise UsageError("no prompts: give --prompt, --prompt-ids or --prompts-file")
    return prompts


def _file_prompt(rec, vocab_size: int, encode_messages, encode_text) -> list[int]:
    """One prompts-file line: ``prompt_ids`` (checked against the vocabulary), ``messages`` or ``prompt``."""
    if not isinstance(rec, dict):
        raise RecordError(f"a line must be a JSON object, got {type(rec).__name__}")
    if "prompt_ids" in rec:
        return records.token_ids(rec["prompt_ids"], "prompt_ids", vocab_size).tolist()
    if "messages" in rec:
        return encode_messages(rec["messages"])
    if isinstance(rec.get("prompt"), str):
        return encode_text(rec["prompt"])
    raise RecordError("needs prompt_ids (ids), prompt (text) or messages (chat turns)")


def eos_ids(g, target_cfg, tokenizer) -> list[int]:
    if g.ignore_eos:
        return []
    if g.eos_ids is not None:
        return list(g.eos_ids)
    from d3d_jax.io.hf import eos_token_ids

    return list(eos_token_ids(target_cfg, tokenizer))


def parse_option(text: str):
    from d3d_jax.config.base import parse_scalar

    if "=" not in text:
        raise UsageError(f"--option expects KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    return key.strip(), parse_scalar(value, f"--option {key.strip()[:100]}")


def load_drafter(cfg, load_model):
    """``(drafter or None, its mask id)`` for the mode; the mode and the drafter agree (checked at load)."""
    if cfg.models.drafter is None:
        return None, cfg.generate.mask_token_id
    drafter = load_model(cfg.models.drafter)
    trained, block = drafter.config.block_size, cfg.decoder.block_size
    if block is not None and trained is not None and block > trained:
        raise UsageError(f"--block-size {block} is more than the drafter was trained for ({trained}): its "
                         f"slots past {trained} were never trained; use --block-size {trained} or less")
    mask = cfg.generate.mask_token_id
    mask = mask if mask is not None else drafter.config.mask_token_id
    if mask is None:
        raise UsageError("the drafter's config has no mask_token_id: pass --mask-token-id")
    return drafter, mask


def decoder_settings(cfg, drafter_cfg, num_prompts: int):
    """The decoder settings with every default filled in (the cache length is the prompts' to set)."""
    return cfg.decoder.resolved(has_drafter=drafter_cfg is not None,
                                drafter_block_size=drafter_cfg.block_size if drafter_cfg is not None else None,
                                num_slots=num_prompts)


def mode_options(args, settings, drafter_path) -> dict:
    """DecoderConfig fields of the settings and ``--option``; an async branch pack is sized (and
    refused) here, before work."""
    from d3d_jax.decoding.branches import BranchLayout
    from d3d_jax.decoding.settings import decoder_fields

    options = decoder_fields(settings, drafter_path)
    for key in ("mode", "num_slots", "max_cache_len", "block_size"):
        options.pop(key, None)
    options.update(parse_option(o) for o in args.option)
    options.pop("verbose", None)  # an old engine option: the decoder prints nothing
    if settings.mode == "async":
        BranchLayout(settings.block_size, int(options["branch_positions"]), int(options["branch_fanout"])).validate()
    return options


def _check_context(cfg, prompts, target, drafter) -> None:
    g = cfg.generate
    for flag, model in (("--target", target), ("--drafter", drafter)):
        if model is not None:
            records.check_context(max(map(len, prompts)), g.max_new_tokens, model.config.context_length,
                                  model=f"{flag} {getattr(cfg.models, flag[2:])}", allow_beyond=g.allow_beyond_context,
                                  hint="--allow-beyond-context")


def placement_report(dec) -> dict:
    """Where the decoder's models live: each side's devices (0: no drafter) and the target's
    parameter bytes, whole and on its most loaded device (about the whole over N, split N ways)."""
    from d3d_jax.parallel.sharding import bytes_per_device, devices_of

    t_leaves, d_leaves = dec.param_leaves()
    return dict(target_devices=len(devices_of(t_leaves)), drafter_devices=len(devices_of(d_leaves)),
                target_param_bytes=int(sum(x.nbytes for x in t_leaves)),
                target_param_bytes_per_device=bytes_per_device(t_leaves))


def _print(cfg, outs, tokenizer, run: dict) -> None:
    """``run``: what every JSON object also says about how it was decoded (the attention backend)."""
    from d3d_jax.decoding import engine

    g = cfg.generate
    for i, o in enumerate(outs):
        text = (tokenizer.decode(o.token_ids, skip_special_tokens=not g.show_special_tokens)
                if tokenizer is not None else None)
        if g.json:
            print(json.dumps({"index": i, "token_ids": o.token_ids, "text": text,
                              "finish_reason": o.finish_reason, "tau": o.metrics["tau"],
                              "tokens_per_s": o.metrics["tokens_per_s"], "metrics": o.metrics, **run}))
        else:
            print(f"--- [{i}] {o.finish_reason}, {len(o.token_ids)} tokens, tau {o.metrics['tau']:.2f}")
            print(text if text is not None else " ".join(map(str, o.token_ids)))
    summary = engine.summarize_outputs(outs)
    compile_s = summary.get("compile_s") or 0.0  # tracing, lowering and compiling: not in tokens_per_s
    print(json.dumps({"summary": {**summary, **run}}) if g.json else
          f"=== {summary['requests']} prompts, {summary['num_tokens']} tokens, tau {summary['tau']:.2f}, "
          f"{summary['tokens_per_s']:.1f} tokens/s decoding (compile excluded); compile {compile_s:.2f} s; "
          f"attention {run['attention']}",
          file=sys.stderr)


def main(argv=None):
    args, cfg = parse_args(argv)
    from d3d_jax.decoding import engine
    from d3d_jax.io.checkpoint import load_decoding_model
    from d3d_jax.io.hf import has_tokenizer, load_tokenizer
    from d3d_jax.io.pairing import check_pairing
    from d3d_jax.parallel.sharding import model_meshes

    from d3d_jax import compile_cache
    from d3d_jax.bench.clock import CompileClock
    from d3d_jax.bench.phased import host_loop

    g, m = cfg.generate, cfg.models
    programs = compile_cache.enable(args.compile_cache)  # before anything compiles
    # each model read straight onto its slice when a split is asked for (no whole copy on device 0)
    t_mesh, d_mesh = model_meshes(cfg.decoder.derived(has_drafter=m.drafter is not None)["mode"],
                                  cfg.decoder.target_devices, cfg.decoder.drafter_devices)
    load_model = functools.partial(load_decoding_model, dtype=m.dtype, attention=m.attention)
    target = load_model(m.target, mesh=t_mesh)
    vocab = target.config.vocab_size
    tok_path = Path(m.tokenizer) if m.tokenizer else Path(m.target)
    tokenizer = load_tokenizer(tok_path, vocab)[0] if m.tokenizer or has_tokenizer(tok_path) else None
    prompts = collect_prompts(args, tokenizer, vocab)
    drafter, mask = load_drafter(cfg, functools.partial(load_model, mesh=d_mesh))
    eos = eos_ids(g, target.config, tokenizer)
    mask = check_pairing(tokenizer, target.config, drafter.config if drafter is not None else None,
                         mask_token_id=g.mask_token_id, eos_ids=eos, where=f"--drafter {m.drafter}")
    _check_context(cfg, prompts, target, drafter)
    settings = decoder_settings(cfg, drafter.config if drafter is not None else None, len(prompts))
    options = mode_options(args, settings, m.drafter)
    loop = options.pop("loop", g.loop)
    try:
        cache_len = engine.cache_len_for(prompts, g.max_new_tokens, settings.block_size, settings.max_cache_len)
        dec = engine.make_decoder(target, drafter, mode=settings.mode, num_slots=settings.num_slots,
                                  max_cache_len=cache_len, block_size=settings.block_size, mask_token_id=mask,
                                  program_dir=programs, **options)
        outs = engine.generate(dec, prompts, sampling=engine.SamplingParams(g.temperature, g.top_p, g.top_k),
                               max_new_tokens=g.max_new_tokens, eos_token_ids=eos,
                               stop_token_ids=list(g.stop_ids), seed=g.seed,
                               loop=host_loop(settings.mode) if loop == "host" else None, clock=CompileClock)
    except UsageError:
        raise
    except ValueError as e:  # the engine checks its arguments with ValueError
        raise UsageError(str(e)) from None
    _print(cfg, outs, tokenizer, dict(attention=target.config.attention_backend, **placement_report(dec)))
    return outs


if __name__ == "__main__":
    from d3d_jax.cli import run_cli

    sys.exit(run_cli(main))
