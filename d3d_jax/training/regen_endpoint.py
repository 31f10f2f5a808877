"""Regeneration through any OpenAI-compatible server: vLLM, SGLang or ``infer/serve.py``.

Users with a cluster already serve the target with vLLM or SGLang; this sends each prompt of a
process's shard as one chat completion to ``--endpoint`` and writes the same records as the local
path (:mod:`~d3d_jax.training.regenerate`), through the same output file code
(:mod:`~d3d_jax.training.regen_output`): whole-record appends, resume by id, per-process shard
files and ``--merge``.  What differs, and is recorded:

* **the chat template is the server's** (``template: {"source": "server", ...}``): the prompt ids
  come from the server, in the chat response (vLLM's ``prompt_token_ids`` with
  ``return_token_ids``) or from its ``POST /tokenize`` with the same messages (ours, vLLM);
* **response ids are the server's** (each choice's ``token_ids``, asked for with
  ``return_token_ids``, which vLLM and ``infer/serve.py`` honour); a server that returns none
  (SGLang) needs ``--tokenizer``, and then the text is tokenised here (which can differ from the
  sampled ids where a text has several tokenisations);
* **the target is named by the server** (``target: {"endpoint", "model"}``), not by a weights hash.

Each request carries the row's own seed (``record_seed``), the sampling settings and
``chat_template_kwargs: {"enable_thinking": ...}`` (Qwen3's switch; a server that refuses the
field is asked again without it, when thinking is off, and uses its template's default).  A 5xx,
a refused connection or a timeout is retried with exponential backoff until ``retry_s`` has passed
since the request's first failure (so a server restart loses nothing); a 4xx skips that prompt
and lists it (too long, say), and more than ``max_skipped_fraction`` of those stop the run.
Stdlib HTTP in threads: one request per prompt needs no client library, and threads bound the
prompts in flight to ``concurrency``.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import http.client
import json
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from d3d_jax.errors import DataError, UsageError
from d3d_jax.io import records as rec_lib
from d3d_jax.io.chat import Prompt, read_prompts
from d3d_jax.training.regen_output import (append_records, check_compatible, recover_output, set_aside,
                                           shard_output_path)

RETRYABLE = (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException, socket.timeout)


class EndpointError(UsageError):
    """The server refused or stayed unreachable: one line naming the URL and its answer."""


@dataclasses.dataclass(frozen=True)
class Endpoint:
    url: str  # the API base, e.g. http://host:8000/v1
    model: str | None = None  # None: the server's first model (GET /v1/models)
    api_key: str | None = None
    concurrency: int = 16
    request_timeout_s: float = 600.0
    retry_s: float = 600.0  # how long one request keeps retrying a server that is down

    @property
    def root(self) -> str:
        """The server's root (vLLM and ours serve ``/tokenize`` beside ``/v1``)."""
        base = self.url.rstrip("/")
        return base[:-3] if base.endswith("/v1") else base


class Client:
    """JSON over HTTP with retries: 5xx, refused connections and timeouts wait and try again."""

    def __init__(self, endpoint: Endpoint, sleep=time.sleep):
        self.ep, self.sleep = endpoint, sleep

    def request(self, url: str, body: dict | None = None) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.ep.api_key:
            headers["Authorization"] = f"Bearer {self.ep.api_key}"
        data = None if body is None else json.dumps(body).encode()
        first_failure, attempt = None, 0
        while True:
            try:
                req = urllib.request.Request(url, data, headers, method="GET" if body is None else "POST")
                with urllib.request.urlopen(req, timeout=self.ep.request_timeout_s) as r:
                    return json.loads(r.read())
            except urllib.error.HTTPError as e:
                text = e.read().decode("utf-8", "replace")[:500]
                if e.code < 500 and e.code != 429:
                    raise EndpointError(f"{url}: HTTP {e.code}: {text}") from None
                why = f"HTTP {e.code}: {text}"
            except RETRYABLE as e:
                why = f"{type(e).__name__}: {e}"
            now = time.monotonic()
            first_failure = now if first_failure is None else first_failure
            if now - first_failure > self.ep.retry_s:
                raise EndpointError(f"{url}: no answer for {self.ep.retry_s:.0f}s (last: {why})")
            self.sleep(min(10.0, 0.25 * 2 ** attempt) * (0.5 + random.random() / 2))
            attempt += 1


