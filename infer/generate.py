#!/usr/bin/env python
"""Generate with plain, synchronous, asynchronous or auto speculative decoding.

  infer/generate.py --target PATH [--drafter PATH] --mode plain|sync|async|auto
                    (--prompt TEXT | --prompt-ids 1,2,3 | --prompts-file FILE.jsonl) ...

PATH is an HF Qwen3 directory or an exported d3d_jax parameter checkpoint.  A drafter's
config carries ``mask_token_id`` and ``block_size``; ``--mask-token-id`` / ``--block-size``
override or supply them.  A prompts file holds one JSON object per line with ``prompt_ids`` (token
ids), ``prompt`` (text) or ``messages`` (chat turns; the chat template is applied with
``enable_thinking=False``).  ``--json`` prints one JSON object per prompt.
The longest prompt plus ``--max-new-tokens`` must fit each model's ``max_position_embeddings``
(``--allow-beyond-context`` lifts that).  Bad input ends in one line on stderr (exit 2: flags and
paths, 1: file contents); ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="HF directory or d3d_jax parameter checkpoint")
    p.add_argument("--drafter", default=None, help="drafter checkpoint (modes sync, async)")
    p.add_argument("--mode", default=None, choices=("plain", "sync", "async", "auto"),
                   help="default: auto with --drafter (it picks plain, sync or async each round), else plain")
    src = p.add_argument_group("prompts (any mix; at least one)")
    src.add_argument("--prompt", action="append", default=[], help="text prompt (repeatable)")
    src.add_argument("--prompt-ids", action="append", default=[], help="comma-separated ids (repeatable)")
    src.add_argument("--prompts-file", default=None, help="JSONL: prompt_ids | prompt | messages")
    p.add_argument("--chat", action="store_true", help="wrap --prompt texts as a user turn in the chat template")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the target's)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--allow-beyond-context", action="store_true",
                   help="let prompt + max-new-tokens run past the model's max_position_embeddings")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None, help="default: the drafter's config, else 16")
    p.add_argument("--mask-token-id", type=int, default=None, help="default: the drafter's config")
    p.add_argument("--max-cache-len", type=int, default=None)
    p.add_argument("--eos-ids", default=None, help="comma-separated; default: config + tokenizer EOS")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--stop-ids", default="", help="comma-separated extra stop token ids")
    p.add_argument("--dtype", default=None, help="parameter/compute dtype (float32, bfloat16)")
    p.add_argument("--sample-drafts", action="store_true", help="sample drafts from q (sampling only)")
    p.add_argument("--loop", default="device", choices=("device", "host"),
                   help="device: fused on-device loop; host: per-round loop that times draft/verify")
    asy = p.add_argument_group("async mode (spec §5)")
    asy.add_argument("--branch-positions", type=int, default=None,
                     help="C: rejection slots 1..C-1 get branches (default min(12, block size))")
    asy.add_argument("--branch-fanout", type=int, default=None, help="F: alternatives per slot (default 2)")
    asy.add_argument("--target-devices", type=int, default=None,
                     help="devices for the target (with --drafter-devices: disjoint slices)")
    asy.add_argument("--drafter-devices", type=int, default=None, help="devices for the drafter")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="extra DecoderConfig field (repeatable), e.g. --option prior_tau=4")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    p.add_argument("--show-special-tokens", action="store_true",
                   help="keep special tokens (EOS, <|im_end|>...) in the text; by default they are "
                        "skipped, as the server, OpenAI, vLLM and transformers' skip_special_tokens do")
    argv = sys.argv[1:] if argv is None else list(argv)
    # simulated acceptance fakes τ and hit rate: it exists for benchmarks and nowhere else
    def refuse(name):
        p.error(f"{name} is benchmark-only (simulated acceptance): use infer/bench.py "
                f"gpu|engine|async --simulate-tau/--simulate-hit-rate")

    for a in argv:  # before parsing, which would only say "unrecognized arguments"
        if a.split("=", 1)[0] in BENCHMARK_ONLY_FLAGS:
            refuse(a.split("=", 1)[0])
    args = p.parse_args(argv)
    if args.mode is None:
        args.mode = "auto" if args.drafter is not None else "plain"
    for o in args.option:
        if o.split("=", 1)[0].strip() in BENCHMARK_ONLY_OPTIONS:
            refuse(f"--option {o.split('=', 1)[0].strip()}")
    return args


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


def eos_ids(args, target_cfg, tokenizer) -> list[int]:
    if args.ignore_eos:
        return []
    if args.eos_ids is not None:
        return _ids(args.eos_ids, "--eos-ids")
    from d3d_jax.io.hf import eos_token_ids

    return list(eos_token_ids(target_cfg, tokenizer))


def parse_option(text: str):
    import yaml

    if "=" not in text:
        raise UsageError(f"--option expects KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    return key.strip(), yaml.safe_load(value)


def load_drafter(args, load_model):
    """``(drafter or None, block size, mask id)`` for the mode, from flags and the drafter's config."""
    drafter, block, mask = None, args.block_size, args.mask_token_id
    if args.mode != "plain":
        if args.drafter is None:
            raise UsageError(f"--mode {args.mode} needs --drafter")
        drafter = load_model(args.drafter, dtype=args.dtype)
        mask = mask if mask is not None else drafter.config.mask_token_id
        block = block if block is not None else drafter.config.block_size
        if mask is None:
            raise UsageError("the drafter's config has no mask_token_id: pass --mask-token-id")
    elif args.drafter is not None:
        raise UsageError("--drafter given with --mode plain")
    return drafter, block or 16, mask


