"""The server's OpenAI API with the official ``openai`` client against the real SpecDecoder, plain,
sync, async and auto (whatever geometries auto mixes, its outputs and log-probs are plain decoding's).

A tiny random Qwen3 target over the demo tokenizer (cheap to compile), and replay drafters whose
continuation is plain decoding's output for the same request, each draft wrong with probability
0.3: most drafts are accepted (so a block's later positions see drafts accepted inside it, which
the penalties must count) and some are rejected (so corrections and bonus tokens are the
target's own).  References are computed independently: the target's full forward
(``log_softmax`` of its logits) for log-probabilities, a NumPy loop applying each penalty by its
formula for plain decoding, and requests sent one at a time for ``n`` and batched prompts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

openai = pytest.importorskip("openai")

TOKENIZER = Path(__file__).resolve().parent.parent / "artifacts" / "demo" / "tokenizer"
MODES = ("plain", "sync", "async", "auto")  # auto: plain, sync/4 and async/4x2 rounds mixed
PAD = 64  # the reference forward's fixed length (one compile)
TEXTS = ["To be, or not to be", "Once upon a time", "def main():", "O Romeo, Romeo!"]


def _randomized(model, seed: int, std: float):
    from tiny_models import randomized

    return randomized(model, seed, std)


class Servers:
    """One server per mode over one target; the replay drafters share one continuation table."""

    def __init__(self):
        from d3d_jax.config import ModelConfig
        from d3d_jax.decoding.async_replay import AsyncReplayDrafter
        from d3d_jax.decoding.decoder import DecoderConfig, Request, SpecDecoder
        from d3d_jax.io.hf import load_tokenizer
        from d3d_jax.model.qwen3 import init_model
        from d3d_jax.serving.app import create_app
        from d3d_jax.serving.scoring import PromptScorer
        from d3d_jax.serving.server import ServerThread, make_service

        self.tok = load_tokenizer(TOKENIZER)[0]
        vocab = len(self.tok)
        cfg = ModelConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=8, mask_token_id=3)
        # small weights: logits within a few units of each other, so a penalty can change the argmax
        self.target = _randomized(init_model(cfg, seed=0), 0, 0.15)
        graphdef, params = nnx.split(self.target)
        self._forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))
        self._params = params
        self.drafters = []  # each keeps its own list of continuations
        self.index: dict = {}  # (prompt, sampling) -> continuation index
        self.built: list = []

        def make_request(**kw):
            # one index per (prompt, settings), shared by every server: it keys the randomness
            # (with the seed) and picks the replay drafters' continuation
            key = (tuple(kw["prompt"]), kw["sampling"])
            if key not in self.index:
                self.index[key] = len(self.drafters[0].continuations)
                for d in self.drafters:
                    d.continuations.append([5] * 8)
            self.built.append(key)
            return Request(**kw, index=self.index[key])

        scorer = PromptScorer(self.target, 96)
        self.servers, self.clients, self.svcs = {}, {}, {}
        for mode in MODES:
            drafter = None if mode == "plain" else AsyncReplayDrafter([[5] * 64], vocab, 0.3, 0.5, seed=1)
            self.drafters += [drafter] if drafter is not None else []
            extra = dict(branch_positions=4, branch_fanout=2) if mode == "async" else {}
            # one window width (4 rows; a lone request runs padded): each program is compiled
            # once per mode instead of at widths 1, 2 and 4, none of which the API sees
            dec = SpecDecoder(self.target, drafter, DecoderConfig(mode=mode, num_slots=4, max_cache_len=112,
                                                                  block_size=4, row_buckets=(4,), **extra))
            svc = make_service(dec, self.tok, (2,), model_name="tiny", mode=mode, request_cls=make_request,
                               score_prompt=scorer)
            svc.scheduler.start()
            self.svcs[mode] = svc
            self.servers[mode] = ServerThread(create_app(svc)).start()
            self.clients[mode] = openai.OpenAI(base_url=self.servers[mode].url + "/v1", api_key="x",
                                               max_retries=0, timeout=120)

    def close(self):
        for mode in MODES:
            self.servers[mode].stop()
            self.svcs[mode].scheduler.stop()

    def logits(self, ids: list[int]) -> np.ndarray:
        """The target's own logits at every position of ``ids`` (one full forward, no cache)."""
        tokens = np.zeros((1, PAD), np.int32)
        tokens[0, :len(ids)] = ids
        return np.asarray(self._forward(self._params, jnp.asarray(tokens)), np.float64)[0, :len(ids)]

    def logprobs(self, ids: list[int]) -> np.ndarray:
        x = self.logits(ids)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    def plain(self, **kw):
        """The plain server's completion; its output becomes the drafters' continuation."""
        self.built.clear()
        extra = dict(kw.pop("extra_body", None) or {}, return_token_ids=True)
        out = self.clients["plain"].completions.create(model="tiny", **kw, extra_body=extra)
        for key, choice in zip(self.built, out.choices):
            for d in self.drafters:
                d.continuations[self.index[key]] = list(choice.model_extra["token_ids"])
        return out


