"""Structured output: a grammar as a token mask at every position a round decides.

The grammar engine is llguidance (vLLM's ``guidance`` backend): it compiles JSON schemas,
regular expressions and Lark grammars against the tokenizer's vocabulary, answers "which tokens
may come next" as a bitmask, and rolls back.  Measured on this project's CPU with the demo's
byte-level BPE (2,048 tokens), both maintained engines were correct; xgrammar's mask was faster
(12 µs against 64–91 µs a position) but it requires torch and triton, which a JAX server should
not carry, while llguidance depends on nothing (docs/serving.md, "Structured output").

Lossless under speculation: a round feeds ``[anchor, d_1 … d_{W-1}]`` and slot ``k`` decides
the token after ``d_1 … d_k``.  Slot ``k`` is only ever reached with those drafts accepted, so
its mask is the grammar's after them: :func:`block_bitmask` advances the matcher along the
drafts, takes the mask at every slot, and rolls back.  The target's token at each slot is then
drawn from the same masked distribution plain decoding draws it from (by the same position
keys), so greedy outputs are identical and sampled ones equal in distribution (point-mass
drafts: token for token).  A draft the grammar forbids is rejected by the target's masked
choice; the slots after it are unreachable and left unmasked.

The drafter's proposals are masked too, on the host along the same walk: each slot's draft
becomes the first token of the drafter's own top-K that the grammar allows there
(:meth:`Matcher.block`), so a block of JSON punctuation and keys is accepted whole instead of
rejected at its first refused draft.  Any draft the target's randomness does not see keeps the
output law (the target decides every slot), so this changes acceptance, never the outputs.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

WORD = 32  # tokens per int32 of a bitmask
# JSON laid out as json.dumps does, with no other whitespace: a model that would rather write
# spaces cannot spend its whole budget on them between two tokens (a schema's "x-guidance" wins)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def words(vocab: int) -> int:
    return (vocab + WORD - 1) // WORD


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to: ``kind`` one of ``json_schema`` (``value`` a
    schema dict), ``json_object`` (any JSON object), ``regex`` or ``choice`` (a list of strings)."""

    kind: str
    value: Any = None

    def grammar(self) -> str:
        """llguidance's grammar text for the spec."""
        import llguidance

        M = llguidance.LLMatcher
        if self.kind == "json_schema":
            return M.grammar_from_json_schema(self.value, defaults=JSON_LAYOUT)
        if self.kind == "json_object":
            return M.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
        if self.kind == "regex":
            return M.grammar_from_regex(self.value)
        if self.kind == "choice":
            return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.value))
        raise ValueError(f"unknown grammar kind {self.kind!r}")


class Vocabulary:
    """The tokenizer as the engine sees it, built once per server (it reads every token)."""

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance.hf

        self.size = vocab_size
        self.ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    def check(self, spec: GrammarSpec) -> str | None:
        """The grammar's problem in one line, None when it compiles."""
        import llguidance

        try:
            failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(spec.grammar(), self.ll)
        except Exception as e:  # noqa: BLE001 - the engine's own words name the problem
            return str(e).splitlines()[0][:300]
        return str(messages[0] if messages else "invalid grammar").splitlines()[0][:300] if failed else None

    def matcher(self, spec: GrammarSpec) -> "Matcher":
        return Matcher(self, spec)


class Matcher:
    """One request's position in its grammar, advanced by the tokens it commits."""

    def __init__(self, vocab: Vocabulary, spec: GrammarSpec):
        import llguidance

        self.vocab = vocab
        self.ll = llguidance.LLMatcher(vocab.ll, spec.grammar())
        if self.ll.is_error():
            raise ValueError(self.ll.get_error())

    def mask_into(self, out: np.ndarray) -> None:
        """The tokens allowed next, as bits of ``out [words]`` (int32)."""
        import llguidance.numpy as lnp

        lnp.fill_next_token_bitmask(self.ll, out.reshape(1, -1), 0)

    def advance(self, tokens) -> bool:
        """Commit ``tokens``; False if the grammar refuses one (the rest are not consumed)."""
        tokens = [int(t) for t in tokens]
        return not tokens or (not self.ll.is_stopped() and self.ll.try_consume_tokens(tokens) == len(tokens))

    def block_bitmask(self, drafts, width: int) -> np.ndarray:
        """``[width, words]``: slot 0's mask now, slot k's after ``drafts[:k]`` (matcher rolled
        back after); slots past a draft the grammar refuses allow everything (never reached)."""
        return self.block(drafts, width)[1]

    def block(self, drafts, width: int, candidates=None, first=None) -> tuple[np.ndarray, np.ndarray]:
        """(drafts, ``[width, words]`` masks) as :meth:`block_bitmask`; with ``candidates
        [width-1, K]`` (the drafter's own ranking) each draft is first replaced by
        :func:`allowed_choice` under its slot's mask, so the walk goes on where a raw draft
        would have been refused and rejected.  ``first``: slot 0's mask, built beforehand
        (it depends on no draft, so it is built while the drafter runs)."""
        drafts = np.array(drafts, np.int32)
        out = np.full((width, words(self.vocab.size)), -1, np.int32)
        consumed = 0
        for k in range(width):
            # try_: a refused draft leaves the matcher as it was (consume_token would stop it)
            if k and (self.ll.is_stopped() or self.ll.try_consume_tokens([int(drafts[k - 1])]) != 1):
                break
            consumed += bool(k)
            if k == 0 and first is not None:
                out[0] = first
            else:
                self.mask_into(out[k])
            if candidates is not None and k < width - 1:
                drafts[k] = allowed_choice(out[k], candidates[k], drafts[k])
        if consumed:
            self.ll.rollback(consumed)
        return drafts, out


def allowed_choice(bits: np.ndarray, candidates, fallback: int) -> int:
    """The first of ``candidates`` that ``bits [words]`` allows; else the lowest allowed token
    (a forced token, in a schema's punctuation and keys); ``fallback`` when nothing is."""
    c = np.asarray(candidates, np.int64)
    ok = (bits[c // WORD].astype(np.int64) >> (c % WORD)) & 1
    if ok.any():
        return int(c[np.argmax(ok)])
    nz = np.flatnonzero(bits)
    if not nz.size:
        return int(fallback)
    word = int(bits[nz[0]]) & 0xFFFFFFFF
    return int(nz[0]) * WORD + ((word & -word).bit_length() - 1)


def unpack(bitmask, vocab: int):
    """``[..., words]`` int32 bits -> ``[..., vocab]`` bool (on the device: jnp in, jnp out)."""
    import jax.numpy as jnp

    ids = jnp.arange(vocab, dtype=jnp.int32)
    word = jnp.take(bitmask, ids // WORD, axis=-1)
    return ((word >> (ids % WORD)) & 1).astype(bool)
