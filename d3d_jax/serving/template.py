"""The chat template's variables a request may set: vLLM's ``chat_template_kwargs`` over the
server's ``--default-chat-template-kwargs``.

A request may set any variable the template reads (Qwen3's ``enable_thinking`` …), found in the
template's source by Jinja's own parser.  A name the template never reads would change nothing,
and a name the server sets itself (``messages``, ``tools``, ``add_generation_prompt`` …) is not
the request's to set: both are refused by name rather than ignored.  The server's default is
``{"enable_thinking": false}``: the drafters are trained on non-thinking responses, and in
thinking mode they lose most of their acceptance.
"""

from __future__ import annotations

from d3d_jax.serving import protocol as P

# set by the server from the request's own fields, or by transformers for every template
RESERVED = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "tokenize",
    "chat_template", "return_dict", "return_tensors", "return_assistant_tokens_mask", "padding",
    "truncation", "max_length", "tokenizer_kwargs", "raise_exception", "strftime_now"})


def template_source(tokenizer) -> str:
    source = tokenizer.chat_template
    if isinstance(source, dict):  # named templates: the default one renders chats
        source = source.get("default") or next(iter(source.values()), "")
    return source or ""


def template_variables(tokenizer) -> frozenset[str]:
    """The names the chat template reads that a request may set."""
    import jinja2
    from jinja2 import meta

    source = template_source(tokenizer)
    if not source:
        return frozenset()
    names = meta.find_undeclared_variables(jinja2.Environment().parse(source))
    return frozenset(names - RESERVED)


class TemplateKwargs:
    """The variables of one server's template and its default values for them."""

    def __init__(self, tokenizer, default: dict):
        self.variables = template_variables(tokenizer)
        self.default = {k: v for k, v in default.items() if k in self.variables}

    def resolve(self, asked: dict | None) -> dict:
        """The request's values over the default, or one 400 naming a variable it may not set."""
        for key in asked or {}:
            if key in RESERVED:
                raise P.ApiError(f"'chat_template_kwargs' may not set {key!r}: the server sets it from the "
                                 f"request", param="chat_template_kwargs")
            if key not in self.variables:
                known = ", ".join(sorted(self.variables)) or "none"
                raise P.ApiError(f"'chat_template_kwargs' sets {key[:64]!r}, which this server's chat template "
                                 f"does not read (it reads: {known})", param="chat_template_kwargs")
        return {**self.default, **(asked or {})}
