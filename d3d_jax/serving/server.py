"""Model loading, the decoder, and uvicorn: what ``infer/serve.py`` runs.

    python infer/serve.py --target runs/target/hf --drafter runs/d3d/export/hf --mode sync \\
        --tokenizer runs/target/hf --num-slots 16 --max-model-len 2048 [--api-key KEY] [--port 8000]
    python infer/serve.py --config configs/serve/demo.yaml [decoder.mode=async server.port=0 ...]

Settings: :class:`~d3d_jax.config.serve.ServeConfig` from ``--config`` files, then the flags (each
one sets a field, see :func:`add_arguments`), then ``key=value`` overrides; checked at load.

:class:`ServerThread` runs the same app on a free localhost port inside the calling process
(tests and the concurrency benchmark); it and the uvicorn server the command runs are in
:mod:`~d3d_jax.serving.http_server`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import threading
import time
from pathlib import Path

from d3d_jax import compile_cache
from d3d_jax.config import ConfigError
from d3d_jax.config.flags import (add_auto_flags, add_config_arguments, add_device_flags, add_kv_flags, add_model_flags,
                                  config_flag, declared, load_command_config)
from d3d_jax.config.decoding import ACCELERATOR_KV_PAGE_SIZE, DEFAULT_KV_PAGE_SIZE
from d3d_jax.config.serve import MAX_CACHE_LEN, NUM_SLOTS, ServeConfig
from d3d_jax.decoding.contract import Decoder
from d3d_jax.serving import protocol as P
# uvicorn around the app is a module of its own; ServerThread, bind and uvicorn_server are used from here
from d3d_jax.serving.http_server import ServerThread, bind, uvicorn_server  # noqa: F401

log = logging.getLogger("d3d_jax.serving")

def _declared(key: str):
    """The flag's argparse type: the field's declared bound on ServeConfig (a bad number is one
    line at start, in the words a YAML value would get)."""
    return declared(ServeConfig, key)


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every flag sets one :class:`~d3d_jax.config.serve.ServeConfig` field (its defaults are there)."""
    add_config_arguments(p, "configs/serve/demo.yaml")
    flag = functools.partial(config_flag, p)
    add_model_flags(p)
    add_auto_flags(p)
    add_device_flags(p)
    flag("--host", key="server.host", help="bind address (default: localhost only)")
    flag("--port", key="server.port", type=_declared("server.port"), help="default 8000; 0: a free port")
    flag("--api-key", key="server.api_key",
         help="require 'Authorization: Bearer KEY' (default: $D3D_API_KEY; unset = open)")
    flag("--served-model-name", key="server.served_model_name", help="model id in the API (default: target dir name)")
    flag("--max-num-seqs", "--num-slots", key="decoder.num_slots", type=_declared("decoder.num_slots"),
         help=f"concurrent requests decoded together (default {NUM_SLOTS})")
    flag("--max-model-len", key="decoder.max_cache_len", type=_declared("decoder.max_cache_len"),
         help=f"tokens of one sequence, prompt + completion + a block (default: min({MAX_CACHE_LEN}, "
              f"max_position_embeddings))")
    add_kv_flags(p, ServeConfig, pages_by_default=True)
    flag("--block-size", key="decoder.block_size", type=_declared("decoder.block_size"),
         help="default: the drafter's config, else 16")
    flag("--branch-positions", key="decoder.branch_positions", type=_declared("decoder.branch_positions"),
         help="async C (default min(12, B))")
    flag("--branch-fanout", key="decoder.branch_fanout", type=_declared("decoder.branch_fanout"), help="async F (default 2)")
    flag("--max-body-bytes", key="server.max_body_bytes", type=_declared("server.max_body_bytes"), help="larger bodies get 413")
    flag("--max-prompt-tokens", key="server.max_prompt_tokens", type=_declared("server.max_prompt_tokens"),
         help="default: the context length - 1")
    flag("--default-max-tokens", key="server.default_max_tokens", type=_declared("server.default_max_tokens"),
         help="when a request gives none (default 256)")
    flag("--max-queue", key="server.max_queue", type=_declared("server.max_queue"),
         help="waiting requests beyond this get 503 (default 4096)")
    flag("--warmup-max-prompt", key="server.warmup_max_prompt", type=_declared("server.warmup_max_prompt"),
         help="compile every prefill bucket up to this prompt length (0: no warm-up; default 256); "
              "the first bucket before serving, the others in the background")
    flag("--warmup-wait", key="server.warmup_wait", action="store_true",
         help="compile every warm-up bucket before serving (READY only after)")
    flag("--compile-cache", key="server.compile_cache",
         help="persistent XLA compilation cache directory, with the decoder's program store under "
              "programs/, so a second start neither traces nor compiles "
              "(default: $D3D_COMPILE_CACHE, else ~/.cache/d3d_jax/xla; 'none': off)")
    flag("--vllm-metrics", key="server.vllm_metrics", action="store_true",
         help="/metrics also under vLLM's vllm: names (dashboards made for vLLM)")
    flag("--log-level", key="server.log_level")
    flag("--default-chat-template-kwargs", key="server.default_chat_template_kwargs",
         help="the chat template's variables when a request's chat_template_kwargs leave them out, "
              "a JSON object (default '{\"enable_thinking\": false}')")
    flag("--reasoning-parser", key="server.reasoning_parser", choices=("qwen3", "none"),
         help="qwen3 (default): the thought between <think> and </think> goes in reasoning_content")
    flag("--tool-call-parser", key="server.tool_call_parser", choices=("hermes", "none"),
         help="hermes (default): <tool_call> output becomes tool_calls when a request offers tools")
    return p


