"""Chat as vLLM serves Qwen3, through the real app and the ``openai`` client over the toy decoder
(tests/serve_fake.py): ``chat_template_kwargs`` and the server's default, the thought in
``reasoning_content``, and tool calls (offered, called, answered), streamed and not.

The toy decoder's output is scripted here: its next-token function is replaced by one that
writes a fixed text after the prompt, so a response's fields can be checked against the text."""

from __future__ import annotations

import json

import pytest

import serve_fake
from serve_fake import FakeServer, TOKENIZER

openai = pytest.importorskip("openai")
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "today's weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


@pytest.fixture(scope="module")
def server():
    from d3d_jax.io.hf import load_tokenizer

    s = FakeServer(load_tokenizer(TOKENIZER)[0], mode="sync")
    yield s
    s.close()


@pytest.fixture
def script(server, monkeypatch):
    """``script(text)``: every request's output is ``text`` then EOS."""
    def set_text(text: str):
        ids = server.tok.encode(text, add_special_tokens=False) + [serve_fake.EOS]
        starts: dict = {}

        def next_token(prev, pos, temperature, seed, vocab):
            start = starts.setdefault("prompt", pos)  # the first call is at the prompt's end
            return ids[min(pos - start, len(ids) - 1)]
        monkeypatch.setattr(serve_fake, "next_token", next_token)
        return starts
    return set_text


def chat(server, stream: bool, **kw):
    """(message fields, finish_reason): a whole response's, or the stream's deltas joined."""
    body = dict(model="toy", messages=MSGS, max_tokens=60, temperature=0, **kw)
    if not stream:
        out = server.client.chat.completions.create(**body)
        return out.choices[0].message.model_dump(), out.choices[0].finish_reason
    fields, calls, reason = {"content": "", "reasoning_content": ""}, [], None
    for ch in server.client.chat.completions.create(stream=True, **body):
        for c in ch.choices:
            d = c.delta.model_dump()
            for k in fields:
                fields[k] += d.get(k) or ""
            calls += d.get("tool_calls") or []
            reason = c.finish_reason or reason
    return dict(fields, tool_calls=calls or None), reason


def test_enable_thinking_shapes_the_prompt_and_the_thought_goes_in_reasoning_content(server, script):
    def prompt(kwargs):
        status, out = server.raw("POST", "/tokenize", {"messages": MSGS, "chat_template_kwargs": kwargs})
        assert status == 200, out
        return server.tok.decode(out["tokens"])
    on, off, default = prompt({"enable_thinking": True}), prompt({"enable_thinking": False}), prompt({})
    assert off == on + "<think>\n\n</think>\n\n" and default == off  # the server's default: thinking off
    for stream in (False, True):
        script("<think>\nthe user wants weather\n</think>\n\nSunny.")
        msg, reason = chat(server, stream, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        assert (msg["reasoning_content"], msg["content"], reason) == ("\nthe user wants weather\n", "\n\nSunny.",
                                                                       "stop"), stream
        script("<think>\nthe user wants weather\n</think>\n\nSunny.")
        msg, _ = chat(server, stream)  # the prompt ended the thought: everything is content (the
        # demo tokenizer's think tags are special tokens, skipped like every other one there)
        assert msg["content"] == "\nthe user wants weather\n\n\nSunny." and not msg.get("reasoning_content"), stream


def test_chat_template_kwargs_the_template_does_not_read_are_refused_by_name(server):
    for kwargs, word in (({"enable_thinkin": True}, "enable_thinkin"), ({"add_generation_prompt": False},
                                                                         "add_generation_prompt")):
        for path, body in (("/v1/chat/completions", {"model": "toy", "messages": MSGS}), ("/tokenize", {"messages": MSGS})):
            status, out = server.raw("POST", path, dict(body, chat_template_kwargs=kwargs))
            assert status == 400 and out["error"]["param"] == "chat_template_kwargs", out
            assert word in out["error"]["message"]
    status, out = server.raw("POST", "/v1/chat/completions",
                             {"model": "toy", "messages": MSGS, "tools": TOOLS, "tool_choice": {
                                 "type": "function", "function": {"name": "other"}}})
    assert status == 400 and out["error"]["param"] == "tool_choice" and "not in 'tools'" in out["error"]["message"]


def test_tool_calls_are_parsed_streamed_and_not_and_the_answer_goes_back(server, script):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for stream in (False, True):
        script("Let me look." + call)
        msg, reason = chat(server, stream, tools=TOOLS)
        assert reason == "tool_calls" and msg["content"] == "Let me look.", (stream, msg)
        (c,) = msg["tool_calls"]
        assert c["type"] == "function" and c["id"].startswith("chatcmpl-tool-")
        assert c["function"]["name"] == "get_weather" and json.loads(c["function"]["arguments"]) == {"city": "Paris"}
        script("Let me look." + call)  # tool_choice "none": the text stays as it is
        msg, reason = chat(server, stream, tools=TOOLS, tool_choice="none")
        assert msg["content"] == "Let me look." + call and not msg["tool_calls"] and reason == "stop"
    # the tool-calling loop: the call and its result go back, and the template renders them
    script("It is sunny.")
    back = MSGS + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": c["id"], "type": "function", "function": c["function"]}]},
        {"role": "tool", "tool_call_id": c["id"], "content": "sunny, 21 C"}]
    out = server.client.chat.completions.create(model="toy", messages=back, tools=TOOLS, max_tokens=20, temperature=0)
    assert out.choices[0].message.content == "It is sunny." and out.choices[0].finish_reason == "stop"
    status, tok = server.raw("POST", "/tokenize", {"messages": back})
    assert "<|im_start|>tool\nsunny, 21 C<|im_end|>" in server.tok.decode(tok["tokens"])
