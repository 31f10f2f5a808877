"""Model loading, the decoder, and uvicorn: what ``infer/serve.py`` runs.

    python infer/serve.py --target runs/target/hf --drafter runs/d3d/export/hf --mode sync \\
        --tokenizer runs/target/hf --num-slots 16 --max-model-len 2048 [--api-key KEY] [--port 8000]

:class:`ServerThread` runs the same app on a free localhost port inside the calling process
(tests and the concurrency benchmark).
"""

from __future__ import annotations

import argparse
import json
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


def _int_in(lo: int, hi: int | None = None, none_ok: bool = False):
    """An argparse type: an integer in [lo, hi] (bad server numbers are refused at start)."""
    def parse(text: str):
        if none_ok and text.lower() == "none":
            return None
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"{v} is outside [{lo}, {'inf' if hi is None else hi}]")
        return v
    return parse


INT32 = 2 ** 31 - 1


def default_compile_cache() -> str:
    """``$D3D_COMPILE_CACHE``, else ``$XDG_CACHE_HOME/d3d_jax/xla`` (default ``~/.cache/d3d_jax/xla``)."""
    if os.environ.get("D3D_COMPILE_CACHE"):
        return os.environ["D3D_COMPILE_CACHE"]
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "d3d_jax", "xla")


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
    p.add_argument("--port", type=_int_in(0, 65535), default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $D3D_API_KEY; unset = open)")
    p.add_argument("--served-model-name", default=None, help="model id in the API (default: target dir name)")
    p.add_argument("--num-slots", type=_int_in(1, 4096), default=8, help="concurrent requests decoded together")
    p.add_argument("--max-model-len", type=_int_in(2, INT32), default=None,
                   help="KV cache length per slot (default: min(2048, max_position_embeddings))")
    p.add_argument("--block-size", type=_int_in(2, 1024), default=None, help="default: the drafter's config, else 16")
    p.add_argument("--branch-positions", type=_int_in(1, 1024), default=None, help="async C (default min(12, B))")
    p.add_argument("--branch-fanout", type=_int_in(1, 64), default=None, help="async F (default 2)")
    p.add_argument("--target-devices", type=_int_in(1, 4096), default=None, help="async: devices for the target")
    p.add_argument("--drafter-devices", type=_int_in(1, 4096), default=None, help="async: devices for the drafter")
    p.add_argument("--dtype", default=None, help="parameter/compute dtype (float32, bfloat16)")
    p.add_argument("--max-body-bytes", type=_int_in(1, 1 << 30), default=1 << 20, help="larger bodies get 413")
    p.add_argument("--max-prompt-tokens", type=_int_in(1, INT32), default=None,
                   help="default: the context length - 1")
    p.add_argument("--default-max-tokens", type=_int_in(1, INT32), default=256, help="when a request gives none")
    p.add_argument("--max-queue", type=_int_in(0, 1 << 20), default=4096, help="waiting requests beyond this get 503")
    p.add_argument("--warmup-max-prompt", type=_int_in(0, INT32), default=256,
                   help="compile every prefill bucket up to this prompt length (0: no warm-up); "
                        "the first bucket before serving, the others in the background")
    p.add_argument("--warmup-wait", action="store_true",
                   help="compile every warm-up bucket before serving (READY only after)")
    p.add_argument("--compile-cache", default=default_compile_cache(),
                   help="persistent XLA compilation cache directory, so a second start compiles "
                        "nothing (default: %(default)s; 'none': off)")
    p.add_argument("--vllm-metrics", action="store_true",
                   help="/metrics also under vLLM's vllm: names (dashboards made for vLLM)")
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
    """(decoder, tokenizer, eos ids, target model) for the flags."""
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
    return decoder, tokenizer, eos_token_ids(target.config, tokenizer), target


def make_service(decoder, tokenizer, eos_ids, *, model_name: str, mode: str, api_key: str | None = None,
                 max_body_bytes: int = 1 << 20, max_prompt_tokens: int | None = None,
                 default_max_tokens: int = 256, max_queue: int = 4096, request_cls=None,
                 target=None, score_prompt=None, vllm_metrics: bool = False):
    """The scheduler (not yet started) and the :class:`~d3d_jax.serving.app.Service` around it.
    ``target`` (the target model) serves ``echo`` with ``logprobs`` (:class:`PromptScorer`)."""
    from d3d_jax.serving.app import Service
    from d3d_jax.serving.metrics import ServerMetrics
    from d3d_jax.serving.scheduler import Scheduler

    if request_cls is None:
        from d3d_jax.decoding.decoder import Request as request_cls
    cfg = decoder.config
    limits = P.Limits(context_len=cfg.max_cache_len - cfg.block_size, max_body_bytes=max_body_bytes,
                      max_prompt_tokens=max_prompt_tokens, default_max_tokens=default_max_tokens,
                      vocab_size=getattr(decoder, "vocab_size", None) or len(tokenizer))
    if target is not None and score_prompt is None:
        from d3d_jax.serving.scoring import PromptScorer

        score_prompt = PromptScorer(target, limits.context_len)
    scheduler = Scheduler(decoder, max_queue=max_queue, metrics=ServerMetrics(vllm_names=vllm_metrics))
    return Service(scheduler=scheduler, tokenizer=tokenizer,
                   model_name=model_name, limits=limits, eos_token_ids=tuple(eos_ids),
                   make_request=request_cls, validate_request=decoder.validate_request,
                   api_key=api_key, mode=mode, score_prompt=score_prompt)


def warmup_lengths(max_prompt: int, cap: int) -> list[int]:
    """Prompt lengths 16, 32, 64 ... up to ``min(max_prompt, cap)``: one per power-of-two prefill
    bucket, so no client pays for a compile."""
    out, n = [], 16
    while n <= min(max_prompt, cap):
        out.append(n)
        n *= 2
    return out or ([min(max_prompt, cap)] if min(max_prompt, cap) > 0 else [])


