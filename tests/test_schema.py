"""The declared request bodies (d3d_jax/serving/schema.py) and their one error path.

The reference is a hand-written table of the JSON kinds OpenAI's API (and vLLM's extensions)
accept for each field, independent of the pydantic models: a seeded generator builds values of
every other kind, and each one must be a 400 naming the field, in the parser and through the
HTTP app (over ``serve_fake.FakeDecoder``: no model is compiled).
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from d3d_jax.serving import protocol as P
from d3d_jax.serving import schema as S

SEED = 45
KINDS = ("null", "bool", "int", "float", "str", "list", "object")
NUM, INT, BOOL, TEXT = {"null", "int", "float"}, {"null", "int"}, {"null", "bool"}, {"null", "str"}
REFUSED = "refused"  # every value but the field's no-op ones is refused
# field -> JSON kinds accepted (before ranges), from OpenAI's request schemas and vLLM's docs
COMMON = {"model": {"str"}, "stream": BOOL, "stream_options": {"null", "object"}, "max_tokens": INT,
          "temperature": NUM, "top_p": NUM, "seed": INT, "stop": {"null", "str", "list"}, "n": INT,
          "presence_penalty": NUM, "frequency_penalty": NUM, "logit_bias": {"null", "object"}, "user": TEXT,
          "top_k": INT, "min_p": NUM, "repetition_penalty": NUM, "min_tokens": INT,
          "stop_token_ids": {"null", "list"}, "ignore_eos": BOOL, "skip_special_tokens": BOOL,
          "return_token_ids": BOOL}
ACCEPTS = {
    "completion": COMMON | {"prompt": {"str", "list"}, "echo": BOOL, "logprobs": INT, "suffix": REFUSED,
                            "best_of": REFUSED},
    "chat": COMMON | {"messages": {"list"}, "max_completion_tokens": INT, "logprobs": BOOL, "top_logprobs": INT,
                      "safety_identifier": TEXT, "prompt_cache_key": TEXT}
    | {"tools": {"null", "list"}, "tool_choice": {"null", "str", "object"}, "parallel_tool_calls": BOOL,
       "chat_template_kwargs": {"null", "object"}, "response_format": {"null", "object"},
       "structured_outputs": {"null", "object"}}
    | dict.fromkeys(("audio", "function_call", "functions", "modalities", "moderation", "prediction", "reasoning_effort", "verbosity",
                     "web_search_options", "store", "metadata", "service_tier",
                     "prompt_cache_retention", "prompt_cache_options"), REFUSED),
}
# list fields: the kinds their elements may be
ELEMENTS = {"prompt": {"str", "int", "list"}, "stop": {"str"}, "stop_token_ids": {"int"}, "messages": {"object"}}
BASE = {"completion": {"model": "toy", "prompt": "To be", "max_tokens": 4, "temperature": 0},
        "chat": {"model": "toy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}}
LIMITS = P.Limits(context_len=256, vocab_size=2048)


def value_of(kind: str, rng: random.Random):
    """A random JSON value of ``kind``; floats have a fraction (``3.0`` is the integer 3)."""
    if kind == "null":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.choice([0, 1, -1, 7, 2 ** 31, -(2 ** 70), 10 ** 30])
    if kind == "float":
        return rng.choice([0.5, -1.25, 3.75, 1e-9, 1e300]) + rng.random() * 1e-3
    if kind == "str":
        return rng.choice(["", "x", "1", "true", "null", "[]", "\u00e9" * rng.randint(1, 9)])
    if kind == "list":
        return [value_of(rng.choice(KINDS[:5]), rng) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["a", "5", "type", "role"]): value_of(rng.choice(KINDS[:5]), rng)
            for _ in range(rng.randint(0, 2))}


def wrong_bodies(kind: str, rng: random.Random, per_kind: int):
    """(field, body) pairs: one field of a valid body holds a value of a kind it does not accept,
    or (list fields) a list with one element of a kind it does not accept."""
    for field, accepts in ACCEPTS[kind].items():
        for k in KINDS:
            if accepts != REFUSED and k in accepts:
                continue
            for _ in range(per_kind):
                v = value_of(k, rng)
                noop = S.is_refused(S.BODIES[kind], field) or ()
                if accepts == REFUSED and (v is None or any(v == ok and type(v) is type(ok) for ok in noop)):
                    continue
                yield field, dict(BASE[kind], **{field: v})
        for k in sorted(set(KINDS) - ELEMENTS.get(field, set(KINDS))):
            good = {"prompt": "x", "stop": "x", "stop_token_ids": 5,
                    "messages": {"role": "user", "content": "hi"}}[field]
            bad = value_of(k, rng)
            yield field, dict(BASE[kind], **{field: [good, bad] if rng.random() < 0.5 else [bad]})


def parse(kind: str, body: dict):
    return (P.parse_chat if kind == "chat" else P.parse_completion)(body, "toy", LIMITS)


def test_every_declared_field_has_a_kind_in_the_reference_table():
    """A field added to a model without a decision here fails: the table is the review."""
    for kind in ("completion", "chat"):
        assert set(S.BODIES[kind].model_fields) == set(ACCEPTS[kind]), kind
        for field, accepts in ACCEPTS[kind].items():
            assert (accepts == REFUSED) == (P.FIELDS[kind][field] is not P.SERVED), (kind, field)


def test_the_silent_cases_are_refused_by_name():
    """Two fields that were accepted silently: a token id inside ``stop`` (OpenAI: strings only; ids go in
    ``stop_token_ids``) and a message's ``name``, which the chat template would drop."""
    cases = [("completion", dict(BASE["completion"], stop=["a", 5]), "stop"),
             ("chat", dict(BASE["chat"], messages=[{"role": "user", "content": "hi", "name": "bob"}]), "messages"),
             ("chat", dict(BASE["chat"], messages=[{"role": "user", "content": "hi", "tool_call_id": "1"}]),
              "messages"),
             ("completion", dict(BASE["completion"], stream_options={"include_usage": 1}, stream=True),
              "stream_options")]
    for kind, body, field in cases:
        with pytest.raises(P.ApiError) as e:
            parse(kind, body)
        assert e.value.status == 400 and e.value.param == field, (body, e.value)
    assert parse("completion", dict(BASE["completion"], stop=["a", "b"])).params.stop == ("a", "b")
    assert parse("completion", dict(BASE["completion"], max_tokens=3.0)).params.max_tokens == 3


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_wrong_typed_values_are_a_400_naming_the_field_in_the_parser(kind):
    rng = random.Random(SEED)
    n = 0
    for field, body in wrong_bodies(kind, rng, per_kind=4):
        with pytest.raises(P.ApiError) as e:
            parse(kind, body)
        err = e.value
        assert err.status == 400 and err.param == field and field in str(err), (field, body, err)
        assert len(str(err)) < 400, str(err)  # values are cut short, never repr'd whole
        n += 1
    assert n > 150, n