# --------------------------------------------------------------------------------------
# One prompt
# --------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Job:
    """What every request of this run shares (the template kwargs may be dropped once, see module)."""

    client: Client
    model: str
    settings: Any  # regenerate.GenerationSettings
    thinking: bool
    tokenizer: Any
    eos_ids: tuple[int, ...]
    send_template_kwargs: bool = True
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def body(self, p: Prompt) -> dict:
        from d3d_jax.training.regenerate import record_seed

        s = self.settings
        body = {"model": self.model, "messages": p.messages, "max_tokens": s.max_new_tokens,
                "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k or -1,
                "seed": record_seed(s.seed, p.id), "return_token_ids": True}
        if self.send_template_kwargs:
            body["chat_template_kwargs"] = {"enable_thinking": self.thinking}
        return body


def _ask(job: _Job, p: Prompt) -> dict:
    """``p``'s chat completion and its prompt ids, as one record (without the run's fields)."""
    body = job.body(p)
    try:
        resp = job.client.request(job.client.ep.url.rstrip("/") + "/chat/completions", body)
    except EndpointError as e:
        if "chat_template_kwargs" not in str(e) or job.thinking or "chat_template_kwargs" not in body:
            raise
        with job.lock:
            job.send_template_kwargs = False  # this server renders its template's default (ours: no thinking)
        resp = job.client.request(job.client.ep.url.rstrip("/") + "/chat/completions", job.body(p))
    choice = resp["choices"][0]
    text = (choice.get("message") or {}).get("content") or ""
    ids = choice.get("token_ids")
    if ids is None:
        if job.tokenizer is None:
            raise EndpointError(f"{job.client.ep.url}: the server returns no token ids (return_token_ids); "
                                f"pass --tokenizer to tokenise its text")
        ids = list(job.tokenizer(text, add_special_tokens=False)["input_ids"])
    prompt_ids = resp.get("prompt_token_ids")
    if prompt_ids is None:
        body = {"model": job.model, "messages": p.messages}
        prompt_ids = job.client.request(job.client.ep.root + "/tokenize", body)["tokens"]
    reason = choice.get("finish_reason") or "stop"
    if reason == "stop" and ids and ids[-1] in job.eos_ids:
        reason = "eos"  # the local path's word for an end-of-turn token
    return {"id": p.id, "messages": p.messages, "prompt_token_ids": [int(t) for t in prompt_ids],
            "response": text, "response_token_ids": [int(t) for t in ids], "finish_reason": reason}


# --------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------
def served_model(client: Client) -> str:
    models = client.request(client.ep.url.rstrip("/") + "/models").get("data") or []
    if not models:
        raise EndpointError(f"{client.ep.url}/models lists no model; pass --model")
    return str(models[0]["id"])


def _eos_ids(tokenizer) -> tuple[int, ...]:
    if tokenizer is None:
        return ()
    ids = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    return tuple(int(i) for i in ids if isinstance(i, int) and i >= 0 and i != tokenizer.unk_token_id)