@pytest.fixture(scope="module")
def srv():
    s = Servers()
    yield s
    s.close()


def _ids(srv, text):
    return srv.tok.encode(text, add_special_tokens=False)


# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_echo_prompt_logprobs_equal_the_targets_forward(srv, mode):
    ids = _ids(srv, TEXTS[0])
    out = srv.clients[mode].completions.create(model="tiny", prompt=TEXTS[0], echo=True, logprobs=3,
                                               max_tokens=1, temperature=0)
    lp = out.choices[0].logprobs
    ref = srv.logprobs(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # OpenAI: the first is null
    np.testing.assert_allclose(lp.token_logprobs[1:len(ids)], [ref[i - 1, t] for i, t in enumerate(ids) if i],
                               atol=1e-4)
    for i in range(1, len(ids)):
        top = sorted(lp.top_logprobs[i].values(), reverse=True)[:3]
        np.testing.assert_allclose(top, np.sort(ref[i - 1])[::-1][:3], atol=1e-4)
    assert lp.tokens[:len(ids)] == [srv.tok.decode([t]) for t in ids]
    assert out.choices[0].text.startswith(TEXTS[0]) and len(lp.tokens) == len(ids) + 1
    assert lp.text_offset[len(ids)] == len(TEXTS[0]) and lp.text_offset[:2] == [0, len(lp.tokens[0])]
    # scoring only (max_tokens 0: vLLM's echo-scoring request), the same numbers
    only = srv.clients[mode].completions.create(model="tiny", prompt=ids, echo=True, logprobs=0, max_tokens=0)
    assert only.choices[0].logprobs.token_logprobs == lp.token_logprobs[:len(ids)]
    assert only.usage.completion_tokens == 0 and only.choices[0].finish_reason == "length"


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.8, top_p=0.9, seed=3)])
def test_generated_logprobs_equal_plain_decodings(srv, sampling):
    kw = dict(prompt=TEXTS[1], max_tokens=12, logprobs=4, extra_body={"ignore_eos": True}, **sampling)
    plain = srv.plain(**kw).choices[0]
    ids = _ids(srv, TEXTS[1]) + plain.model_extra["token_ids"]
    if not sampling.get("temperature"):  # greedy log-probs are the target's own (temperature 1)
        ref = srv.logprobs(ids)
        n = len(ids) - 12
        np.testing.assert_allclose(plain.logprobs.token_logprobs, [ref[n + k - 1, ids[n + k]] for k in range(12)],
                                   atol=1e-4)
    for mode in MODES[1:]:
        got = srv.clients[mode].completions.create(model="tiny", **kw).choices[0]
        assert got.text == plain.text, mode
        np.testing.assert_allclose(got.logprobs.token_logprobs, plain.logprobs.token_logprobs, atol=1e-4)
        assert [sorted(t) for t in got.logprobs.top_logprobs] == [sorted(t) for t in plain.logprobs.top_logprobs]
        chat = srv.clients[mode].chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": TEXTS[1]}], max_tokens=6, logprobs=True,
            top_logprobs=2, temperature=0).choices[0]
        assert len(chat.logprobs.content) >= 1 and all(len(c.top_logprobs) == 2 for c in chat.logprobs.content)
    # auto tried every geometry of its menu on these requests, and each kept the log-probs exact
    assert set(srv.svcs["auto"].scheduler.decoder.decisions()) == {"plain", "sync/4", "async/4x2"}


