"""A deterministic toy decoder implementing the decoder contract (``d3d_jax.decoding.contract``),
for the serving tests.

Its "language model" is a hash of (previous token, position, seed); :func:`reference` decodes one
request alone, token by token, as the independent reference.  ``step`` commits 1 token (plain) or
``accepted + 1`` tokens (sync/async, a pseudo-random acceptance per round) cut at stop ids and
``max_new_tokens`` — so whatever the batching, every request's tokens must equal its reference.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import threading
import time
from pathlib import Path

TOKENIZER = Path(__file__).resolve().parent.parent / "artifacts" / "demo" / "tokenizer"
EOS = 2


class RequestError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class FakeConfig:
    mode: str = "plain"
    num_slots: int = 4
    max_cache_len: int = 256
    block_size: int = 4
    eos_token_ids: tuple = ()


@dataclasses.dataclass
class Request:
    prompt: list
    max_new_tokens: int
    sampling: object = None
    stop_token_ids: tuple = ()
    seed: int = 0


@dataclasses.dataclass
class StepOutput:
    token_ids: list
    finished: bool
    finish_reason: str | None
    accepted: int
    hit: bool | None = None
    logprobs: list | None = None


def _mix(*xs: int) -> int:
    h = 1469598103934665603
    for x in xs:
        h = ((h ^ (x & 0xFFFFFFFFFFFF)) * 1099511628211) % (1 << 64)
    return h


def next_token(prev: int, pos: int, temperature: float, seed: int, vocab: int) -> int:
    """Greedy ignores the seed; sampling is keyed by (seed, position) like the real decoder."""
    return _mix(prev, pos, seed if temperature > 0 else 0) % vocab


def reference(req: Request, vocab: int = 2048) -> tuple[list[int], str]:
    """The request decoded alone, one token at a time."""
    seq, out = list(req.prompt), []
    temp = getattr(req.sampling, "temperature", 0.0)
    while len(out) < req.max_new_tokens:
        t = next_token(seq[-1], len(seq), temp, req.seed, vocab)
        seq.append(t)
        out.append(t)
        if t in req.stop_token_ids:
            return out, "stop"
    return out, "length"


def fake_scores(ids, top):
    """A stand-in for the target's prompt scorer: token i's log-prob is -i/10."""
    return [(None, None)] + [(-i / 10, [(t, -i / 10)] * min(top, 1)) for i, t in enumerate(ids[1:], 1)]


class FakeDecoder:
    programs = None  # no compiled programs to keep

    def __init__(self, config: FakeConfig, vocab: int = 2048, step_delay_s: float = 0.0):
        self.config, self.vocab, self.step_delay_s = config, vocab, step_delay_s
        self.vocab_size = vocab
        self.warm_ups = 0
        self._slots: dict[int, dict] = {}
        self.steps = self.prefills = self.max_active = 0
        self.rounds_total = self.tokens_total = 0
        self._owner: threading.Thread | None = None

    def _same_thread(self):  # the scheduler must be the only caller
        me = threading.current_thread()
        self._owner = self._owner or me
        assert self._owner is me, "decoder called from two threads"

    def validate_request(self, req: Request) -> None:
        if not req.prompt:
            raise RequestError("prompt is empty")
        if any(not 0 <= t < self.vocab for t in req.prompt):
            raise RequestError(f"prompt has ids outside the vocabulary [0, {self.vocab})")
        if req.max_new_tokens < 1:
            raise RequestError("max_new_tokens must be >= 1")
        need = len(req.prompt) + req.max_new_tokens + self.config.block_size
        if need > self.config.max_cache_len:
            raise RequestError(f"prompt + max_new_tokens + block = {need} > max_cache_len")
        if len(req.stop_token_ids) > 16:
            raise RequestError("too many stop ids")

    def prefill(self, req: Request) -> dict:
        self._same_thread()
        self.validate_request(req)
        self.prefills += 1
        return {"req": req, "seq": list(req.prompt)}

    def insert(self, prefix: dict, slot: int) -> None:
        assert slot in self.free_slots(), f"slot {slot} is not free"
        self._slots[slot] = dict(prefix, out=[], rounds=0, accepted=0, hits=0, misses=0)
        self.max_active = max(self.max_active, len(self._slots))

    def free(self, slot: int) -> None:
        self._slots.pop(slot, None)

    def warm_up(self, widths=None, run: bool = True) -> float:
        self.warm_ups += run
        return 0.0

    def results(self, slots) -> list[dict]:
        return [dict(token_ids=list(self._slots[s]["out"]), finish_reason=None, accept_hist=None)
                for s in slots]

    def free_slots(self) -> list[int]:
        return [s for s in range(self.config.num_slots) if s not in self._slots]

    def active_slots(self) -> list[int]:
        return sorted(self._slots)

    def slot_metrics(self, slot: int) -> dict:
        s = self._slots[slot]
        tau = (s["accepted"] + s["rounds"]) / max(s["rounds"], 1)
        return {"tau": tau, "rounds": s["rounds"], "n_out": len(s["out"]), "hits": s["hits"],
                "misses": s["misses"], "accept_hist": None, "modes": {self._label: s["rounds"]}}

    def can_admit(self, request) -> bool:
        return True

    def allow_preemption(self) -> None:
        pass

    def take_preempted(self) -> list[int]:
        return []

    def page_stats(self) -> None:
        return None

    def param_leaves(self) -> tuple[list, list]:
        return [], []

    @property
    def _label(self) -> str:
        return "plain" if self.config.mode == "plain" else f"{self.config.mode}/{self.config.block_size}"

    def decisions(self) -> dict:
        """Rounds and tokens per geometry, as SpecDecoder.decisions (one geometry here)."""
        return {self._label: dict(rounds=self.rounds_total, tokens=self.tokens_total,
                                  predicted_tokens=0.0)} if self.rounds_total else {}

    def _round(self, s: dict) -> StepOutput:
        req, seq, out = s["req"], s["seq"], s["out"]
        temp = getattr(req.sampling, "temperature", 0.0)
        width = 1 if self.config.mode == "plain" else self.config.block_size
        accepted = _mix(len(seq), req.seed, 7) % width
        hit = None if self.config.mode != "async" else bool(_mix(len(seq), 3) % 2)
        new, reason = [], None
        for _ in range(accepted + 1):
            t = next_token(seq[-1], len(seq), temp, req.seed, self.vocab)
            seq.append(t)
            out.append(t)
            new.append(t)
            if t in req.stop_token_ids:
                reason = "stop"
                break
            if len(out) >= req.max_new_tokens:
                reason = "length"
                break
        s["rounds"] += 1
        self.tokens_total += len(new)
        s["accepted"] += accepted
        s["hits"] += hit is True
        s["misses"] += hit is False
        top = getattr(req.sampling, "logprobs", -1)
        lps = None if top is None or top < 0 else [(-0.5, [(t, -0.5)] * min(top, 1)) for t in new]
        return StepOutput(new, reason is not None, reason, accepted, hit, lps)

    def step(self) -> dict[int, StepOutput]:
        self._same_thread()
        self.steps += 1
        self.rounds_total += bool(self._slots)
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        return {slot: self._round(s) for slot, s in sorted(self._slots.items())}


class FakeServer:
    """A FakeDecoder behind the real scheduler, app and uvicorn on a free localhost port."""

    def __init__(self, tokenizer, mode="sync", num_slots=4, step_delay_s=0.0, api_key=None, **kw):
        from d3d_jax.serving.app import create_app
        from d3d_jax.serving.server import ServerThread, make_service

        self.tok = tokenizer
        self.dec = FakeDecoder(FakeConfig(mode=mode, num_slots=num_slots), step_delay_s=step_delay_s)
        self.svc = make_service(self.dec, tokenizer, (EOS,), model_name="toy", mode=mode,
                                api_key=api_key, request_cls=Request, score_prompt=fake_scores, **kw)
        self.svc.scheduler.start()
        self.http = ServerThread(create_app(self.svc)).start()
        import openai

        self.client = openai.OpenAI(base_url=self.http.url + "/v1", api_key=api_key or "none",
                                    max_retries=0, timeout=60)

    def close(self):
        self.http.stop()
        self.svc.scheduler.stop()

    def expected(self, prompt_ids, max_tokens, seed=0, temperature=0.0, stop_ids=(EOS,)):
        from d3d_jax.decoding.verify import SamplingParams

        ids, reason = reference(Request(list(prompt_ids), max_tokens, SamplingParams(temperature),
                                        tuple(stop_ids), seed))
        return ids, self.tok.decode(ids, skip_special_tokens=True), reason

    def raw(self, method, path, body=None, headers=None):
        """(status, parsed JSON or text) with the stdlib client: no SDK-side validation."""
        conn = http.client.HTTPConnection(self.http.host, self.http.port, timeout=30)
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        text = r.read().decode()
        conn.close()
        try:
            return r.status, json.loads(text)
        except json.JSONDecodeError:
            return r.status, text

    def wait_idle(self, timeout_s=10.0):
        t_end = time.monotonic() + timeout_s
        while self.dec.active_slots() or self.svc.scheduler.num_queued:
            assert time.monotonic() < t_end, f"slots still busy: {self.dec.active_slots()}"
            time.sleep(0.01)
