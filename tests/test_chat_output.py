"""The chat output's split into reasoning, content and tool calls (serving/reasoning.py,
serving/tools.py, serving/chat_output.py) and the template variables a request may set
(serving/template.py).

References: vLLM's rules written out in the plainest form (partition of the whole text at the
tags, ``json.loads`` of each tag's body), against the incremental parsers fed in every chunking.
One difference from vLLM's whole-response hermes parser, which a stream cannot follow: a tag
whose body is no call stays content by itself instead of turning every call back into text."""

from __future__ import annotations

import json
import random

import pytest

from d3d_jax.serving.chat_output import ChatOutput
from d3d_jax.serving.reasoning import Qwen3Reasoning, prompt_ends_reasoning

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}</tool_call>'
OUTPUTS = [
    "<think>\nfirst I plan\n</think>\n\nThe answer.",
    "no think block at all",
    "a thought the template opened</think>then content",
    "<think>cut short, never closed",
    "<think>x</think>" + "Sure." + CALL,
    "<think>I will call <tool_call>{}</tool_call> maybe</think>" + CALL + "\n" + CALL.replace("Paris", "Rome"),
    "<think></think>" + '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # not an object: content
    "<think>t</think>" + '<tool_call>{"name": "f", "arguments": {"a": 1}}',  # unclosed at the end
    "</thin",
]


def reference(text: str, in_reasoning: bool, tools: bool):
    """(reasoning or None, content, [(name, arguments)]) by vLLM's non-streaming rules."""
    reasoning = None
    if in_reasoning:
        before, _, after = text.partition("</think>")
        if _:
            reasoning, text = before.replace("<think>", "", 1), after
        else:
            reasoning, text = text.replace("<think>", "", 1), ""
    calls = []
    if tools and "<tool_call>" in text:
        head, _, rest = text.partition("<tool_call>")
        text = head
        for part in rest.split("<tool_call>"):
            body, closed, _ = part.partition("</tool_call>")
            try:
                obj = json.loads(body)
            except ValueError:
                obj = None
            if isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("arguments"), dict):
                calls.append((obj["name"], obj["arguments"]))
            elif closed or part is rest.split("<tool_call>")[-1]:
                text += "<tool_call>" + body + closed  # a body that is no call stays content, tags and all
    return reasoning, text, calls


def run(chunks, in_reasoning: bool, tools: bool):
    out = ChatOutput(Qwen3Reasoning(in_reasoning), tools)
    deltas = [out.push(c) for c in chunks] + [out.push("", final=True)]
    streamed = ("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas),
                [c for d in deltas for c in d.tool_calls])
    return out, streamed


@pytest.mark.parametrize("in_reasoning", [True, False])
@pytest.mark.parametrize("tools", [True, False])
def test_any_chunking_gives_the_whole_texts_split(in_reasoning, tools):
    rng = random.Random(0)
    for text in OUTPUTS:
        want_r, want_c, want_calls = reference(text, in_reasoning, tools)
        for trial in range(30):
            cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 8)))) if trial else []
            chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
            out, (r, c, calls) = run(chunks, in_reasoning, tools)
            assert r == (want_r or ""), (text, chunks)
            assert c == want_c, (text, chunks, c)
            got = [(x["function"]["name"], json.loads(x["function"]["arguments"])) for x in calls]
            assert got == want_calls, (text, chunks)
            assert [x["index"] for x in calls] == list(range(len(calls)))
            msg = out.message()
            assert msg.get("reasoning_content") == (want_r or None if in_reasoning else None)
            assert [(x["function"]["name"], json.loads(x["function"]["arguments"]))
                    for x in msg.get("tool_calls", [])] == want_calls
            assert out.finish_reason("eos") == ("tool_calls" if want_calls else "eos")
            assert out.finish_reason("length") == "length"


def test_the_prompt_decides_whether_the_output_starts_in_a_thought():
    assert prompt_ends_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_ends_reasoning("<|im_start|>assistant\n")
    assert not prompt_ends_reasoning("old</think> turn ... <|im_start|>assistant\n<think>\n")


def test_template_variables_are_read_from_the_template(tmp_path):
    import copy

    from d3d_jax.io.chat import chat_prompt_ids
    from d3d_jax.io.hf import load_tokenizer
    from d3d_jax.serving import protocol as P
    from d3d_jax.serving.template import TemplateKwargs
    from serve_fake import TOKENIZER

    tok = load_tokenizer(TOKENIZER)[0]
    kw = TemplateKwargs(tok, {"enable_thinking": False, "not_read": 1})
    assert kw.variables == {"enable_thinking"} and kw.default == {"enable_thinking": False}
    assert kw.resolve({"enable_thinking": True}) == {"enable_thinking": True}
    for bad in ({"tools": []}, {"add_generation_prompt": False}, {"reasoning_effort": "low"}):
        with pytest.raises(P.ApiError) as e:
            kw.resolve(bad)
        assert e.value.param == "chat_template_kwargs" and next(iter(bad)) in str(e.value)
    tooled = copy.deepcopy(tok)  # a template that lists the tools, as Qwen3's does
    tooled.chat_template = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{{ messages[0].content }}{{ x }}"
    assert TemplateKwargs(tooled, {}).variables == {"x"}
    ids = chat_prompt_ids(tooled, [{"role": "user", "content": "hi"}],
                          tools=[{"type": "function", "function": {"name": "f"}}], x="!")
    assert tok.decode(ids) == "[f]hi!"