def test_streamed_logprobs_and_usage_equal_non_streamed(srv):
    kw = dict(model="tiny", prompt=TEXTS[2], max_tokens=10, logprobs=2, temperature=0, echo=True,
              extra_body={"ignore_eos": True})
    for mode in MODES:
        full = srv.clients[mode].completions.create(**kw)
        chunks = list(srv.clients[mode].completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        assert [c.usage for c in chunks[:-1]] == [None] * (len(chunks) - 1) and chunks[-1].choices == []
        assert chunks[-1].usage == full.usage
        assert "".join(c.choices[0].text for c in chunks[:-1]) == full.choices[0].text, mode
        streamed = [x for c in chunks[:-1] if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
        if mode == "auto":  # auto picks each round's geometry from measured costs, so the two requests
            # may decode the same tokens in rounds of other geometries, whose forwards round differently
            # in the last bits
            assert streamed[0] is None and full.choices[0].logprobs.token_logprobs[0] is None
            np.testing.assert_allclose(streamed[1:], full.choices[0].logprobs.token_logprobs[1:], rtol=0,
                                       atol=1e-5, err_msg=mode)
        else:  # a fixed geometry computes both requests alike: bitwise equal
            assert streamed == full.choices[0].logprobs.token_logprobs, mode
        offsets = [x for c in chunks[:-1] if c.choices[0].logprobs for x in c.choices[0].logprobs.text_offset]
        assert offsets == full.choices[0].logprobs.text_offset


@pytest.mark.parametrize("mode", MODES)
def test_n_and_batched_prompts_equal_single_requests_with_derived_seeds(srv, mode):
    client = srv.clients[mode]
    kw = dict(model="tiny", max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    solo = {}

    def one(text, seed):
        if (text, seed) not in solo:
            solo[text, seed] = client.completions.create(prompt=text, seed=seed, **kw).choices[0].text
        return solo[text, seed]

    batch = client.completions.create(prompt=TEXTS, n=3, seed=11, **kw)
    assert [c.index for c in batch.choices] == list(range(12))
    assert [c.text for c in batch.choices] == [one(TEXTS[k // 3], 11 + k) for k in range(12)]
    assert len({c.text for c in batch.choices[:3]}) > 1  # the choices really sampled apart
    assert batch.usage.prompt_tokens == sum(len(_ids(srv, t)) for t in TEXTS)  # each prompt once
    assert batch.usage.completion_tokens == 12 * 8
    ids = [_ids(srv, t) for t in TEXTS[:2]]
    by_ids = client.completions.create(prompt=ids, seed=11, **kw)  # a list of token-id lists
    assert [c.text for c in by_ids.choices] == [one(TEXTS[0], 11), one(TEXTS[1], 12)]
    stream = list(client.completions.create(prompt=TEXTS[:2], n=2, seed=11, stream=True, **kw))
    texts = ["".join(c.choices[0].text for c in stream if c.choices and c.choices[0].index == i) for i in range(4)]
    assert texts == [one(TEXTS[k // 2], 11 + k) for k in range(4)]


# --------------------------------------------------------------------------------------------
# Penalties: plain decoding against a brute-force loop; sync and async against plain
# --------------------------------------------------------------------------------------------
def _brute_greedy(srv, prompt, n, f):
    """Plain greedy decoding by the formulas (vLLM's order: logit bias, min_tokens, repetition,
    frequency, presence), one full forward per token."""
    seq, out = list(prompt), []
    for _ in range(n):
        x = srv.logits(seq)[-1]
        for t, b in (f.get("logit_bias") or {}).items():
            x[int(t)] += b
        if len(out) < f.get("min_tokens", 0):
            x[[2] + f.get("stop_token_ids", [])] = -np.inf
        rp = f.get("repetition_penalty", 1.0)
        seen = sorted(set(seq))
        x[seen] = np.where(x[seen] > 0, x[seen] / rp, x[seen] * rp)
        counts = np.bincount(out, minlength=len(x)) if out else np.zeros(len(x))
        x -= f.get("frequency_penalty", 0.0) * counts + f.get("presence_penalty", 0.0) * (counts > 0)
        t = int(np.argmax(x))
        seq.append(t)
        out.append(t)
        if t == 2 or t in f.get("stop_token_ids", []):
            break
    return out


PENALTIES = [dict(presence_penalty=1.5), dict(frequency_penalty=1.0), dict(repetition_penalty=1.8),
             dict(frequency_penalty=-0.4, presence_penalty=0.7), dict(logit_bias=None)]


@pytest.mark.parametrize("fields", PENALTIES + [dict(min_tokens=10)], ids=lambda f: ",".join(f))
def test_each_penalty_field_greedy_equals_plain_and_the_formula(srv, fields):
    prompt = _ids(srv, TEXTS[3])
    body = dict(fields, ignore_eos="min_tokens" not in fields)
    free = srv.plain(prompt=prompt, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    free = free.choices[0].model_extra["token_ids"]
    if "min_tokens" in fields:  # min_tokens needs a stop token the model would emit early
        body["stop_token_ids"] = [free[2]]
    if "logit_bias" in fields:  # forbid the unbiased second token, favour the fifth one
        body["logit_bias"] = {str(free[1]): -100.0, str(free[4]): 3.0}
        fields = {"logit_bias": body["logit_bias"]}
    extra = {k: v for k, v in body.items() if k not in ("presence_penalty", "frequency_penalty", "logit_bias")}
    std = {k: v for k, v in body.items() if k in ("presence_penalty", "frequency_penalty", "logit_bias")}
    kw = dict(prompt=prompt, max_tokens=20, temperature=0, extra_body=extra, **std)
    plain = srv.plain(**dict(kw)).choices[0].model_extra["token_ids"]
    ref = _brute_greedy(srv, prompt, 20, {**fields, **({"stop_token_ids": body["stop_token_ids"]}
                                                       if "stop_token_ids" in body else {})})
    assert plain == ref
    assert plain != free  # the field changed the output
    for mode in MODES[1:]:
        got = srv.clients[mode].completions.create(model="tiny", **dict(kw, extra_body=dict(extra, return_token_ids=True)))
        assert got.choices[0].model_extra["token_ids"] == plain, mode
        # drafts accepted inside blocks, so later positions counted them: in the fixed speculative
        # modes every round drafts; auto may rightly give this request plain rounds (its pooled
        # prior), and its output is checked above
        if mode in ("sync", "async"):
            assert got.model_extra["spec_metrics"]["accepted_tokens"] > 0, mode


def test_sampled_penalties_and_min_p_equal_plain(srv):
    """Point-mass drafts: sampling is keyed by position, so sync/async equal plain token for token."""
    kw = dict(prompt=TEXTS[0], max_tokens=16, temperature=1.0, seed=4, presence_penalty=1.0,
              extra_body={"min_p": 0.05, "repetition_penalty": 1.3, "ignore_eos": True, "return_token_ids": True})
    plain = srv.plain(**kw).choices[0].model_extra["token_ids"]
    for mode in MODES[1:]:
        assert srv.clients[mode].completions.create(model="tiny", **kw).choices[0].model_extra["token_ids"] == plain


def test_sampled_drafts_with_a_penalty_keep_the_target_law():
    """χ² test: sync decoding with drafts sampled from a drafter's q and a frequency penalty gives
    the second token the law plain decoding gives it (the first token's penalty applies inside
    the block, where the second position is verified)."""
    from scipy import stats

    from d3d_jax.bench.generator import Generator
    from d3d_jax.config import ModelConfig
    from d3d_jax.decoding.verify import SamplingParams
    from d3d_jax.model.qwen3 import init_model

    vocab = 12
    t = _randomized(init_model(ModelConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_layers=1,
                                           num_heads=2, num_kv_heads=1, head_dim=8), 0), 0, 0.8)
    d = _randomized(init_model(ModelConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_layers=1,
                                           num_heads=2, num_kv_heads=1, head_dim=8, mask_token_id=vocab - 1), 1), 1, 0.5)
    sampling = SamplingParams(1.0, frequency_penalty=2.0)
    generate = Generator()  # one decoder per mode and sampling-independent shape
    n = 1000
    prompts = [[1, 4, 2]] * n
    kw = dict(sampling=sampling, max_new_tokens=2, max_cache_len=16, block_size=3, seed=0)
    plain = [o.token_ids for o in generate(t, prompts, mode="plain", **kw)]
    sync = [o.token_ids for o in generate(t, prompts, mode="sync", drafter=d, sample_drafts=True,
                                          **dict(kw, seed=1))]
    table = np.array([np.bincount([o[1] for o in plain], minlength=vocab),
                      np.bincount([o[1] for o in sync], minlength=vocab)])
    table = table[:, table.sum(0) > 0]
    assert stats.chi2_contingency(table).pvalue > 1e-3
    # the penalty is really in force: a repeated token is rarer than without it
    free = [o.token_ids for o in generate(t, prompts, mode="plain", **dict(kw, sampling=SamplingParams(1.0)))]
    assert sum(o[0] == o[1] for o in plain) < 0.7 * sum(o[0] == o[1] for o in free)


# --------------------------------------------------------------------------------------------
def test_every_schema_field_is_served_or_refused_by_name(srv):
    """Walks the installed openai package's request TypedDicts: each field either works with a
    non-default value or gets a 400 naming it."""
    import typing

    from openai.types import completion_create_params as cp
    from openai.types.chat import completion_create_params as ccp

    from d3d_jax.serving import protocol as P

    samples = {"n": 2, "logprobs": 2, "echo": True, "best_of": 3, "suffix": "x", "presence_penalty": 0.5,
               "frequency_penalty": 0.5, "logit_bias": {"5": 1}, "seed": 1, "stop": "zz", "temperature": 0.5,
               "top_p": 0.5, "user": "u", "max_tokens": 3, "stream_options": {"include_usage": True},
               "max_completion_tokens": 3, "top_logprobs": 2, "audio": {"voice": "alloy", "format": "wav"},
               "function_call": "auto", "functions": [{"name": "f"}], "metadata": {"a": "b"},
               "modalities": ["text", "audio"], "moderation": {"x": 1}, "parallel_tool_calls": True,
               "prediction": {"type": "content", "content": "x"}, "prompt_cache_key": "k",
               "prompt_cache_options": {"mode": "implicit"}, "prompt_cache_retention": "24h",
               "reasoning_effort": "low", "response_format": {"type": "json_object"}, "safety_identifier": "s",
               "service_tier": "flex", "store": True, "tool_choice": "auto",
               "tools": [{"type": "function", "function": {"name": "f"}}], "verbosity": "low",
               "web_search_options": {}}
    client = srv.clients["plain"]
    for route, cls, base in (("completion", cp.CompletionCreateParamsBase, {"prompt": "hi"}),
                             ("chat", ccp.CompletionCreateParamsBase, {"messages": [{"role": "user", "content": "hi"}]})):
        fields = set(typing.get_type_hints(cls)) | {"stream"}
        assert fields <= set(P.FIELDS[route]), fields - set(P.FIELDS[route])  # each one has a rule
        for name in sorted(fields - {"model", "prompt", "messages", "stream"}):
            body = dict(base, model="tiny", max_tokens=3, temperature=0)
            body[name] = samples[name]
            if name == "stream_options":
                body["stream"] = True
            if name == "top_logprobs":
                body["logprobs"] = True
            if name == "logprobs" and route == "chat":
                body["logprobs"] = True
            create = client.chat.completions.create if route == "chat" else client.completions.create
            rule = P.FIELDS[route][name]
            if rule is P.SERVED or samples[name] in rule:
                out = create(**body)
                assert list(out) if body.get("stream") else out.choices, (route, name)
            else:
                with pytest.raises(openai.BadRequestError) as e:
                    create(**body)
                assert e.value.body["param"] == name and name in e.value.body["message"], (route, name)


# --------------------------------------------------------------------------------------------
# Structured output: a grammar masks every verified position, so outputs obey it in every mode
# and speculative ones equal plain's token for token (greedy, and sampled by the same keys)
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "count": {"type": "integer", "minimum": 1, "maximum": 20},
                                           "name": {"type": "string", "maxLength": 8}},
          "required": ["color", "count", "name"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1,
                                                                                   "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}


def _constrained_chat(srv, mode, text, **kw):
    """A chat completion in ``mode``; plain's output becomes the replay drafters' continuation,
    so the speculative modes' drafts are mostly right and the masks of later slots are used."""
    body = dict(model="tiny", messages=[{"role": "user", "content": text}], max_tokens=48, **kw)
    srv.built.clear()
    out = srv.clients[mode].chat.completions.create(**body, extra_body={"return_token_ids": True})
    if mode == "plain":
        for key in srv.built:
            for d in srv.drafters:
                d.continuations[srv.index[key]] = list(out.choices[0].model_extra["token_ids"])
    return out


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.9, seed=11)])
def test_json_schema_output_is_valid_and_speculation_equals_plain(srv, sampling):
    import json

    jsonschema = pytest.importorskip("jsonschema")
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    for text in TEXTS[:3]:
        outs = {}
        for mode in ("plain", "sync", "auto"):
            out = _constrained_chat(srv, mode, text, response_format=fmt, **sampling)
            content = out.choices[0].message.content
            jsonschema.validate(json.loads(content), SCHEMA)
            outs[mode] = content
        assert outs["sync"] == outs["plain"] == outs["auto"], outs
    with pytest.raises(openai.BadRequestError) as e:
        srv.clients["async"].chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                     response_format=fmt)
    assert e.value.body["param"] == "response_format" and "async" in e.value.body["message"]


@pytest.mark.parametrize("mode", ["plain", "sync", "auto"])
def test_a_named_tool_choice_calls_it_with_valid_arguments(srv, mode):
    import json

    jsonschema = pytest.importorskip("jsonschema")
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for stream in (False, True):
        body = dict(model="tiny", messages=[{"role": "user", "content": "Weather?"}], max_tokens=40,
                    temperature=0, tools=[WEATHER], tool_choice=choice)
        if stream:
            chunks = list(srv.clients[mode].chat.completions.create(stream=True, **body))
            calls = [c for ch in chunks for x in ch.choices for c in (x.delta.tool_calls or [])]
            reason = [x.finish_reason for ch in chunks for x in ch.choices if x.finish_reason][-1]
        else:
            out = srv.clients[mode].chat.completions.create(**body)
            calls, reason = out.choices[0].message.tool_calls, out.choices[0].finish_reason
        assert reason == "tool_calls" and len(calls) == 1 and calls[0].function.name == "get_weather"
        jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])


def test_the_openai_clients_parse_and_tool_loop(srv):
    from typing import Literal

    import pydantic

    class Thing(pydantic.BaseModel):  # bounded, so a random model cannot write digits forever
        color: Literal["red", "green", "blue"]
        count: int = pydantic.Field(ge=1, le=20)

    client = srv.clients["sync"]
    parsed = client.beta.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "a thing"}],
                                                response_format=Thing, max_tokens=40, temperature=0)
    assert isinstance(parsed.choices[0].message.parsed, Thing)
    tool = openai.pydantic_function_tool(Thing, name="make_thing")
    first = client.beta.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "make one"}],
                                               tools=[tool], tool_choice="required", parallel_tool_calls=False,
                                               max_tokens=60, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "make_thing" and isinstance(call.function.parsed_arguments, Thing)
    # the loop as OpenAI's guide writes it: the assistant's message object goes back as it came
    asked = [{"role": "user", "content": "make one"}]
    first = client.chat.completions.create(model="tiny", messages=asked, tools=[tool], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=60, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    Thing.model_validate_json(call.function.arguments)
    back = asked + [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "made"}]
    final = client.chat.completions.create(model="tiny", messages=back, tools=[tool], max_tokens=8, temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
