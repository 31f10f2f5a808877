"""The OpenAI-compatible server (d3d_jax/serving).

Fast tests run the real HTTP stack (uvicorn on 127.0.0.1, the official ``openai`` client) over
``serve_fake.FakeDecoder`` — a toy LM implementing the decoder contract, whose solo token-by-token
decode (``serve_fake.reference``) is the independent reference.  ``test_serve_e2e.py`` runs the
real SpecDecoder on the demo models (slow).
"""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import random
import time
from pathlib import Path

import pytest

from serve_fake import EOS, TOKENIZER, FakeConfig, FakeDecoder, FakeServer, Request, reference  # noqa: F401

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def tokenizer():
    from d3d_jax.io.hf import load_tokenizer

    return load_tokenizer(TOKENIZER)[0]


@pytest.fixture
def make_server(tokenizer):
    made = []

    def make(**kw):
        made.append(FakeServer(tokenizer, **kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


def stream_text(stream) -> tuple[str, object]:
    """The streamed text and the last chunk with a choice; usage rides only on the extra
    choice-less final chunk (``include_usage``), never on a choice's chunk."""
    parts, last = [], None
    for ch in stream:
        for c in ch.choices:
            parts.append(c.text if hasattr(c, "text") else (c.delta.content or ""))
        assert ch.usage is None or not ch.choices, "usage on a choice's chunk"
        last = ch if ch.choices else last
        if not ch.choices:
            last.usage_chunk = ch
    return "".join(parts), last


# --------------------------------------------------------------------------------------------
# Incremental detokenization
# --------------------------------------------------------------------------------------------
def test_textstream_equals_full_decode_in_any_chunking(tokenizer):
    from d3d_jax.serving.textstream import TextStream

    rng = random.Random(0)
    for trial in range(40):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 60))]
        ts, out, i = TextStream(tokenizer, [1, 2, 3]), [], 0
        while i < len(ids):
            n = rng.randrange(1, 5)
            piece = ts.push(ids[i:i + n])
            assert not piece.endswith("\ufffd") or i + n >= len(ids) or "\ufffd" in tokenizer.decode(ids[:i + n]), \
                "released an incomplete character"
            out.append(piece)
            i += n
        out.append(ts.flush())
        assert "".join(out) == tokenizer.decode(ids, skip_special_tokens=True), trial
        assert ts.n_tokens == len(ids)


def test_textstream_cuts_at_the_first_stop_string(tokenizer):
    from d3d_jax.serving.textstream import TextStream

    rng = random.Random(1)
    for trial in range(30):
        ids = [rng.randrange(6, len(tokenizer)) for _ in range(40)]
        full = tokenizer.decode(ids, skip_special_tokens=True)
        a = rng.randrange(5, len(full) - 6)
        stop = full[a:a + rng.randrange(1, 6)]
        ts = TextStream(tokenizer, [], [stop, "\x00never"])
        got = "".join(ts.push([t]) for t in ids) + ts.flush()
        assert got == full[:full.find(stop)], (trial, stop)
        assert ts.stopped
        # n_tokens: the first prefix of the output whose text contains the stop string
        first = next(k for k in range(1, len(ids) + 1)
                     if stop in tokenizer.decode(ids[:k], skip_special_tokens=True))
        assert ts.n_tokens == first