def mode_options(args, block: int) -> dict:
    """DecoderConfig fields of the flags; an async branch pack is sized (and refused) here, before work."""
    from d3d_jax.decoding.branches import BranchLayout

    options = dict(parse_option(o) for o in args.option)
    options.pop("verbose", None)  # an old engine option: the decoder prints nothing
    if args.sample_drafts:
        options.update(sample_drafts=True)
    async_flags = {k: getattr(args, k) for k in ("branch_positions", "branch_fanout", "target_devices",
                                                 "drafter_devices") if getattr(args, k) is not None}
    if args.mode == "async":
        options.update(branch_positions=min(12, block), branch_fanout=2)
        options.update(async_flags)
        BranchLayout(block, int(options["branch_positions"]), int(options["branch_fanout"])).validate()
    elif async_flags:
        raise UsageError(f"--{next(iter(async_flags)).replace('_', '-')} needs --mode async")
    if args.mode == "auto" and "prior_tau" not in options:
        from d3d_jax.decoding.auto import offline_tau

        options["prior_tau"] = offline_tau(args.drafter)
    return options


def main(argv=None):
    args = parse_args(argv)
    from d3d_jax.decoding import engine
    from d3d_jax.io.checkpoint import load_model
    from d3d_jax.io.hf import has_tokenizer, load_tokenizer

    target = load_model(args.target, dtype=args.dtype)
    vocab = target.config.vocab_size
    tok_path = Path(args.tokenizer) if args.tokenizer else Path(args.target)
    tokenizer = load_tokenizer(tok_path, vocab)[0] if args.tokenizer or has_tokenizer(tok_path) else None
    prompts = collect_prompts(args, tokenizer, vocab)
    drafter, block, mask = load_drafter(args, load_model)
    for flag, model in (("--target", target), ("--drafter", drafter)):
        if model is not None:
            records.check_context(max(map(len, prompts)), args.max_new_tokens, model.config.max_position_embeddings,
                                  model=f"{flag} {getattr(args, flag[2:])}", allow_beyond=args.allow_beyond_context,
                                  hint="--allow-beyond-context")
    options = mode_options(args, block)
    loop = options.pop("loop", args.loop)
    try:
        cache_len = engine.cache_len_for(prompts, args.max_new_tokens, block, args.max_cache_len)
        dec = engine.make_decoder(target, drafter, mode=args.mode, num_slots=args.batch_size or len(prompts),
                                  max_cache_len=cache_len, block_size=block, mask_token_id=mask, **options)
        timer = None
        if loop == "host" and args.mode in ("plain", "sync"):
            from d3d_jax.bench.clock import PhaseTimer

            timer = PhaseTimer()
        outs = engine.generate(dec, prompts, sampling=engine.SamplingParams(args.temperature, args.top_p, args.top_k),
                               max_new_tokens=args.max_new_tokens, eos_token_ids=eos_ids(args, target.config, tokenizer),
                               stop_token_ids=_ids(args.stop_ids, "--stop-ids"), seed=args.seed, timer=timer)
    except UsageError:
        raise
    except ValueError as e:  # the engine checks its arguments with ValueError
        raise UsageError(str(e)) from None
    for i, o in enumerate(outs):
        text = (tokenizer.decode(o.token_ids, skip_special_tokens=not args.show_special_tokens)
                if tokenizer is not None else None)
        if args.json:
            print(json.dumps({"index": i, "token_ids": o.token_ids, "text": text,
                              "finish_reason": o.finish_reason, "tau": o.metrics["tau"],
                              "tokens_per_s": o.metrics["tokens_per_s"], "metrics": o.metrics}))
        else:
            print(f"--- [{i}] {o.finish_reason}, {len(o.token_ids)} tokens, tau {o.metrics['tau']:.2f}")
            print(text if text is not None else " ".join(map(str, o.token_ids)))
    summary = engine.summarize_outputs(outs)
    print(json.dumps({"summary": summary}) if args.json else
          f"=== {summary['requests']} prompts, {summary['num_tokens']} tokens, tau {summary['tau']:.2f}, "
          f"{summary['tokens_per_s']:.1f} tokens/s", file=sys.stderr)
    return outs


if __name__ == "__main__":
    from d3d_jax.cli import run_cli

    sys.exit(run_cli(main))