def _warmup_request(svc, n: int, max_tokens: int | None):
    block = svc.scheduler.decoder.config.block_size
    params = P.GenParams(max_tokens=max_tokens or 2 * block + 1, temperature=0.0, ignore_eos=True)
    return svc.build(params, [1] * n, seed=0)


def warmup(svc, prompt_lengths=(16,), max_tokens: int | None = None) -> float:
    """Compile the decoder's programs with dummy requests before the first client waits on them
    (on the calling thread: the scheduler is not running yet) and every round program of every
    window width (``decoder.warm_up``, which auto also times).  Left out of the metrics."""
    from d3d_jax.serving.scheduler import Event

    t0 = time.perf_counter()
    if hasattr(svc.scheduler.decoder, "warm_up"):
        svc.scheduler.decoder.warm_up()
    for n in prompt_lengths:
        errors: list[Event] = []
        svc.scheduler.submit(_warmup_request(svc, n, max_tokens),
                             lambda ev: errors.append(ev) if ev.error else None, warmup=True)
        svc.scheduler.run_until_idle(timeout_s=1800)
        if errors:
            raise RuntimeError(f"warm-up failed: {errors[0].error}")
        if svc.score_prompt is not None and hasattr(svc.score_prompt, "warm"):
            svc.score_prompt.warm(n)
    return time.perf_counter() - t0


def warmup_in_background(svc, prompt_lengths, max_tokens: int | None = None) -> threading.Thread:
    """The other buckets' programs, compiled while the server answers: one dummy request at a
    time through the running scheduler (marked warm-up: no metric counts it)."""
    def run():
        t0 = time.perf_counter()
        for n in prompt_lengths:
            # a compile in the scheduler's thread holds up its rounds: start one only when no
            # client's request is running or waiting (with a warm cache it is a quick load)
            while svc.scheduler.num_active or svc.scheduler.num_queued:
                time.sleep(0.05)
            done = threading.Event()
            try:
                svc.scheduler.submit(_warmup_request(svc, n, max_tokens),
                                     lambda ev: done.set() if ev.finished else None, warmup=True)
            except Exception:  # noqa: BLE001 - a full queue: the clients' requests come first
                log.warning("background warm-up of %d-token prompts skipped", n)
                continue
            if svc.score_prompt is not None and hasattr(svc.score_prompt, "warm"):
                svc.score_prompt.warm(n)
            done.wait(1800)
        log.warning("background warm-up (prompts of %s tokens) took %.1f s", list(prompt_lengths),
                    time.perf_counter() - t0)

    thread = threading.Thread(target=run, name="d3d-warmup", daemon=True)
    thread.start()
    return thread


def enable_compile_cache(path: str | None) -> None:
    """Persistent XLA compilation cache: every program compiled once is loaded from ``path``
    on the next start (JAX keys entries by program, backend and flags)."""
    if not path or path.lower() == "none":
        return
    import jax

    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _http_protocol():
    """uvicorn's h11 protocol whose malformed-request 400 (a bad Content-Length, ...) is OpenAI's
    error JSON rather than uvicorn's text/plain."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class JsonErrors(H11Protocol):
        def send_400_response(self, msg: str) -> None:
            body = json.dumps(P.error_body(f"malformed HTTP request: {msg}")).encode()
            headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                       (b"content-length", str(len(body)).encode())]
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                          h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

    return JsonErrors


def uvicorn_config(app, log_level: str, grace_s: float):
    import uvicorn

    return uvicorn.Config(app, log_level=log_level, access_log=False, timeout_graceful_shutdown=grace_s,
                          http=_http_protocol())


class ServerThread:
    """uvicorn serving ``app`` on ``host`` (a free port by default) in a background thread."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.server = uvicorn.Server(uvicorn_config(app, log_level, 2))
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
    t_start = time.perf_counter()
    enable_compile_cache(args.compile_cache)  # before anything compiles
    api_key = args.api_key or os.environ.get("D3D_API_KEY") or None
    decoder, tokenizer, eos_ids, target = load(args)
    svc = make_service(decoder, tokenizer, eos_ids,
                       model_name=args.served_model_name or Path(args.target).resolve().name,
                       mode=args.mode, api_key=api_key, max_body_bytes=args.max_body_bytes,
                       max_prompt_tokens=args.max_prompt_tokens,
                       default_max_tokens=args.default_max_tokens, max_queue=args.max_queue,
                       target=target, vllm_metrics=args.vllm_metrics)
    lengths = warmup_lengths(args.warmup_max_prompt, svc.limits.prompt_cap - 2 * decoder.config.block_size)
    now, later = (lengths, []) if args.warmup_wait else (lengths[:1], lengths[1:])
    if now:
        log.warning("warm-up (compiling prompts of %s tokens) took %.1f s", now, warmup(svc, now))
    svc.scheduler.start()
    if later:
        warmup_in_background(svc, later)
    sock = socket.create_server((args.host, args.port))  # --port 0: a free port, printed below
    host, port = sock.getsockname()[:2]
    # one machine-readable line: tests and infer/bench.py serve wait for it
    print(f"READY http://{host}:{port} model={svc.model_name} mode={args.mode} "
          f"slots={svc.scheduler.num_slots} auth={'on' if api_key else 'off'} "
          f"start_s={time.perf_counter() - t_start:.1f}", flush=True)
    server = uvicorn.Server(uvicorn_config(create_app(svc), args.log_level, 5))
    try:
        server.run(sockets=[sock])
    finally:
        svc.scheduler.stop()
