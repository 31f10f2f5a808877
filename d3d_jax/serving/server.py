"""Model loading, the decoder, and uvicorn: what ``infer/serve.py`` runs.

    python infer/serve.py --target runs/target/hf --drafter runs/d3d/export/hf --mode sync \\
        --tokenizer runs/target/hf --num-slots 16 --max-model-len 2048 [--api-key KEY] [--port 8000]

:class:`ServerThread` runs the same app on a free localhost port inside the calling process
(tests and the concurrency benchmark).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from d3d_jax.serving import protocol as P

log = logging.getLogger("d3d_jax.serving")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--target", required=True, help="HF Qwen3 directory or d3d_jax parameter checkpoint")
    p.add_argument("--drafter", default=None, help="drafter checkpoint (modes sync, async, auto)")
    p.add_argument("--mode", default=None, choices=("plain", "sync", "async", "auto"),
                   help="default: auto with --drafter (plain, sync or async picked every round), else plain")
    p.add_argument("--auto-sync-blocks", default=None, metavar="B1,B2",
                   help="auto: sync block sizes to choose from (default 4,8,16 up to the block size)")
    p.add_argument("--auto-async", default=None, metavar="CxF,...",
                   help="auto: async geometries to choose from (default 4x2,12x2; 'none': no async)")
    p.add_argument("--prior-tau", type=float, default=None,
                   help="auto: the drafter's τ before a request has any history (default: the offline "
                        "τ in the drafter's result.json, else 2)")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (default: the target's, else the drafter's)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: localhost only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $D3D_API_KEY; unset = open)")
    p.add_argument("--served-model-name", default=None, help="model id in the API (default: target dir name)")
    p.add_argument("--num-slots", type=int, default=8, help="concurrent requests decoded together")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="KV cache length per slot (default: min(2048, max_position_embeddings))")
    p.add_argument("--block-size", type=int, default=None, help="default: the drafter's config, else 16")
    p.add_argument("--branch-positions", type=int, default=None, help="async C (default min(12, B))")
    p.add_argument("--branch-fanout", type=int, default=None, help="async F (default 2)")
    p.add_argument("--target-devices", type=int, default=None, help="async: devices for the target")
    p.add_argument("--drafter-devices", type=int, default=None, help="async: devices for the drafter")
    p.add_argument("--dtype", default=None, help="parameter/compute dtype (float32, bfloat16)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger bodies get 413")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="default: the context length - 1")
    p.add_argument("--default-max-tokens", type=int, default=256, help="when a request gives none")
    p.add_argument("--max-queue", type=int, default=4096, help="waiting requests beyond this get 503")
    p.add_argument("--warmup-max-prompt", type=int, default=256,
                   help="compile before serving for prompts up to this length (0: no warm-up)")
    p.add_argument("--log-level", default="warning")
    return p


def _has_tokenizer(path) -> bool:
    return path is not None and Path(path).is_dir() and any((Path(path) / f).exists() for f in TOKENIZER_FILES)


def _tokenizer_dir(args) -> str:
    if args.tokenizer:
        if not _has_tokenizer(args.tokenizer):
            raise SystemExit(f"error: --tokenizer {args.tokenizer}: no tokenizer files there")
        return str(args.tokenizer)
    for path in (args.target, args.drafter):
        if _has_tokenizer(path):
            return str(path)
    raise SystemExit("error: no tokenizer next to --target or --drafter: pass --tokenizer DIR")


def decoder_config(args, target_cfg, drafter_cfg):
    """The :class:`DecoderConfig` the flags ask for.  EOS ids stay per request (``ignore_eos``)."""
    from d3d_jax.decoding.decoder_config import decoder_config as build

    block = args.block_size or (drafter_cfg.block_size if drafter_cfg is not None else None) or 16
    max_len = args.max_model_len or min(2048, target_cfg.max_position_embeddings)
    if max_len < block + 2:
        from d3d_jax.config import ConfigError

        raise ConfigError(f"--max-model-len {max_len}: leaves no room for a prompt and a completion "
                          f"(must be >= block size {block} + 2)")
    extra = {}
    if args.mode == "async":
        extra = dict(branch_positions=args.branch_positions, branch_fanout=args.branch_fanout,
                     target_devices=args.target_devices, drafter_devices=args.drafter_devices)
    if args.mode == "auto":
        from d3d_jax.decoding.auto import offline_tau

        extra = dict(prior_tau=args.prior_tau if args.prior_tau is not None else offline_tau(args.drafter),
                     auto_sync_blocks=_ints(args.auto_sync_blocks), auto_async=_geometries(args.auto_async))
    return build(args.mode, num_slots=args.num_slots, max_cache_len=max_len, block_size=block,
                 eos_token_ids=(), **extra)


def _ints(text: str | None):
    return None if text is None else tuple(int(x) for x in text.split(",") if x)


def _geometries(text: str | None):
    if text is None:
        return None
    if text == "none":
        return ()
    try:
        return tuple(tuple(int(v) for v in g.split("x")) for g in text.split(",") if g)
    except ValueError:
        from d3d_jax.config import ConfigError

        raise ConfigError(f"--auto-async: expected CxF,CxF (e.g. 4x2,12x2), got {text!r}") from None


def load(args):
    """(decoder, tokenizer, eos ids) for the flags."""
    from d3d_jax.config import ConfigError
    from d3d_jax.decoding.decoder import SpecDecoder
    from d3d_jax.io.checkpoint import load_model
    from d3d_jax.io.hf import eos_token_ids, load_tokenizer

    if args.mode is None:
        args.mode = "auto" if args.drafter is not None else "plain"
    if args.mode != "plain" and args.drafter is None:
        raise SystemExit(f"error: --mode {args.mode} needs --drafter")
    if args.mode == "plain" and args.drafter is not None:
        raise SystemExit("error: --drafter given with --mode plain")
    tokenizer = load_tokenizer(_tokenizer_dir(args))[0]
    try:
        target = load_model(args.target, dtype=args.dtype)
        drafter = load_model(args.drafter, dtype=args.dtype) if args.drafter else None
        cfg = decoder_config(args, target.config, drafter.config if drafter is not None else None)
        decoder = SpecDecoder(target, drafter, cfg)
    except (ConfigError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    return decoder, tokenizer, eos_token_ids(target.config, tokenizer)


def make_service(decoder, tokenizer, eos_ids, *, model_name: str, mode: str, api_key: str | None = None,
                 max_body_bytes: int = 1 << 20, max_prompt_tokens: int | None = None,
                 default_max_tokens: int = 256, max_queue: int = 4096, request_cls=None):
    """The scheduler (not yet started) and the :class:`~d3d_jax.serving.app.Service` around it."""
    from d3d_jax.serving.app import Service
    from d3d_jax.serving.scheduler import Scheduler

    if request_cls is None:
        from d3d_jax.decoding.decoder import Request as request_cls
    cfg = decoder.config
    limits = P.Limits(context_len=cfg.max_cache_len - cfg.block_size, max_body_bytes=max_body_bytes,
                      max_prompt_tokens=max_prompt_tokens, default_max_tokens=default_max_tokens)
    return Service(scheduler=Scheduler(decoder, max_queue=max_queue), tokenizer=tokenizer,
                   model_name=model_name, limits=limits, eos_token_ids=tuple(eos_ids),
                   make_request=request_cls, validate_request=decoder.validate_request,
                   api_key=api_key, mode=mode)


def warmup_lengths(max_prompt: int, cap: int) -> list[int]:
    """Prompt lengths 16, 32, 64 ... up to ``min(max_prompt, cap)``: one per power-of-two prefill
    bucket, so no client pays for a compile."""
    out, n = [], 16
    while n <= min(max_prompt, cap):
        out.append(n)
        n *= 2
    return out or ([min(max_prompt, cap)] if min(max_prompt, cap) > 0 else [])


def warmup(svc, prompt_lengths=(16,), max_tokens: int | None = None) -> float:
    """Compile the decoder's programs with dummy requests before the first client waits on them
    (and every round program of every window width: ``decoder.warm_up``, which auto also times)."""
    from d3d_jax.serving.scheduler import Event

    t0 = time.perf_counter()
    if hasattr(svc.scheduler.decoder, "warm_up"):
        svc.scheduler.decoder.warm_up()
    block = svc.scheduler.decoder.config.block_size
    for n in prompt_lengths:
        params = P.GenParams(max_tokens=max_tokens or 2 * block + 1, temperature=0.0, ignore_eos=True)
        req = svc.build(P.ParsedRequest("completion", svc.model_name, params), [1] * n)
        errors: list[Event] = []
        svc.scheduler.submit(req, lambda ev: errors.append(ev) if ev.error else None)
        svc.scheduler.run_until_idle(timeout_s=1800)
        if errors:
            raise RuntimeError(f"warm-up failed: {errors[0].error}")
    return time.perf_counter() - t0


class ServerThread:
    """uvicorn serving ``app`` on ``host`` (a free port by default) in a background thread."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=False,
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="d3d-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> "ServerThread":
        self.thread.start()
        t_end = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > t_end:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        self.sock.close()