def test_errors_never_repr_a_large_value():
    huge = "y" * 1_000_000
    for kind, body in (("completion", dict(BASE["completion"], temperature=huge)),
                       ("completion", dict(BASE["completion"], best_of=[huge])),
                       ("completion", dict(BASE["completion"], **{huge: 1})),
                       ("chat", dict(BASE["chat"], messages=[{"role": huge, "content": "x"}]))):
        with pytest.raises(P.ApiError) as e:
            parse(kind, body)
        assert len(str(e.value)) < 400


@pytest.fixture(scope="module")
def server():
    from serve_fake import TOKENIZER, FakeServer

    from d3d_jax.io.hf import load_tokenizer

    s = FakeServer(load_tokenizer(TOKENIZER)[0], mode="sync")
    yield s
    s.close()


def test_wrong_typed_values_are_a_400_naming_the_field_over_http(server):
    """Through the app: no 200, no 422, no 5xx, and the decoder never sees one of them."""
    rng = random.Random(SEED + 1)
    prefills = server.dec.prefills
    for kind, path in (("completion", "/v1/completions"), ("chat", "/v1/chat/completions")):
        for field, body in wrong_bodies(kind, rng, per_kind=1):
            status, out = server.raw("POST", path, body)
            assert status == 400, (field, body, status, out)
            assert out["error"]["param"] == field and out["error"]["type"] == "invalid_request_error", (field, out)
    assert server.dec.prefills == prefills
    for path, body, field in (("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {"prompt": "x", "z": 1}, "z"),
                              ("/detokenize", {"tokens": [1, "a"]}, "tokens"),
                              ("/detokenize", {"tokens": [1, 5000]}, "tokens")):
        status, out = server.raw("POST", path, body)
        assert status == 400 and out["error"]["param"] == field, (body, out)
    assert server.raw("POST", "/v1/completions", dict(BASE["completion"]))[0] == 200


def test_tokenize_runs_off_the_event_loop(server, monkeypatch):
    """A slow /tokenize (a megabyte of text) must not stall the other routes."""
    real = server.tok.encode

    def slow(text, **kw):
        if text.startswith("SLOW"):
            time.sleep(1.5)
        return real(text, **kw)

    monkeypatch.setattr(server.tok, "encode", slow)
    t = threading.Thread(target=server.raw, args=("POST", "/tokenize", {"prompt": "SLOW text"}))
    t.start()
    time.sleep(0.2)
    t0 = time.perf_counter()
    assert server.raw("GET", "/health")[0] == 200
    assert time.perf_counter() - t0 < 1.0
    t.join()


def test_min_tokens_past_the_room_left_names_min_tokens():
    """Was: the decoder's own check, blaming 'prompt' and an internal block size."""
    params = parse("completion", dict(BASE["completion"], max_tokens=None, min_tokens=250)).params
    with pytest.raises(P.ApiError) as e:
        P.resolve_max_tokens(10, params, LIMITS)
    assert e.value.param == "min_tokens" and "246 tokens left" in str(e.value) and "block" not in str(e.value)


def test_a_broken_chat_template_is_the_servers_error_a_refusing_one_the_requests(server, monkeypatch):
    import jinja2

    chat = dict(BASE["chat"])

    def refuses(tok, messages, **kw):
        raise jinja2.exceptions.TemplateError("Conversation roles must alternate")

    def broken(tok, messages, **kw):
        raise jinja2.exceptions.UndefinedError("'bos_token' is undefined")

    monkeypatch.setattr(server.svc, "chat_encode", refuses)
    status, out = server.raw("POST", "/v1/chat/completions", chat)
    assert status == 400 and out["error"]["param"] == "messages" and "alternate" in out["error"]["message"]
    monkeypatch.setattr(server.svc, "chat_encode", broken)
    status, out = server.raw("POST", "/v1/chat/completions", chat)  # was: a 400 blaming 'messages'
    assert status == 500 and out["error"]["type"] == "server_error" and out["error"]["param"] is None, out


# ---- numbers bounded before they are parsed -----------------------------------------------------
LONG = "9" * 5000  # past Python's 4,300-digit conversion limit: a 500 before
# where a number can sit in each route's body: (field, JSON with the number as N)
NUMBER_PLACES = {
    "completion": [(f, '"%s": N' % f) for f in sorted(f for f, k in ACCEPTS["completion"].items()
                                                          if k != REFUSED and k & {"int", "float"})]
    + [("prompt", '"prompt": [1, N]'), ("prompt", '"prompt": [[N]]'), ("logit_bias", '"logit_bias": {"5": N}'),
       ("stop_token_ids", '"stop_token_ids": [N]'), ("best_of", '"best_of": N'), ("suffix", '"suffix": N')],
    "chat": [(f, '"%s": N' % f) for f in ("max_tokens", "max_completion_tokens", "top_logprobs", "seed")]
    + [("messages", '"messages": [{"role": "user", "content": "hi", "name": N}]'), ("metadata", '"metadata": {"a": N}')],
    "detokenize": [("tokens", '"tokens": [1, N]')],
    "tokenize": [("prompt", '"prompt": N'), ("add_special_tokens", '"add_special_tokens": N')],
}
PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions", "tokenize": "/tokenize",
         "detokenize": "/detokenize"}


