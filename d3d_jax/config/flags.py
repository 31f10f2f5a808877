"""Command-line flags as config fields: one declaration says which field a flag sets.

A program declares ``config_flag(parser, "--block-size", key="decoder.block_size", type=int)``:
the flag's destination is the field's dotted key and its argparse default is "absent", so a flag
that was not given leaves the YAML's (or the dataclass's) value alone — the defaults live only in
the config dataclasses.  :func:`load_command_config` merges, later winning: ``--config`` files,
then the flags given, then ``key=value`` overrides; then it validates.
"""

from __future__ import annotations

import argparse
import typing
from typing import Any


from d3d_jax.config.base import ConfigError, _check_bound, load_config
from d3d_jax.config.decoding import MODES
from d3d_jax.config.model import ATTENTION_CHOICES


def add_config_arguments(p: argparse.ArgumentParser, example: str) -> None:
    """``--config FILE`` (repeatable) and trailing ``key=value`` overrides."""
    p.add_argument("--config", action="append", default=[], metavar="YAML",
                   help=f"config file(s), later ones win (e.g. {example})")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted config overrides, applied after the flags (e.g. decoder.num_slots=4)")


def config_flag(p, *names: str, key: str, **kwargs) -> argparse.Action:
    """An argparse flag that sets config field ``key`` (e.g. ``decoder.block_size``) when given."""
    if kwargs.get("action") not in ("store_true", "store_false") and "choices" not in kwargs:
        kwargs.setdefault("metavar", key)  # --help shows the field each flag sets
    return p.add_argument(*names, dest=key, default=argparse.SUPPRESS, **kwargs)


def add_model_flags(p, *, mode: bool = True) -> None:
    """The ``models:`` flags every decoding command takes, and ``--mode`` (unless the command runs
    every mode)."""
    config_flag(p, "--target", key="models.target", help="HF Qwen3 directory or d3d_jax parameter checkpoint")
    config_flag(p, "--drafter", key="models.drafter", help="drafter checkpoint (every mode but plain)")
    if mode:
        config_flag(p, "--mode", key="decoder.mode", choices=MODES,
                    help="default: auto with --drafter (it picks plain, sync or async each round), else plain")
    config_flag(p, "--tokenizer", key="models.tokenizer", help="tokenizer dir (default: the target's)")
    config_flag(p, "--dtype", key="models.dtype",
                help="parameter/compute dtype of the models (default: each checkpoint's; on a CPU float32 is the fast one)")
    config_flag(p, "--attention", key="models.attention", choices=ATTENTION_CHOICES,
                help="attention backend: auto (default: the fused kernels on GPU and TPU, xla on a CPU), xla or pallas")


def add_device_flags(p, default: str = "every mode") -> None:
    """The device split, the same flags for every decoding command (``default``: what the help
    adds about when they apply)."""
    config_flag(p, "--target-devices", "--tensor-parallel-size", key="decoder.target_devices", type=int,
                help=f"devices of the target's slice, tensor-parallel over them (heads, MLP and KV cache "
                     f"split; default 1); {default}")
    config_flag(p, "--drafter-devices", key="decoder.drafter_devices", type=int,
                help="devices of the drafter's own slice, after the target's (default: it shares the "
                     "target's); async overlaps the two there, plain/sync/auto run the drafter inside the "
                     "target's programs, on the target's slice")


def add_auto_flags(p) -> None:
    """Mode auto's menu and prior, the same flags for every decoding command."""
    config_flag(p, "--auto-sync-blocks", key="decoder.auto_sync_blocks", metavar="B1,B2",
                help="auto: sync block sizes (default: 4, 8, 16 up to the block size)")
    config_flag(p, "--auto-async", key="decoder.auto_async", type=parse_geometries, metavar="CxF,...",
                help="auto: async geometries (default 4x2,12x2; 'none': no async)")
    config_flag(p, "--prior-tau", key="decoder.prior_tau", type=float,
                help="auto: the drafter's offline τ (default: its result.json's)")


def add_kv_flags(p, cls: type, *, pages_by_default: bool = False) -> None:
    """The KV cache's flags (vLLM's names) for every decoding command; ``cls``: the command's
    config (each value is refused at the flag by the field's bound)."""
    default = "16 on a CPU, 0 on a GPU/TPU" if pages_by_default else "0"
    config_flag(p, "--kv-page-size", key="decoder.kv_page_size", type=declared(cls, "decoder.kv_page_size"),
                help=f"tokens per KV cache page; 0: dense caches, a whole --max-model-len row per "
                     f"slot (default {default}; paging serves plain, sync and auto)")
    config_flag(p, "--kv-cache-tokens", key="decoder.kv_cache_tokens", type=declared(cls, "decoder.kv_cache_tokens"),
                help="tokens of the paged KV pool (default: from free memory x --memory-utilization on "
                     "an accelerator, --max-num-seqs x --max-model-len on a CPU)")
    config_flag(p, "--memory-utilization", "--gpu-memory-utilization", key="decoder.memory_utilization",
                type=declared(cls, "decoder.memory_utilization", float),
                help="share of an accelerator's memory the weights and the KV pool may take (default 0.9)")
    config_flag(p, "--no-enable-prefix-caching", key="decoder.enable_prefix_caching", action="store_false",
                help="never share KV pages between requests by content (prefix caching is on by default)")
    config_flag(p, "--max-num-batched-tokens", key="decoder.max_num_batched_tokens",
                type=declared(cls, "decoder.max_num_batched_tokens"),
                help="paged: tokens one step feeds, the next round's rows x width first, the rest "
                     "prompt chunks (default 256)")


def flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """``{dotted key: value}`` of the config flags that were given."""
    return {k: v for k, v in vars(args).items() if "." in k}


def load_command_config(cls: type, args: argparse.Namespace) -> Any:
    """``cls`` from ``args.config`` files, the config flags given, and ``args.overrides``."""
    return load_config(cls, getattr(args, "config", ()) or (), getattr(args, "overrides", ()) or (),
                       flags=flag_values(args))


def parse_geometries(text: str) -> tuple[tuple[int, int], ...]:
    """An argparse type: ``CxF,CxF`` (e.g. ``4x2,12x2``) as ``((4, 2), (12, 2))``; ``none``: ``()``."""
    if text == "none":
        return ()
    try:
        out = tuple(tuple(int(v) for v in g.split("x")) for g in text.split(",") if g)
    except ValueError:
        out = ()
    if not out or any(len(g) != 2 for g in out):
        raise argparse.ArgumentTypeError(f"expected CxF,CxF (e.g. 4x2,12x2), got {text!r}")
    return out


def declared(cls: type, key: str, convert=int):
    """An argparse type for the flag of field ``key`` (``server.max_queue``) of config ``cls``: the
    value is refused at the flag by the field's declared bound, the one the YAML and overrides meet."""
    owner = cls
    *sections, name = key.split(".")
    for section in sections:
        owner = typing.get_type_hints(owner)[section]
    bound = owner.BOUNDS[name]

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not {'an integer' if convert is int else 'a number'}") from None
        try:
            _check_bound(value, bound, key)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{key}: ")) from None
        return value
    return parse
