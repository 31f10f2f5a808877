"""What a :class:`~d3d_jax.decoding.decoder.SpecDecoder` is built from and answers with: its
config, a request, one round's output per slot, and the errors that name bad input."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from d3d_jax.config import ConfigError
# the decoder's fields, checks and defaults are written once, in the settings every command reads
from d3d_jax.config.decoding import DEFAULT_CACHE_LEN, DEFAULT_NUM_SLOTS, DecoderSettings
from d3d_jax.decoding import branches as br
from d3d_jax.decoding.core import MAX_STOP_IDS
from d3d_jax.decoding.verify import SamplingParams

MIN_PROMPT_BUCKET = 16
# Each bucket is an admission program of its own, compiled when a prompt first needs it.
# Growing by 4 would halve them but pad a 32-token prompt to 64 (its prefill 6.5 ms, not 4.8),
# paid by every request, while a compile is paid once per machine (the compile cache).  So by 2.
PROMPT_BUCKET_GROWTH = 2


def prompt_buckets(cap: int) -> tuple[int, ...]:
    """The one rule for prompt-length buckets: 16, 32, 64 … (powers of two), the last ``cap``."""
    out, n = [], MIN_PROMPT_BUCKET
    while n < cap:
        out.append(n)
        n *= PROMPT_BUCKET_GROWTH
    return tuple(out) + (int(cap),)


def prompt_bucket(n: int, cap: int) -> int:
    """The bucket a prompt of ``n`` tokens is padded to (``cap`` at most)."""
    return next(b for b in prompt_buckets(cap) if b >= min(max(int(n), 1), cap))


def row_buckets(num_slots: int, given: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Window widths a round runs over: ``given`` (default powers of two), always ``num_slots``."""
    base = given or tuple(1 << k for k in range(max(int(num_slots) - 1, 0).bit_length()))
    return tuple(sorted({int(b) for b in base if 1 <= int(b) < num_slots} | {int(num_slots)}))


class RequestError(ValueError):
    """A request the decoder cannot serve; the message names the problem."""


class SlotError(ValueError):
    """A slot that cannot take this operation (out of range, or busy on insert)."""


def _devices(value):
    return tuple(value) if isinstance(value, (list, tuple)) else value