def long_number_bodies():
    """(route, field, raw body) with a 5,000-digit integer, a negative one or a 402-character float;
    the number is found before the body is validated, so nothing else in it matters."""
    for kind, places in NUMBER_PLACES.items():
        for field, text in places:
            for number in (LONG, "-" + LONG, "1" + "0" * 400 + ".5"):
                yield kind, field, ('{"model": "toy", ' + text.replace("N", number) + "}").encode()


def test_a_long_number_in_any_field_is_a_400_naming_it_in_the_parser():
    for kind, field, raw in long_number_bodies():
        with pytest.raises(P.ApiError) as e:
            P.parse_json(raw)
        assert e.value.status == 400 and e.value.param == field, (kind, raw[:80], e.value)
        assert "characters; numbers are read up to 100" in str(e.value), str(e.value)


def test_a_long_number_in_any_field_is_a_400_over_http(server):
    """Was: HTTP 500 with a traceback ("Exceeds the limit (4300 digits) for integer string conversion")."""
    prefills = server.dec.prefills
    for kind, field, raw in long_number_bodies():
        status, out = server.raw("POST", PATHS[kind], raw)
        assert status == 400 and out["error"]["param"] == field, (kind, raw[:80], status, out)
    assert server.dec.prefills == prefills
    status, out = server.raw("POST", "/v1/completions", dict(BASE["completion"], max_tokens=10 ** 99))
    assert status == 400 and "must be <= " in out["error"]["message"]  # 100 characters: read, then range-checked