def _tokenizer_dir(models) -> str:
    from d3d_jax.errors import UsageError
    from d3d_jax.io.hf import TOKENIZER_FILES, has_tokenizer  # the files every command looks for

    for flag in ("target", "drafter"):  # a missing model directory is that, not a missing tokenizer
        path = getattr(models, flag)
        if path is not None and not Path(path).is_dir():
            raise UsageError(f"--{flag} {path}: not a directory (expected an HF Qwen3 directory or a "
                             f"d3d_jax parameter checkpoint)")
    if models.tokenizer:
        if not has_tokenizer(models.tokenizer):
            raise UsageError(f"--tokenizer {models.tokenizer}: no tokenizer files there "
                             f"({', '.join(TOKENIZER_FILES)})")
        return str(models.tokenizer)
    for path in (models.target, models.drafter):
        if path is not None and has_tokenizer(path):
            return str(path)
    from d3d_jax.errors import UsageError

    searched = " or ".join(str(p) for p in (models.target, models.drafter) if p is not None)
    raise UsageError(f"no tokenizer files in {searched}: pass --tokenizer DIR")


def default_kv_page_size() -> int:
    """The server's page size when none is given: 16 tokens on a CPU; on a GPU/TPU a page is the
    fused decode kernel's key tile (it reads K/V through the page table, and the compile-only
    H200 plain step and verify round move the dense caches' bytes)."""
    import jax

    return DEFAULT_KV_PAGE_SIZE if jax.default_backend() == "cpu" else ACCELERATOR_KV_PAGE_SIZE


def decoder_config(cfg: ServeConfig, target_cfg, drafter_cfg):
    """The :class:`DecoderConfig` the settings ask for.  EOS ids stay per request (``ignore_eos``)."""
    from d3d_jax.decoding.settings import decoder_config_for

    trained = drafter_cfg.block_size if drafter_cfg is not None else None
    asked = cfg.decoder.block_size
    if asked and trained and asked > trained:  # slots past the trained B were never trained
        raise ConfigError(f"--block-size {asked} is more than the drafter was trained for ({trained}); "
                          f"use --block-size {trained} or less")
    s = cfg.decoder.resolved(has_drafter=drafter_cfg is not None, drafter_block_size=trained,
                             num_slots=NUM_SLOTS, max_cache_len=min(MAX_CACHE_LEN, target_cfg.max_position_embeddings),
                             kv_page_size=default_kv_page_size())
    if s.max_cache_len < s.block_size + 2:
        raise ConfigError(f"--max-model-len {s.max_cache_len}: leaves no room for a prompt and a completion "
                          f"(must be >= block size {s.block_size} + 2)")
    return decoder_config_for(s, drafter_path=cfg.models.drafter, target_config=target_cfg, drafter_config=drafter_cfg,
                              eos_token_ids=())


