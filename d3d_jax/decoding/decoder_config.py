"""What a :class:`~d3d_jax.decoding.decoder.SpecDecoder` is built from and answers with: its
config, a request, one round's output per slot, and the errors that name bad input."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from d3d_jax.config import ConfigError
from d3d_jax.decoding import branches as br
from d3d_jax.decoding.core import MAX_STOP_IDS
from d3d_jax.decoding.verify import SamplingParams

MODES = ("plain", "sync", "async")
DEFAULT_BRANCH_POSITIONS = 12  # C (spec §5: the paper's optimum with F = 2)
DEFAULT_BRANCH_FANOUT = 2  # F


class RequestError(ValueError):
    """A request the decoder cannot serve; the message names the problem."""


class SlotError(ValueError):
    """A slot that cannot take this operation (out of range, or busy on insert)."""


def _devices(value):
    return tuple(value) if isinstance(value, (list, tuple)) else value


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Static description of a decoder: changing any field builds (and compiles) another one."""

    mode: str = "sync"  # "plain" | "sync" | "async"
    num_slots: int = 8  # fixed number of rows; requests join and leave between rounds
    max_cache_len: int = 1024  # KV slots per row: prompt + max_new_tokens + block_size must fit
    block_size: int = 16  # B: tokens verified per round (plain decoding verifies 1)
    branch_positions: int = DEFAULT_BRANCH_POSITIONS  # async: C, rejection slots 1..C-1 branch
    branch_fanout: int = DEFAULT_BRANCH_FANOUT  # async: F alternatives per rejection slot
    eos_token_ids: tuple[int, ...] = ()  # finish reason "eos"; a request may override them
    target_devices: Any = None  # async: device list or count (None: both share one device)
    drafter_devices: Any = None  # async: device list or count, disjoint from the target's
    # benchmark only: an object with accept(...) (and hit(...) for async) applied after the real
    # rule; None costs nothing.  See d3d_jax.bench.simulate.
    acceptance_override: Any = None
    sample_drafts: bool = False  # sync: sample drafts from q (sampling rows) instead of argmax
    acceptance_rule: Callable | None = None  # experiments: replaces verify.default_rule

    def __post_init__(self):
        # device lists become tuples so the config stays hashable
        object.__setattr__(self, "target_devices", _devices(self.target_devices))
        object.__setattr__(self, "drafter_devices", _devices(self.drafter_devices))
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))

    @property
    def width(self) -> int:
        """Tokens fed to the target per round."""
        return 1 if self.mode == "plain" else self.block_size

    @property
    def layout(self) -> br.BranchLayout:
        return br.BranchLayout(self.block_size, self.branch_positions, self.branch_fanout)

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"decoder.mode: must be one of {'|'.join(MODES)}, got {self.mode!r}")
        if int(self.num_slots) < 1:
            raise ConfigError(f"decoder.num_slots: must be >= 1, got {self.num_slots}")
        if self.mode != "plain" and int(self.block_size) < 2:
            raise ConfigError(f"decoder.block_size: must be >= 2, got {self.block_size}")
        if self.mode == "async":
            self.layout.validate(prefix="decoder")
        if int(self.max_cache_len) < self.width + 1:
            raise ConfigError(f"decoder.max_cache_len: {self.max_cache_len} leaves no room for a "
                              f"prompt and a block of {self.width}")
        if len(self.eos_token_ids) > MAX_STOP_IDS or any(int(t) < 0 for t in self.eos_token_ids):
            raise ConfigError(f"decoder.eos_token_ids: at most {MAX_STOP_IDS} ids >= 0, got "
                              f"{self.eos_token_ids}")
        for key in ("target_devices", "drafter_devices"):
            if getattr(self, key) is not None and self.mode != "async":
                raise ConfigError(f"decoder.{key}: device slices are for mode async only")
        if self.sample_drafts and self.mode == "async":
            raise ConfigError("decoder.sample_drafts: mode async drafts the drafter's argmax "
                              "(point masses); sample_drafts is not supported")
        self._validate_override()
        try:
            hash(self)
        except TypeError as e:
            raise ConfigError(f"decoder: every field must be hashable ({e})") from None

    def _validate_override(self) -> None:
        o = self.acceptance_override
        if o is None:
            return
        # Simulated acceptance changes outputs: it exists for benchmarks only, which declare it.
        if getattr(o, "benchmark_only", False) is not True:
            raise ConfigError(f"decoder.acceptance_override: {type(o).__name__} is not marked "
                              f"benchmark_only; simulated acceptance is for benchmarks only "
                              f"(infer/bench.py --simulate-tau, d3d_jax.bench.simulate)")
        needed = ("accept", "hit") if self.mode == "async" else ("accept",)
        missing = [m for m in needed if not callable(getattr(o, m, None))]
        if missing:
            raise ConfigError(f"decoder.acceptance_override: {type(o).__name__} has no method "
                              f"{missing[0]}(...)")
        if self.mode == "plain":
            raise ConfigError("decoder.acceptance_override: plain decoding has no drafts to accept")


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