def main(args) -> None:
    import uvicorn

    from d3d_jax.serving.app import create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    api_key = args.api_key or os.environ.get("D3D_API_KEY") or None
    decoder, tokenizer, eos_ids = load(args)
    svc = make_service(decoder, tokenizer, eos_ids,
                       model_name=args.served_model_name or Path(args.target).resolve().name,
                       mode=args.mode, api_key=api_key, max_body_bytes=args.max_body_bytes,
                       max_prompt_tokens=args.max_prompt_tokens,
                       default_max_tokens=args.default_max_tokens, max_queue=args.max_queue)
    lengths = warmup_lengths(args.warmup_max_prompt, svc.limits.prompt_cap - 2 * decoder.config.block_size)
    if lengths:
        log.warning("warm-up (compiling prompts of %s tokens) took %.1f s", lengths, warmup(svc, lengths))
    svc.scheduler.start()
    sock = socket.create_server((args.host, args.port))  # --port 0: a free port, printed below
    host, port = sock.getsockname()[:2]
    # one machine-readable line: tests and infer/bench.py serve wait for it
    print(f"READY http://{host}:{port} model={svc.model_name} mode={args.mode} "
          f"slots={svc.scheduler.num_slots} auth={'on' if api_key else 'off'}", flush=True)
    server = uvicorn.Server(uvicorn.Config(create_app(svc), log_level=args.log_level, access_log=False,
                                           timeout_graceful_shutdown=5))
    try:
        server.run(sockets=[sock])
    finally:
        svc.scheduler.stop()