def load(cfg: ServeConfig):
    """(decoder, tokenizer, eos ids, target model) for the settings; bad settings and files end in one error line."""
    from d3d_jax.decoding.decoder import SpecDecoder
    from d3d_jax.errors import UsageError
    from d3d_jax.io.checkpoint import load_decoding_model
    from d3d_jax.io.hf import eos_token_ids, load_tokenizer
    from d3d_jax.io.pairing import check_pairing
    from d3d_jax.parallel.sharding import model_meshes

    m = cfg.models
    tokenizer = load_tokenizer(_tokenizer_dir(m))[0]
    d = cfg.decoder
    # each model read straight onto its slice: the decoder and the prompt scorer share these arrays
    t_mesh, d_mesh = model_meshes(d.derived(has_drafter=m.drafter is not None)["mode"], d.target_devices,
                                  d.drafter_devices)
    target = load_decoding_model(m.target, dtype=m.dtype, attention=m.attention, mesh=t_mesh)
    drafter = (load_decoding_model(m.drafter, dtype=m.dtype, attention=m.attention, mesh=d_mesh)
               if m.drafter else None)
    eos_ids = eos_token_ids(target.config, tokenizer)
    check_pairing(tokenizer, target.config, drafter.config if drafter is not None else None, eos_ids=eos_ids,
                  where=f"--drafter {m.drafter}")
    dcfg = decoder_config(cfg, target.config, drafter.config if drafter is not None else None)
    try:
        decoder = SpecDecoder(target, drafter, dcfg,
                              program_dir=compile_cache.program_dir(cfg.server.compile_cache))
    except ValueError as e:  # the decoder checks its arguments with ValueError
        if isinstance(e, UsageError):
            raise
        raise UsageError(str(e)) from None
    return decoder, tokenizer, eos_ids, target


def make_service(decoder: Decoder, tokenizer, eos_ids, *, model_name: str, mode: str, api_key: str | None = None,
                 max_body_bytes: int = 1 << 20, max_prompt_tokens: int | None = None,
                 default_max_tokens: int = 256, max_queue: int = 4096, request_cls=None,
                 target=None, score_prompt=None, vllm_metrics: bool = False,
                 default_chat_template_kwargs: dict | None = None, reasoning_parser: str = "qwen3",
                 tool_call_parser: str = "hermes"):
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
                      vocab_size=decoder.vocab_size)
    if target is not None and score_prompt is None:
        from d3d_jax.serving.scoring import PromptScorer, decoder_params

        score_prompt = PromptScorer(target, limits.context_len, programs=decoder.programs,
                                    params=decoder_params(decoder, target))
    scheduler = Scheduler(decoder, max_queue=max_queue, metrics=ServerMetrics(vllm_names=vllm_metrics))
    return Service(scheduler=scheduler, tokenizer=tokenizer,
                   model_name=model_name, limits=limits, eos_token_ids=tuple(eos_ids),
                   make_request=request_cls, validate_request=decoder.validate_request,
                   api_key=api_key, mode=mode, score_prompt=score_prompt,
                   default_template_kwargs=({"enable_thinking": False} if default_chat_template_kwargs is None
                                            else dict(default_chat_template_kwargs)),
                   reasoning_parser=reasoning_parser, tool_call_parser=tool_call_parser)


def warmup_lengths(max_prompt: int, cap: int) -> list[int]:
    """The longest prompt of every prompt bucket (:func:`prompt_buckets`) a prompt of up to
    ``min(max_prompt, cap)`` tokens lands in, so no client pays for a compile."""
    from d3d_jax.decoding.decoder_config import prompt_buckets

    limit = min(max_prompt, cap)
    return [min(b, limit) for b in prompt_buckets(limit)] if limit > 0 else []


def _warmup_request(svc, n: int, max_tokens: int | None):
    block = svc.scheduler.decoder.config.block_size
    params = P.GenParams(max_tokens=max_tokens or 2 * block + 1, temperature=0.0, ignore_eos=True)
    # marked, so auto's prior (the acceptance pooled over finished requests) never learns from a
    # prompt of n ones: it did, and the first real requests started from its τ of 3.5, not 6.7
    return dataclasses.replace(svc.build(params, [1] * n, seed=0), warmup=True)


def warm_up_decoder(decoder: Decoder, all_widths: bool = True, prompt_cap: int | None = None) -> bool:
    """Compile (or read) the decoder's programs, several compiles at once: with
    ``all_widths=False`` and a program store, only a request's programs (admission, row ops, the
    1-row round; auto times those rounds, or reads their times), the other widths compiled or
    read after ``READY`` with nothing run (:func:`warmup_in_background`).  Admission only for
    prompts of up to ``prompt_cap`` tokens (None: every bucket): a longer prompt's program is the
    background warm-up's, or compiles when such a prompt first comes.  Returns True when widths
    were left for the background."""
    store = decoder.programs
    if not all_widths and store is not None and store.enabled and len(decoder.config.buckets) > 1:
        decoder.warm_up(decoder.config.buckets[:1], prompt_cap=prompt_cap)
        return True
    decoder.warm_up(prompt_cap=prompt_cap)
    return False