def test_a_logit_bias_past_the_table_names_its_size_and_the_limit():
    """Was: "'logit_bias' has None items" (pydantic leaves a mapping's length out).  vLLM takes any
    number; this server's per-request bias table holds MAX_LOGIT_BIAS."""
    for n in (S.MAX_LOGIT_BIAS + 1, 10_000):
        with pytest.raises(P.ApiError) as e:
            parse("completion", dict(BASE["completion"], logit_bias={str(i): 1.0 for i in range(n)}))
        assert e.value.param == "logit_bias" and str(e.value) == (
            f"'logit_bias' has {n} entries; this server accepts at most {S.MAX_LOGIT_BIAS}"), str(e.value)
    with pytest.raises(P.ApiError, match=rf"'stop' has {S.MAX_STOP + 1} items; this server accepts at most"):
        parse("completion", dict(BASE["completion"], stop=["x"] * (S.MAX_STOP + 1)))
    parse("completion", dict(BASE["completion"], logit_bias={str(i): 1.0 for i in range(S.MAX_LOGIT_BIAS)}))


def test_a_compressed_body_is_a_415_whatever_it_holds(server):
    """Was: a gzip body got a JSON error and a plain body labelled gzip a 200.  As vLLM: any
    Content-Encoding but identity is 415, before the body is read."""
    import gzip
    import json

    plain = json.dumps(BASE["completion"]).encode()
    prefills = server.dec.prefills
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        for encoding, data in (("gzip", gzip.compress(plain)), ("gzip", plain), ("deflate", plain), ("br", plain),
                               ("GZIP", plain), ("identity, gzip", plain)):
            status, out = server.raw("POST", path, data, headers={"Content-Encoding": encoding})
            assert status == 415 and "Content-Encoding" in out["error"]["message"], (path, encoding, status, out)
    assert server.dec.prefills == prefills
    for encoding in ("identity", "Identity"):
        assert server.raw("POST", "/v1/completions", plain, headers={"Content-Encoding": encoding})[0] == 200