@dataclasses.dataclass(frozen=True)
class DecoderConfig(DecoderSettings):
    """Static description of a decoder: changing any field builds (and compiles) another one.

    The person's fields, their checks and their derived defaults are :class:`DecoderSettings`'
    (a field left None is derived as every command derives it: mode auto, B = 16, C = min(12, B),
    ...); this adds what only a program passes."""

    eos_token_ids: tuple[int, ...] = ()  # finish reason "eos"; a request may override them
    # benchmark only: an object with accept(...) (and hit(...) for async) applied after the real
    # rule; None costs nothing.  See d3d_jax.bench.simulate.
    acceptance_override: Any = None
    acceptance_rule: Callable | None = None  # experiments: replaces verify.default_rule
    # > 0: the target's KV cache is paged, pages of this many tokens (plain mode so far); a
    # request holds the pages its prompt and max_new_tokens need, not a whole max_cache_len row
    kv_page_size: int = 0
    kv_pages: int = 0  # the paged pool's pages; 0: as many as num_slots whole rows would take
    # a paged cache: full pages are shared by content, so a prompt prefix another request computed
    # (a system prompt, a chat's earlier turns) is not prefilled again (vLLM's name)
    enable_prefix_caching: bool = True
    # a paged cache: prompt tokens prefilled between two rounds, in chunks of at most this many
    # (vLLM's name), so a long prompt holds running streams up for one chunk, not its whole prefill
    max_num_batched_tokens: int = 512

    def __post_init__(self):
        fields = self.derived(has_drafter=self.mode != "plain", num_slots=DEFAULT_NUM_SLOTS,
                              max_cache_len=DEFAULT_CACHE_LEN)
        # device lists and the rest become tuples so the config stays hashable
        fields.update(target_devices=_devices(self.target_devices), drafter_devices=_devices(self.drafter_devices),
                      eos_token_ids=tuple(self.eos_token_ids), row_buckets=tuple(int(b) for b in self.row_buckets))
        for key, value in fields.items():
            object.__setattr__(self, key, value)
        self.validate()  # a DecoderConfig is valid once built: nothing downstream checks it again

    @property
    def width(self) -> int:
        """Tokens fed to the target per round."""
        return 1 if self.mode == "plain" else self.block_size

    @property
    def layout(self) -> br.BranchLayout:
        """Async's branch pack (mode async only: the others leave C and F underived)."""
        return br.BranchLayout(self.block_size, self.branch_positions, self.branch_fanout)

    @property
    def kv_max_pages(self) -> int:
        """Pages one row's table holds (0: the cache is dense)."""
        return -(-int(self.max_cache_len) // self.kv_page_size) if self.kv_page_size else 0

    @property
    def kv_num_pages(self) -> int:
        return int(self.kv_pages) or int(self.num_slots) * self.kv_max_pages

    @property
    def buckets(self) -> tuple[int, ...]:
        """Window widths (rows) of a round, smallest first."""
        return row_buckets(self.num_slots, self.row_buckets)

    @property
    def prompt_buckets(self) -> tuple[int, ...]:
        return prompt_buckets(self.max_cache_len)

    @property
    def chunk_widths(self) -> tuple[int, ...]:
        """A paged cache's prefill chunk widths (the same rule as prompt buckets, capped at
        ``max_num_batched_tokens``): a fixed set, whatever the prompt lengths."""
        return prompt_buckets(min(int(self.max_num_batched_tokens), int(self.max_cache_len)))

    def validate(self) -> None:
        super().validate("decoder")
        if self.mode == "async":
            self.layout.validate(prefix="decoder")
        if self.mode == "auto":
            self._validate_auto()
        if any(not 1 <= b <= int(self.num_slots) for b in self.row_buckets):
            raise ConfigError(f"decoder.row_buckets: widths must be in [1, num_slots "
                              f"{self.num_slots}], got {self.row_buckets}")
        if int(self.max_cache_len) < self.width + 1:
            raise ConfigError(f"decoder.max_cache_len: {self.max_cache_len} leaves no room for a "
                              f"prompt and a block of {self.width}")
        if len(self.eos_token_ids) > MAX_STOP_IDS or any(int(t) < 0 for t in self.eos_token_ids):
            raise ConfigError(f"decoder.eos_token_ids: at most {MAX_STOP_IDS} ids >= 0, got "
                              f"{self.eos_token_ids}")
        self._validate_override()
        self._validate_pages()
        try:
            hash(self)
        except TypeError as e:
            raise ConfigError(f"decoder: every field must be hashable ({e})") from None

    def _validate_pages(self) -> None:
        if int(self.kv_page_size) < 0 or int(self.kv_pages) < 0:
            raise ConfigError(f"decoder.kv_page_size and decoder.kv_pages: must be >= 0, got "
                              f"{self.kv_page_size} and {self.kv_pages}")
        if int(self.max_num_batched_tokens) < 1:
            raise ConfigError(f"decoder.max_num_batched_tokens: must be >= 1, got "
                              f"{self.max_num_batched_tokens}")
        if self.kv_page_size and self.mode != "plain":
            raise ConfigError(f"decoder.kv_page_size: a paged cache serves mode plain only so far, "
                              f"not {self.mode}")
        if self.kv_page_size and self.kv_num_pages < self.kv_max_pages:
            raise ConfigError(f"decoder.kv_pages: {self.kv_pages} pages cannot hold one request of "
                              f"max_cache_len {self.max_cache_len} ({self.kv_max_pages} pages)")

    def _validate_auto(self) -> None:
        b = int(self.block_size)
        if not self.auto_sync_blocks or any(not 2 <= x <= b for x in self.auto_sync_blocks):
            raise ConfigError(f"decoder.auto_sync_blocks: each in [2, block_size {b}], got "
                              f"{self.auto_sync_blocks}")
        for c, f in self.auto_async:
            br.BranchLayout(b, c, f).validate(prefix="decoder.auto_async")
        if self.prior_tau is not None and not 1.0 <= float(self.prior_tau) <= max(b, 16):
            raise ConfigError(f"decoder.prior_tau: must be in [1, {max(b, 16)}] (τ of a block of "
                              f"max(16, block_size) tokens), got {self.prior_tau}")

    def _validate_override(self) -> None:
        o = self.acceptance_override
        if o is None:
            return
        # Simulated acceptance changes outputs: it exists for benchmarks only, which declare it.
        if getattr(o, "benchmark_only", False) is not True:
            raise ConfigError(f"decoder.acceptance_override: {type(o).__name__} is not marked "
                              f"benchmark_only; simulated acceptance is for benchmarks only "
                              f"(infer/bench.py --simulate-tau, d3d_jax.bench.simulate)")
        needed = ("accept", "hit") if self.mode in ("async", "auto") else ("accept",)
        missing = [m for m in needed if not callable(getattr(o, m, None))]
        if missing:
            raise ConfigError(f"decoder.acceptance_override: {type(o).__name__} has no method "
                              f"{missing[0]}(...)")
        if self.mode == "plain":
            raise ConfigError("decoder.acceptance_override: plain decoding has no drafts to accept")


def decoder_config(mode: str, **fields) -> DecoderConfig:
    """A :class:`DecoderConfig` from command-line style options (a field given as None is derived)."""
    return DecoderConfig(mode=mode, **fields)


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