def warmup(svc, prompt_lengths=(16,), max_tokens: int | None = None, all_widths: bool = True) -> bool:
    """Compile the decoder's programs (:func:`warm_up_decoder`), then run one dummy request per
    prompt length before the first client waits (on the calling thread: the scheduler is not
    running yet).  Left out of the metrics.  True when widths were left for the background."""
    from d3d_jax.serving.scheduler import Event

    deferred = warm_up_decoder(svc.scheduler.decoder, all_widths, max(prompt_lengths, default=None))
    for n in prompt_lengths:
        errors: list[Event] = []
        svc.scheduler.submit(_warmup_request(svc, n, max_tokens),
                             lambda ev: errors.append(ev) if ev.error else None, warmup=True)
        svc.scheduler.run_until_idle(timeout_s=1800)
        if errors:
            raise RuntimeError(f"warm-up failed: {errors[0].error}")
        if svc.score_prompt is not None and hasattr(svc.score_prompt, "warm"):
            svc.score_prompt.warm(n)
    return deferred


def warmup_in_background(svc, prompt_lengths, max_tokens: int | None = None,
                         preload: bool = False, prompt_cap: int | None = None) -> threading.Thread:
    """While the server answers: with ``preload``, every other stored program of the decoder is
    read, and those not stored are compiled (no dispatch: the scheduler's rounds go on; admission
    for prompts of up to ``prompt_cap`` tokens); then the other buckets' programs, one
    dummy request at a time through the running scheduler (marked warm-up: no metric counts it)."""
    def run():
        t0 = time.perf_counter()
        if preload:
            decoder = svc.scheduler.decoder
            n = decoder.programs.preload()
            log.warning("program store: %d more programs read in %.1f s", n, time.perf_counter() - t0)
            # what no earlier start kept: compiled, nothing dispatched
            decoder.warm_up(run=False, prompt_cap=prompt_cap)
            log.warning("wider windows ready %.1f s after the warm-up; program store %s",
                        time.perf_counter() - t0, decoder.programs.counts)
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


def main(args) -> None:
    cfg = load_command_config(ServeConfig, args)  # a ConfigError ends in one line (run_cli)
    srv = cfg.server
    from d3d_jax.parallel.sharding import devices_of
    from d3d_jax.serving.app import create_app

    logging.basicConfig(level=srv.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    t_start = time.perf_counter()
    sock = bind(srv.host, srv.port)  # --port 0: a free port, printed below
    compile_cache.enable(srv.compile_cache)  # before anything compiles
    api_key = srv.api_key or os.environ.get("D3D_API_KEY") or None
    decoder, tokenizer, eos_ids, target = load(cfg)
    svc = make_service(decoder, tokenizer, eos_ids,
                       model_name=srv.served_model_name or Path(cfg.models.target).resolve().name,
                       mode=decoder.config.mode, api_key=api_key, max_body_bytes=srv.max_body_bytes,
                       max_prompt_tokens=srv.max_prompt_tokens,
                       default_max_tokens=srv.default_max_tokens, max_queue=srv.max_queue,
                       target=target, vllm_metrics=srv.vllm_metrics,
                       default_chat_template_kwargs=srv.template_kwargs(), reasoning_parser=srv.reasoning_parser,
                       tool_call_parser=srv.tool_call_parser)
    lengths = warmup_lengths(srv.warmup_max_prompt, svc.limits.prompt_cap - 2 * decoder.config.block_size)
    now, later = (lengths, []) if srv.warmup_wait else (lengths[:1], lengths[1:])
    deferred = False
    if now:
        t0 = time.perf_counter()
        deferred = warmup(svc, now, all_widths=srv.warmup_wait)
        store = decoder.programs
        log.warning("warm-up (prompts of %s tokens%s) took %.1f s%s", now,
                    ", wider windows read in the background" if deferred else "", time.perf_counter() - t0,
                    f"; program store {store.counts}" if store is not None and store.enabled else "")
    svc.scheduler.start()
    if later or deferred:
        warmup_in_background(svc, later, preload=deferred, prompt_cap=max(lengths))
    sock.listen(2048)  # from here a client's connection waits for uvicorn instead of being refused
    host, port = sock.getsockname()[:2]
    # one machine-readable line: tests and infer/bench.py serve wait for it
    print(f"READY http://{host}:{port} model={svc.model_name} mode={decoder.config.mode} "
          f"attention={target.config.attention_backend} slots={svc.scheduler.num_slots} "
          f"target_devices={len(devices_of(decoder.param_leaves()[0]))} "
          f"drafter_devices={len(devices_of(decoder.param_leaves()[1]))} auth={'on' if api_key else 'off'} "
          f"start_s={time.perf_counter() - t_start:.1f}", flush=True)
    server = uvicorn_server(create_app(svc), srv.log_level)
    try:
        server.run(sockets=[sock])
    finally:
        svc.scheduler.stop()