def regenerate_via_endpoint(endpoint: Endpoint, prompts_path, out_path, *, settings, tokenizer=None,
                            thinking: bool = False, process_index: int = 0, process_count: int = 1,
                            max_records: int | None = None, max_skipped_fraction: float = 0.01,
                            progress: bool = True, client: Client | None = None):
    """Regenerate every prompt of this process's shard not yet in the output, through ``endpoint``.
    Returns the local path's :class:`~d3d_jax.training.regenerate.RegenerationSummary`."""
    from d3d_jax.training.regenerate import RegenerationSummary, shard_prompts

    settings.validate()
    if endpoint.concurrency < 1:
        raise UsageError(f"concurrency must be >= 1, got {endpoint.concurrency}")
    client = client or Client(endpoint)
    model = endpoint.model or served_model(client)
    prompts, malformed = read_prompts(prompts_path)
    mine = shard_prompts(prompts, process_index, process_count)
    out = shard_output_path(out_path, process_index, process_count)
    summary = RegenerationSummary(output=str(out), prompt_lines=len(prompts), shard_prompts=len(mine),
                                  malformed=malformed)
    rec_lib.check_skipped_fraction(len(malformed), len(prompts) + len(malformed), max_skipped_fraction,
                                   str(prompts_path), "max_skipped_fraction",
                                   f"line {malformed[0][0]}: {malformed[0][1]}" if malformed else None)
    run = {"generation": dataclasses.asdict(settings),
           "target": {"endpoint": endpoint.url, "model": model, "config_sha256": None, "weights_sha256": None}}
    done = _resume(out, run, summary)
    summary.already_done = sum(p.id in done for p in mine)
    todo = [p for p in mine if p.id not in done]
    if max_records is not None:
        todo = todo[:max_records]
    job = _Job(client, model, settings, thinking, tokenizer, _eos_ids(tokenizer))
    _run(job, todo, out, run, summary, len(mine), max_skipped_fraction, progress)
    return summary


def _resume(out: Path, run: dict, summary) -> set[str]:
    existing = recover_output(out)
    invalid = [r for r in existing if r["problem"] is not None]
    if invalid:
        set_aside(out, [r["line"] for r in invalid])
        summary.invalid_records = [(r["line"], f"id {r['id']!r}: {r['problem']}") for r in invalid]
    valid = [r for r in existing if r["problem"] is None]
    check_compatible(valid, run["generation"], run["target"], out)
    for r in valid:  # the weights hashes are unknown here: the served model must match instead
        if (r.get("target") or {}).get("model") != run["target"]["model"]:
            raise UsageError(f"{out}: record {r['id']!r} came from {r.get('target')}, this run asks "
                             f"{run['target']['model']!r} at {run['target']['endpoint']}; use another --out")
    return {r["id"] for r in valid}


def _run(job: _Job, todo: list[Prompt], out: Path, run: dict, summary, shard_size: int,
         max_skipped_fraction: float, progress: bool) -> None:
    """Up to ``concurrency`` requests in flight; each finished record appended whole, at once."""
    from tqdm.auto import tqdm

    from d3d_jax.io.atomic import writing

    template = {"source": "server", "add_generation_prompt": True, "enable_thinking": job.thinking}
    with writing(out):
        out.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(todo), unit="prompt", desc=f"regenerate {out.name} via {job.model}", disable=not progress)
    start, pending, queue = time.perf_counter(), set(), list(reversed(todo))
    skip_limit = max(1, int(max_skipped_fraction * shard_size))
    with writing(out), open(out, "ab") as f, cf.ThreadPoolExecutor(job.client.ep.concurrency) as pool:
        try:
            while queue or pending:
                while queue and len(pending) < job.client.ep.concurrency:
                    p = queue.pop()
                    fut = pool.submit(_ask, job, p)
                    fut.prompt = p
                    pending.add(fut)
                finished, pending = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
                records, fatal = [], None
                for fut in finished:
                    try:
                        rec = fut.result()
                    except EndpointError as e:
                        if "HTTP 4" not in str(e):
                            fatal = fatal or e
                            continue
                        summary.skipped.append((fut.prompt.line, f"id {fut.prompt.id!r}: {e}"))
                        if len(summary.skipped) > skip_limit:
                            fatal = fatal or DataError(
                                f"{len(summary.skipped)} prompts refused by the server, more than "
                                f"max_skipped_fraction allows (first: {summary.skipped[0][1]})")
                        continue
                    rec.update(generation=run["generation"], template={
                        **template, "chat_template_kwargs_sent": job.send_template_kwargs}, target=run["target"])
                    records.append(rec)
                append_records(f, records)  # what finished is kept even when the run stops here
                if fatal is not None:
                    raise fatal
                summary.written += len(records)
                summary.generated_tokens += sum(len(r["response_token_ids"]) for r in records)
                summary.seconds = time.perf_counter() - start
                bar.update(len(records))
                bar.set_postfix(tok_s=f"{summary.tokens_per_s:.1f}")
        finally:
            for fut in pending:
                fut.cancel()
    bar.close()
    summary.seconds = time.perf_counter() - start