# --------------------------------------------------------------------------------------------
# The API with the openai client
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["plain", "sync", "async"])
def test_completions_stream_and_full_equal_the_solo_reference(make_server, mode):
    s = make_server(mode=mode)
    prompt = "To be, or not to be"
    ids = s.tok.encode(prompt, add_special_tokens=False)
    exp_ids, exp_text, _ = s.expected(ids, 24, stop_ids=())
    text, last = stream_text(s.client.completions.create(
        model="toy", prompt=prompt, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert text == exp_text
    assert last.choices[0].finish_reason == "length"
    final = last.usage_chunk
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(ids), 24)
    spec = final.model_extra["spec_metrics"]
    # τ·rounds = tokens committed, of which the last round's may be cut at max_tokens
    assert spec["rounds"] <= 24 <= spec["tau"] * spec["rounds"] < 24 + 4
    assert (spec["tau"] == 1.0) if mode == "plain" else spec["tau"] > 1.0
    assert (spec["hit_rate"] is not None) == (mode == "async")
    full = s.client.completions.create(model="toy", prompt=ids, max_tokens=24, temperature=0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    assert full.choices[0].text == exp_text and full.choices[0].model_extra["token_ids"] == exp_ids
    assert full.usage.completion_tokens == 24 and full.model_extra["spec_metrics"]["rounds"] >= 1
    s.wait_idle()


def test_chat_uses_the_non_thinking_template(make_server):
    from d3d_jax.io.chat import chat_prompt_ids

    s = make_server(mode="sync")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    ids = chat_prompt_ids(s.tok, messages)
    assert s.tok.decode(ids).endswith("<think>\n\n</think>\n\n")
    _, exp_text, reason = s.expected(ids, 30)
    stream = s.client.chat.completions.create(model="toy", messages=messages, max_tokens=30,
                                              temperature=0, stream=True,
                                              stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == exp_text
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(ids)
    full = s.client.chat.completions.create(model="toy", messages=messages, max_completion_tokens=30,
                                            temperature=0)
    assert full.choices[0].message.content == exp_text
    assert full.choices[0].finish_reason == ("length" if reason == "length" else "stop")


def test_sixteen_concurrent_streams_equal_one_at_a_time(make_server):
    s = make_server(mode="sync", num_slots=4, step_delay_s=0.002)  # 16 streams > 4 slots: they queue
    rng = random.Random(2)
    prompts = [[rng.randrange(6, 2048) for _ in range(rng.randrange(3, 30))] for _ in range(16)]
    lengths = [rng.randrange(1, 40) for _ in prompts]

    def one(i):
        return stream_text(s.client.completions.create(model="toy", prompt=prompts[i], max_tokens=lengths[i],
                                                       temperature=0, stream=True))[0]

    solo = [one(i) for i in range(16)]
    with cf.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(one, range(16)))
    assert together == solo
    assert solo == [s.expected(p, n)[1] for p, n in zip(prompts, lengths)]
    assert s.dec.max_active == 4  # the slots were shared, and no request failed for lack of one
    s.wait_idle()
    assert s.dec.free_slots() == [0, 1, 2, 3]


def test_seeded_sampling_is_reproducible(make_server):
    s = make_server(mode="sync")
    kw = dict(model="toy", prompt="abc", max_tokens=20, temperature=0.8, top_p=0.9)
    a = s.client.completions.create(seed=7, extra_body={"top_k": 20}, **kw).choices[0].text
    b = s.client.completions.create(seed=7, **kw).choices[0].text
    c = s.client.completions.create(seed=8, **kw).choices[0].text
    ids = s.tok.encode("abc", add_special_tokens=False)
    assert a == b == s.expected(ids, 20, seed=7, temperature=0.8)[1]
    assert c != a


def test_stop_strings_and_stop_ids(make_server):
    s = make_server(mode="sync")
    ids = s.tok.encode("Once upon", add_special_tokens=False)
    exp_ids, exp_text, _ = s.expected(ids, 40, stop_ids=())
    stop = exp_text[len(exp_text) // 2: len(exp_text) // 2 + 3]
    out = s.client.completions.create(model="toy", prompt=ids, max_tokens=40, temperature=0,
                                      stop=[stop], extra_body={"ignore_eos": True})
    assert out.choices[0].text == exp_text[:exp_text.find(stop)]
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens < 40
    text, last = stream_text(s.client.completions.create(model="toy", prompt=ids, max_tokens=40, temperature=0,
                                                         stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert text == exp_text[:exp_text.find(stop)] and last.choices[0].finish_reason == "stop"
    sid = exp_ids[6]
    cut = exp_ids.index(sid) + 1
    out = s.client.completions.create(model="toy", prompt=ids, max_tokens=40, temperature=0,
                                      extra_body={"stop_token_ids": [sid], "ignore_eos": True,
                                                  "return_token_ids": True})
    assert out.choices[0].model_extra["token_ids"] == exp_ids[:cut]
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == cut
    s.wait_idle()


# --------------------------------------------------------------------------------------------
# Cancellation, queueing, failures
# --------------------------------------------------------------------------------------------
def test_a_disconnected_stream_frees_its_slot(make_server):
    s = make_server(mode="plain", num_slots=2, step_delay_s=0.01)
    stream = s.client.completions.create(model="toy", prompt="x", max_tokens=150, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
    got = [next(iter(stream)) for _ in range(3)]
    assert all(c.choices[0].finish_reason is None for c in got)
    stream.close()  # the client goes away mid-stream
    steps = s.dec.steps
    s.wait_idle(timeout_s=5)
    assert s.dec.steps - steps < 60  # freed long before its 150 tokens were decoded
    assert s.svc.scheduler.metrics.requests["cancelled"] == 1
    # a request cancelled while still queued is never prefilled
    long = [s.client.completions.with_streaming_response.create(
        model="toy", prompt="y", max_tokens=100, temperature=0, stream=True, extra_body={"ignore_eos": True})
        for _ in range(2)]
    resp = [cm.__enter__() for cm in long]
    queued = s.client.completions.with_streaming_response.create(model="toy", prompt="z", max_tokens=5,
                                                                 temperature=0, stream=True)
    q = queued.__enter__()
    t_end = time.monotonic() + 5
    while len(s.dec.active_slots()) < 2 or s.svc.scheduler.num_queued != 1:
        assert time.monotonic() < t_end, "the third request did not queue behind the two"
        time.sleep(0.01)
    prefills = s.dec.prefills
    q.close()
    for r in resp:
        r.close()
    s.wait_idle(timeout_s=5)
    assert s.dec.prefills == prefills and s.dec.free_slots() == [0, 1]


def test_a_failing_step_errors_the_batch_and_the_server_goes_on(make_server, monkeypatch):
    s = make_server(mode="sync")
    real_step = s.dec.step
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device lost")
        return real_step()

    monkeypatch.setattr(s.dec, "step", flaky)
    status, body = s.raw("POST", "/v1/completions", {"model": "toy", "prompt": "abc", "max_tokens": 50,
                                                      "temperature": 0, "ignore_eos": True})
    assert status == 500 and "device lost" in body["error"]["message"]
    text = s.client.completions.create(model="toy", prompt="abc", max_tokens=8, temperature=0).choices[0].text
    assert text == s.expected(s.tok.encode("abc", add_special_tokens=False), 8)[1]
    assert s.raw("GET", "/health")[0] == 200


BAD = [
    ({"model": "toy", "prompt": list(range(10, 270)), "max_tokens": 4}, "prompt", "at most 251"),
    ({"model": "toy", "prompt": list(range(10, 60)), "max_tokens": 400}, "max_tokens", "context length"),
    ({"model": "toy", "prompt": "hi", "max_tokens": 0}, "max_tokens", ">= 1"),
    ({"model": "toy", "prompt": "hi", "max_tokens": -3}, "max_tokens", ">= 1"),
    ({"model": "toy", "prompt": [1.5, 2.0]}, "prompt", "a list of token-id lists"),
    ({"prompt": "hi"}, "model", "required"),
    ({"model": "toy", "prompt": "hi", "temperature": -0.5}, "temperature", ">= 0"),
    ({"model": "toy", "prompt": "hi", "top_p": 0}, "top_p", "> 0"),
    ({"model": "toy", "prompt": "hi", "n": 17}, "n", "<= 16"),
    ({"model": "toy", "prompt": "hi", "max_tokens": 2 ** 80}, "max_tokens", "<= 2147483647"),
    ({"model": "toy", "prompt": "hi", "top_k": 10 ** 90}, "top_k", "<= 2147483647"),
    ({"model": "toy", "prompt": "hi", "top_k": 10 ** 400}, "top_k", "401 characters; numbers are read up to 100"),
    ({"model": "toy", "prompt": "hi", "repetition_penalty": 0}, "repetition_penalty", "> 0"),
    ({"model": "toy", "prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ({"model": "toy", "prompt": "hi", "audio": {"voice": "x"}}, "audio", "not a field"),
    ({"model": "toy", "prompt": "hi", "use_beam_search": True}, "use_beam_search", "not a field"),
    ({"model": "toy", "prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias", "not a token id"),
    ({"model": "toy", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     "top_logprobs", "logprobs"),
    ({"model": "toy", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
     "tools", "required"),
    ({"model": "toy", "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}},
     "response_format", "one of"),
    ({"model": "toy", "prompt": ""}, "prompt", "empty"),
    ({"model": "toy", "prompt": [5, 99999]}, "prompt", "vocabulary"),
    ({"model": "toy", "prompt": "hi", "stop": [""]}, "stop", "non-empty"),
    ({"model": "toy", "messages": []}, "messages", "non-empty"),
]


def test_bad_requests_get_400_and_cost_no_decoder_work(make_server):
    s = make_server(mode="sync")
    for body, param, words in BAD:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        status, out = s.raw("POST", path, body)
        assert status == 400, (body, out)
        assert out["error"]["param"] == param and words in out["error"]["message"], out
    status, out = s.raw("POST", "/v1/completions", {"model": "gpt-9", "prompt": "hi"})
    assert status == 404 and out["error"]["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        s.client.completions.create(model="gpt-9", prompt="hi")
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        status, out = s.raw("POST", "/v1/completions", raw)
        assert status == 400 and "JSON" in out["error"]["message"]
    status, out = s.raw("POST", "/v1/completions", {"model": "toy", "prompt": "x" * (2 << 20)})
    assert status == 413 and "limit" in out["error"]["message"]
    assert s.dec.prefills == 0  # none of them reached the decoder
    with pytest.raises(openai.BadRequestError, match="negative|>= 0"):
        s.client.completions.create(model="toy", prompt="hi", temperature=-1)
    ok = s.client.completions.create(model="toy", prompt="hi", max_tokens=3, temperature=0)
    assert ok.choices[0].text == s.expected(s.tok.encode("hi", add_special_tokens=False), 3)[1]
    assert s.raw("GET", "/v1/nowhere")[0] == 404


def test_api_key_gives_401_and_generates_nothing(make_server):
    s = make_server(mode="plain", api_key="s3cret")
    body = {"model": "toy", "prompt": "hi", "max_tokens": 4}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                    {"Authorization": "Basic s3cret"}):
        for path in ("/v1/completions", "/v1/models", "/metrics"):
            status, out = s.raw("POST" if path == "/v1/completions" else "GET", path, body, headers)
            assert status == 401 and out["error"]["code"] == "invalid_api_key", (headers, path)
    bad = openai.OpenAI(base_url=s.http.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(**body, stream=True)
    assert s.dec.prefills == 0 and s.dec.steps == 0
    assert s.raw("GET", "/health")[0] == 200  # liveness stays open
    assert s.client.completions.create(**body, temperature=0).usage.completion_tokens == 4
    assert [m.id for m in s.client.models.list()] == ["toy"]


def _metric(text: str, name: str, labels: str = "") -> float:
    for line in text.splitlines():
        if line.startswith(f"d3d_{name}{labels} "):
            return float(line.split()[-1])
    raise AssertionError(f"{name}{labels} not in /metrics")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_prometheus_metrics(make_server, mode):
    s = make_server(mode=mode, num_slots=2)
    outs = [s.client.completions.create(model="toy", prompt=p, max_tokens=n, temperature=0,
                                        extra_body={"ignore_eos": True})
            for p, n in (("a", 10), ("bb", 17), ("ccc", 5))]
    status, text = s.raw("GET", "/metrics")
    assert status == 200
    assert _metric(text, "generation_tokens_total") == sum(o.usage.completion_tokens for o in outs) == 32
    assert _metric(text, "prompt_tokens_total") == sum(o.usage.prompt_tokens for o in outs)
    assert _metric(text, "active_slots") == 0 and _metric(text, "queued_requests") == 0
    assert _metric(text, "slots", f'{{mode="{mode}"}}') == 2
    assert _metric(text, "requests_total", '{outcome="length"}') == 3
    assert _metric(text, "generation_tokens_per_second") > 0
    snap = s.svc.scheduler.metrics.snapshot()
    rounds = sum(o.model_extra["spec_metrics"]["rounds"] for o in outs)
    accepted = sum(o.model_extra["spec_metrics"]["accepted_tokens"] for o in outs)
    assert _metric(text, "acceptance_tau") == pytest.approx((accepted + rounds) / rounds, rel=1e-5)
    assert snap["counters"]["row_rounds"] == rounds
    hits = sum(o.model_extra["spec_metrics"]["hits"] for o in outs)
    misses = sum(o.model_extra["spec_metrics"]["misses"] for o in outs)
    if mode == "async":
        assert _metric(text, "async_hit_rate") == pytest.approx(hits / (hits + misses), rel=1e-5)
    else:  # a hit rate applies to async rounds only: not shown as 0
        assert "d3d_async_hit_rate" not in text
    # the decoder's rounds per mode and geometry, and each request's mode mix
    labels = f'{{mode="{mode}",geometry="4"}}'
    assert _metric(text, "mode_rounds_total", labels) == snap["counters"]["rounds"]
    assert _metric(text, "mode_tokens_total", labels) == 32
    assert [o.model_extra["spec_metrics"]["modes"] for o in outs] == \
        [{f"{mode}/4": o.model_extra["spec_metrics"]["rounds"]} for o in outs]


# --------------------------------------------------------------------------------------------
# The evaluation harness's --concurrency N (scheduler rounds without HTTP)
# --------------------------------------------------------------------------------------------
def test_eval_concurrency_keeps_n_in_flight_and_matches_solo(tokenizer):
    from d3d_jax.io.chat import chat_prompt_ids
    from d3d_jax.bench.evaluation import benchmarks as B

    made = {}

    def factory(mode):
        made[mode] = FakeDecoder(FakeConfig(mode=mode, num_slots=3, max_cache_len=512))
        return made[mode]

    from d3d_jax.bench.evaluation.runner import make_runner
    from d3d_jax.config.evaluation import EvalSettings

    settings = EvalSettings(max_new_tokens=12, block_size=4, max_cache_len=512, concurrency=3)

    runner = make_runner(None, None, settings, (EOS,), None, decoder_factory=factory, request_cls=Request)
    samples = [B.Sample(f"s/{i}", [f"question {i} " * (i + 1)] + ([f"and then {i}?"] if i % 3 == 0 else []), "")
               for i in range(7)]
    runs = {m: runner.run_mode(tokenizer, samples, m, chat_prompt_ids) for m in ("plain", "sync", "async")}
    # the solo reference, conversation by conversation (a later turn sees the earlier answer)
    expected = []
    for s in samples:
        conv = []
        for turn in s.turns:
            conv.append({"role": "user", "content": turn})
            ids, _ = reference(Request(chat_prompt_ids(tokenizer, conv), 12, None, (), 0))
            expected.append(ids)
            conv.append({"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)})
    res = B.summarize(runs, 4)
    for m, run in runs.items():
        assert run.outputs == expected, m
        assert made[m].max_active == 3 and made[m].free_slots() == [0, 1, 2]
        assert res[m]["equals_plain"] and res[m]["seconds"] > 0
    assert "hit_rate" in res["async"] and "hit_rate" not in res["sync"]


def test_waiting_events_are_merged_into_one_chunk():
    from d3d_jax.serving.choices import merge
    from d3d_jax.serving.scheduler import Event

    merged = merge(Event([1, 2]), [Event([3, 4]), Event([5], True, "length", {"tau": 2.0})])
    assert (merged.token_ids, merged.finished, merged.finish_reason, merged.metrics, merged.logprobs) == \
        ([1, 2, 3, 4, 5], True, "length", {"tau": 2.0}, None)
    lp = merge(Event([1], logprobs=[(-0.5, [])]), [Event([2], logprobs=[(-1.0, [(2, -1.0)])])])
    assert lp.logprobs == [(-0.5, []), (-1.0, [(2, -1.0)])]


def test_warmup_compiles_one_prompt_per_power_of_two_bucket():
    from d3d_jax.decoding.decoder_config import prompt_bucket
    from d3d_jax.serving.scoring import PromptScorer
    from d3d_jax.serving.server import warmup_lengths

    assert warmup_lengths(256, 1000) == [16, 32, 64, 128, 256]
    assert warmup_lengths(256, 100) == [16, 32, 64, 100]  # 65-100 tokens: bucket 128, warmed too
    assert warmup_lengths(256, 10) == [10] and warmup_lengths(0, 100) == [] and warmup_lengths(256, -5) == []
    # every prompt a client may send lands in a bucket the warm-up compiled (the closed form:
    # the next power of two, at least 16, at most the cache), one prompt per bucket
    for cache_len, limit in ((512, 100), (512, 256), (300, 290), (64, 64)):
        closed = lambda n: min(max(16, 1 << (n - 1).bit_length()), cache_len)  # noqa: E731
        warmed = [closed(n) for n in warmup_lengths(limit, limit)]
        assert sorted(set(warmed)) == warmed == sorted({closed(n) for n in range(1, limit + 1)})
        assert [prompt_bucket(n, cache_len) for n in range(1, limit + 1)] == [closed(n) for n in range(1, limit + 1)]
    # the prompt scorer pads to the same buckets (at most its max_len, or the prompt itself)
    import numpy as np

    widths = []

    def score(params, tokens):
        widths.append(tokens.shape[1])
        return np.zeros(tokens.shape[1]), np.zeros((tokens.shape[1], 1), int), np.zeros((tokens.shape[1], 1))

    scorer = PromptScorer.__new__(PromptScorer)  # no model: only the padding is under test
    scorer.max_len, scorer._score, scorer.params, scorer.top = 100, score, None, 1
    for n in (1, 16, 17, 64, 65, 100, 130):
        scorer([1] * n, 0)
    assert widths == [16, 16, 32, 64, 100, 100, 130]


def test_the_server_finds_a_tokenizer_by_the_files_every_command_knows(tmp_path):
    """A directory holding only ``tokenizer.model`` (a sentencepiece tokenizer) or only
    ``vocab.json`` is a tokenizer directory for ``infer/generate.py``, so for the server too."""
    from types import SimpleNamespace

    from d3d_jax.errors import UsageError
    from d3d_jax.serving.server import _tokenizer_dir

    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"):
        d = tmp_path / name.replace(".", "_")
        d.mkdir()
        (d / name).write_text("{}")
        assert _tokenizer_dir(SimpleNamespace(target=str(d), drafter=None, tokenizer=None)) == str(d)
        assert _tokenizer_dir(SimpleNamespace(target=str(tmp_path), drafter=None, tokenizer=str(d))) == str(d)
    with pytest.raises(UsageError, match="no tokenizer files in"):
        _tokenizer_dir(SimpleNamespace(target=str(tmp_path), drafter=None, tokenizer=None))


def test_routes_tokenize_detokenize_models_version_ping_head(make_server):
    s = make_server(mode="plain")
    ids = s.tok.encode("To be, or not", add_special_tokens=False)
    assert s.raw("POST", "/tokenize", {"model": "toy", "prompt": "To be, or not"}) == \
        (200, {"count": len(ids), "max_model_len": s.svc.limits.context_len, "tokens": ids})
    assert s.raw("POST", "/detokenize", {"tokens": ids}) == (200, {"prompt": "To be, or not"})
    status, out = s.raw("POST", "/tokenize", {"prompt": "x", "model": "other"})
    assert status == 404 and out["error"]["code"] == "model_not_found"
    assert s.raw("POST", "/detokenize", {"tokens": [1, 10 ** 9]})[0] == 400
    assert s.raw("GET", "/v1/models/toy")[1]["id"] == "toy" and s.client.models.retrieve("toy").id == "toy"
    with pytest.raises(openai.NotFoundError):
        s.client.models.retrieve("gpt-9")
    assert s.raw("GET", "/version")[1]["version"] and s.raw("GET", "/ping")[0] == 200
    for path in ("/health", "/metrics"):
        assert s.raw("HEAD", path)[0] == 200


def test_metrics_histograms_vllm_names_and_warmup_left_out(make_server):
    from d3d_jax.serving.server import warmup_in_background

    s = make_server(mode="sync", vllm_metrics=True)
    warmup_in_background(s.svc, [16], max_tokens=9).join(10)
    s.wait_idle()
    outs = [s.client.completions.create(model="toy", prompt=p, max_tokens=n, temperature=0,
                                        extra_body={"ignore_eos": True}) for p, n in (("a", 10), ("bb", 7))]
    stream = list(s.client.completions.create(model="toy", prompt="ccc", max_tokens=5, temperature=0, stream=True,
                                              stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True}))
    rounds = sum(o.model_extra["spec_metrics"]["rounds"] for o in outs) + stream[-1].model_extra["spec_metrics"]["rounds"]
    _, text = s.raw("GET", "/metrics")
    assert _metric(text, "admitted_requests_total") == 3  # the warm-up request is not counted
    assert _metric(text, "generation_tokens_total") == 22
    assert _metric(text, "time_to_first_token_seconds_count") == 3
    assert _metric(text, "e2e_request_latency_seconds_count") == 3
    assert _metric(text, "inter_token_latency_seconds_count") == 22 - 3  # every token after the first
    assert _metric(text, "tokens_per_round_sum") == 22
    assert _metric(text, "tokens_per_round_count") == rounds  # one observation per request and round
    assert _metric(text, "tokens_per_round_bucket", '{le="+Inf"}') == rounds
    assert 'vllm:time_to_first_token_seconds_count{model_name="toy"} 3' in text
    assert 'vllm:num_requests_running{model_name="toy"} 0' in text


@pytest.mark.parametrize("flag, value", [("--max-body-bytes", "-1"), ("--port", "70000"), ("--num-slots", "0"),
                                         ("--max-queue", "-2"), ("--default-max-tokens", "0"), ("--port", "x")])
def test_bad_server_numbers_are_refused_at_start_in_one_line(flag, value, capsys):
    import argparse

    from d3d_jax.serving.server import add_arguments

    parser = add_arguments(argparse.ArgumentParser(prog="serve.py"))
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--target", "t", flag, value])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and flag in err[-1] and value in err[-1], err
