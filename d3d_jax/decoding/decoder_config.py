"""What a :class:`~d3d_jax.decoding.decoder.SpecDecoder` is built from and answers with: its
config (declared once, in :mod:`d3d_jax.config.decoding`, as every command reads it), a request,
one round's output per slot, and the errors that name bad input."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

# the decoder's fields, checks and defaults are written once, in the config every command reads
from d3d_jax.config.decoding import (DecoderConfig, decoder_config, prompt_bucket,  # noqa: F401
                                     prompt_buckets, row_buckets)
from d3d_jax.config.limits import MAX_STOP_IDS
from d3d_jax.decoding.verify import SamplingParams


class RequestError(ValueError):
    """A request the decoder cannot serve; the message names the problem."""


class SlotError(ValueError):
    """A slot that cannot take this operation (out of range, or busy on insert)."""


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request.  Randomness is keyed by ``(seed, index, position)`` only, so the
    tokens do not depend on the slot or on the other requests in the batch.  ``index`` also
    picks a replay drafter's continuation (tests, benchmarks)."""

    prompt: Sequence[int]
    max_new_tokens: int = 128
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: Sequence[int] = ()  # finish reason "stop"
    seed: int = 0
    index: int = 0
    eos_token_ids: Sequence[int] | None = None  # None: the decoder config's
    warmup: bool = False  # a server's start-up request: auto learns no acceptance from it
    grammar: Any = None  # a grammar.Matcher: the output is constrained to it (structured output)


def prompt_problem(prompt, vocab: int, name: str = "prompt") -> str | None:
    """What is wrong with a prompt (``None`` if nothing): one message naming it."""
    if isinstance(prompt, (str, bytes)):
        return f"{name} is a string; pass token ids (tokenize first)"
    if not isinstance(prompt, Sequence) and not hasattr(prompt, "__len__"):
        return f"{name} must be a list of token ids"
    if len(prompt) == 0:
        return f"{name} is empty: a prompt needs at least one token"
    bad = [int(t) for t in prompt if not 0 <= int(t) < vocab]
    if bad:
        return f"{name} has token id {bad[0]} outside the vocabulary [0, {vocab})"
    return None


def request_problem(req: Request, cfg: DecoderConfig, vocab: int) -> str | None:
    """The first problem of ``req`` for a decoder with ``cfg`` (``None`` if it can be served)."""
    if not isinstance(req, Request):
        return f"expected a Request, got {type(req).__name__}"
    msg = prompt_problem(req.prompt, vocab)
    if msg:
        return msg
    if int(req.max_new_tokens) < 1:
        return f"max_new_tokens must be >= 1, got {req.max_new_tokens}"
    if req.grammar is not None and cfg.mode == "async":  # decoding/constrained.py: no async path
        return "structured output (a grammar) is not served in async mode"
    need = len(req.prompt) + int(req.max_new_tokens) + cfg.block_size
    if need > cfg.max_cache_len:
        return (f"prompt ({len(req.prompt)}) + max_new_tokens ({req.max_new_tokens}) + block_size "
                f"({cfg.block_size}) = {need} exceeds max_cache_len {cfg.max_cache_len}")
    if not isinstance(req.sampling, SamplingParams):
        return "sampling must be a SamplingParams"
    try:
        req.sampling.validate()
    except ValueError as e:
        return str(e)
    problem = req.sampling.vocab_problem(vocab)
    if problem:
        return problem
    eos = cfg.eos_token_ids if req.eos_token_ids is None else tuple(req.eos_token_ids)
    for name, ids in (("eos_token_ids", eos), ("stop_token_ids", req.stop_token_ids)):
        bad = [t for t in ids if not 0 <= int(t) < vocab]
        if bad:
            return f"{name} has id {bad[0]} outside the vocabulary [0, {vocab})"
    if len(eos) + len(req.stop_token_ids) > MAX_STOP_IDS:
        return f"at most {MAX_STOP_IDS} eos + stop token ids, got {len(eos) + len(req.stop_token_ids)}"
    if not 0 <= int(req.seed) < 2 ** 31 or not 0 <= int(req.index) < 2 ** 31:
        return f"seed and index must be in [0, 2**31), got {req.seed} and {req.index}"
    return None


@dataclasses.dataclass
class StepOutput:
    """One slot's outcome of one round."""

    token_ids: list[int]  # committed this round, already cut at EOS/stop/max_new_tokens
    finished: bool
    finish_reason: str | None  # "eos" | "stop" | "length" once finished
    accepted: int  # drafts accepted this round
    hit: bool | None = None  # async: a branch anticipated the outcome
    # per token, when the request asked (sampling.logprobs = n >= 0): (log-prob, [(id, log-prob)
    # of the n most likely tokens]) under the request's processed target distribution
    logprobs: list | None = None
