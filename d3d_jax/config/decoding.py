"""The decoder's config: the ``decoder:`` section every command that decodes reads, and what a
:class:`~d3d_jax.decoding.decoder.SpecDecoder` is built from — one class for both.

``infer/serve.py``, ``infer/generate.py`` and ``infer/bench.py eval`` take its fields from YAML
(``configs/serve/*.yaml``), ``key=value`` overrides and their flags (``--mode`` is ``decoder.mode``,
``--block-size`` is ``decoder.block_size`` …); a library user builds one in Python.  A field left
``None`` is derived by :meth:`DecoderConfig.resolved`, the one place the derived defaults are
written (a command passes its own slot count and cache length; a decoder resolves what it is given
with the library's), and the rule tying a mode to a drafter is :func:`check_drafter`.  The
fields only a program sets (EOS ids, benchmark hooks) are refused in YAML and flags.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable

from d3d_jax.config.base import DTYPES, TEXT, ConfigError, _require, above, between, checked, one_of
from d3d_jax.config.model import ATTENTION_CHOICES
from d3d_jax.config.limits import MAX_BLOCK_SIZE, MAX_CACHE_LEN, MAX_SLOTS, MAX_STOP_IDS, require_int

MODES = ("plain", "sync", "async", "auto")
DEFAULT_BLOCK_SIZE = 16  # B when neither the settings nor the drafter's config give one (the paper's)
DEFAULT_BRANCH_POSITIONS = 12  # C (spec §5: the paper's optimum with F = 2), capped at B
DEFAULT_BRANCH_FANOUT = 2  # F
MAX_BRANCH_FANOUT = 64
MAX_DEVICES = 1 << 16
DEFAULT_NUM_SLOTS = 8  # rows of a decoder built without a command's own number (a library user's)
DEFAULT_CACHE_LEN = 1024  # KV slots per row of such a decoder
AUTO_SYNC_BLOCKS = (4, 8, 16)  # auto: sync block sizes b (<= block_size; the drafter trains at 16)
AUTO_ASYNC_GEOMETRIES = ((4, 2), (12, 2))  # auto: async (C, F) menu
ASYNC_ONLY = ("branch_positions", "branch_fanout")
AUTO_ONLY = ("auto_sync_blocks", "auto_async", "prior_tau")
# Modes whose decoder keeps its KV caches in pages: the one place a command's paging default
# (the server's) is gated, so a mode that learns paging is added here and nowhere else.
PAGED_MODES = ("plain", "sync", "auto")
DEFAULT_KV_PAGE_SIZE = 16  # tokens per page where a command pages by default (vLLM's block size)
# on a GPU/TPU: a page is the fused decode kernel's key tile (bfloat16 on an H200: 64 rows), so
# paged decoding compiles to the dense kernel's tiles, PTX and bytes
ACCELERATOR_KV_PAGE_SIZE = 64
MAX_KV_CACHE_TOKENS = 1 << 40
# set by programs only (EOS ids from the tokenizer, benchmark objects): refused in YAML and flags
PROGRAM_ONLY = ("eos_token_ids", "acceptance_override", "acceptance_rule", "prompt_widths")
MIN_PROMPT_BUCKET = 16
# Each bucket is an admission program of its own, compiled when a prompt first needs it.
# Growing by 4 would halve them but pad a 32-token prompt to 64 (its prefill 6.5 ms, not 4.8),
# paid by every request, while a compile is paid once per machine (the compile cache).  So by 2.
PROMPT_BUCKET_GROWTH = 2
# Largest branch pack: 10× the paper's 384-token B=16, C=12, F=2 pack, far past where more
# branches still pay for their drafter compute.
MAX_ASYNC_BUDGET = 4096


@dataclasses.dataclass(frozen=True)
class BranchLayout:
    """Static shape of the branch pack: block size ``B``, branch positions ``C``, fan-out ``F``."""

    block_size: int = 16
    positions: int = 12  # C: rejection slots r = 1 … C-1 get branches
    fanout: int = 2  # F: alternatives per rejection slot

    # built from a DecoderConfig's B, C, F (checked there), never read from YAML
    BOUNDS = dict(block_size=between(2, MAX_BLOCK_SIZE), positions=between(1, MAX_BLOCK_SIZE),
                  fanout=between(1, MAX_BRANCH_FANOUT))

    def validate(self, prefix: str = "async") -> None:
        b, c, f = self.block_size, self.positions, self.fanout
        if b < 3:
            raise ConfigError(f"{prefix}.block_size: must be >= 3 for asynchronous drafting, got {b}")
        if not 1 <= c <= b:
            raise ConfigError(f"{prefix}.branch_positions: C must satisfy 1 <= C <= block size {b}, "
                              f"got C={c}")
        if f < 1:
            raise ConfigError(f"{prefix}.branch_fanout: F must be >= 1, got F={f}")
        if self.budget > MAX_ASYNC_BUDGET:  # one drafter forward per round over the whole pack
            raise ConfigError(f"{prefix}.branch_fanout/branch_positions: the branch pack would be N_async = "
                              f"B·((C-1)·F + 2) = {b}·(({c}-1)·{f} + 2) = {self.budget} tokens, more than "
                              f"the maximum {MAX_ASYNC_BUDGET}; lower F or C")

    @property
    def num_correction(self) -> int:
        return (self.positions - 1) * self.fanout

    @property
    def num_branches(self) -> int:
        """Correction branches plus the all-accept branch (which is the last)."""
        return self.num_correction + 1

    @property
    def all_accept_index(self) -> int:
        return self.num_correction

    @property
    def budget(self) -> int:
        """``N_async = B·((C-1)·F + 2)``: shared prefix plus every branch."""
        return self.block_size * (self.num_branches + 1)

    def describe(self) -> str:
        return (f"async branch pack: B={self.block_size} C={self.positions} F={self.fanout} -> "
                f"{self.num_branches} branches, N_async = {self.budget} tokens")


def prompt_buckets(cap: int) -> tuple[int, ...]:
    """The one rule for prompt-length buckets: 16, 32, 64 … (powers of two), the last ``cap``."""
    out, n = [], MIN_PROMPT_BUCKET
    while n < cap:
        out.append(n)
        n *= PROMPT_BUCKET_GROWTH
    return tuple(out) + (int(cap),)


def prompt_bucket(n: int, cap: int, buckets: tuple[int, ...] = ()) -> int:
    """The bucket a prompt of ``n`` tokens is padded to (``cap`` at most): the first of
    ``buckets`` (ascending, ending at ``cap``; default :func:`prompt_buckets`) that holds it."""
    return next(b for b in (buckets or prompt_buckets(cap)) if b >= min(max(int(n), 1), cap))


def row_buckets(num_slots: int, given: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Window widths a round runs over: ``given`` (default powers of two), always ``num_slots``."""
    base = given or tuple(1 << k for k in range(max(int(num_slots) - 1, 0).bit_length()))
    return tuple(sorted({int(b) for b in base if 1 <= int(b) < num_slots} | {int(num_slots)}))


def check_drafter(mode: str, has_drafter: bool, key: str = "decoder.mode") -> None:
    """The one rule tying a mode to a drafter: every mode but plain drafts, plain takes none."""
    _require(mode == "plain" or has_drafter, key,
             f"{mode} needs --drafter (models.drafter): every mode but plain needs a drafter")
    _require(mode != "plain" or not has_drafter, key, "plain takes no drafter: --drafter given with --mode plain")


@dataclasses.dataclass(frozen=True)
class ModelPaths:
    """The checkpoints a decoding command loads (the ``models:`` section)."""

    target: str | None = None  # HF Qwen3 directory or d3d_jax parameter checkpoint (required)
    drafter: str | None = None  # drafter checkpoint (every mode but plain)
    tokenizer: str | None = None  # tokenizer directory; None: the target's, else the drafter's
    dtype: str | None = None  # parameter/compute dtype of both models; None: each checkpoint's
    # attention backend of both models: auto (the fused kernels on GPU and TPU, xla on a CPU),
    # xla or pallas (d3d_jax.config.model.decoding_attention)
    attention: str = "auto"

    # each field's valid values, checked by config.base.check_fields for every loader
    BOUNDS = dict(target=TEXT, drafter=TEXT, tokenizer=TEXT, dtype=one_of(*DTYPES),
                  attention=one_of(*ATTENTION_CHOICES))

    def validate(self, prefix: str = "models") -> None:
        _require(self.target is not None, f"{prefix}.target", "is required (--target PATH)")
        _require(self.dtype is None or self.dtype in DTYPES, f"{prefix}.dtype",
                 f"must be one of {'|'.join(DTYPES)}, got {self.dtype!r}")
        _require(self.attention in ATTENTION_CHOICES, f"{prefix}.attention",
                 f"must be one of {'|'.join(ATTENTION_CHOICES)}, got {self.attention!r}")


def check_section(decoder: "DecoderConfig", has_drafter: bool | None) -> None:
    """A command's ``decoder:`` section: no field only programs set, and (``has_drafter`` given)
    the mode fits the drafter.  Slots and cache length stay the command's to derive."""
    for key in PROGRAM_ONLY:
        _require(getattr(decoder, key) in (None, ()), f"decoder.{key}",
                 "is set by the program, not from YAML or a flag")
    decoder.validate()
    if has_drafter is not None:
        decoder.resolved(has_drafter=has_drafter, num_slots=None, max_cache_len=None)


def _given(value, default):
    return default if value is None else value


def _int(value) -> int:
    """``value`` if an int, else 0: deriving never raises, so :meth:`DecoderConfig.validate` names a bad B."""
    return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else 0


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """A decoder, as a person (or a program) describes it.  ``None``: derived (see each field and
    :meth:`resolved`); changing a field builds (and compiles) another decoder."""

    # plain | sync | async | auto (auto picks one of the others per round); None: auto with a
    # drafter, plain without
    mode: str | None = None
    # B, tokens verified per round; None: the drafter's trained block size, else 16
    block_size: int | None = None
    # rows decoded together; None: the command's (server 8, generate: its batch, eval: its
    # concurrency; a library decoder 8)
    num_slots: int | None = None
    # KV slots per row (prompt + max_new_tokens + B must fit); None: the command's (server:
    # min(2048, max_position_embeddings); generate and eval: what their prompts need; a library
    # decoder 1024)
    max_cache_len: int | None = None
    branch_positions: int | None = None  # async C: rejection slots 1..C-1 branch; None: min(12, B)
    branch_fanout: int | None = None  # async F: alternatives per rejection slot; None: 2
    # devices of the target's slice, tensor-parallel over them (None: one device); every mode
    target_devices: int | None = None
    # devices of the drafter's own slice after the target's (async overlaps the two there; the
    # other modes run the drafter inside the target's programs, on the target's slice); None:
    # the target's slice (parallel.sharding.resolve_slices)
    drafter_devices: int | None = None
    sample_drafts: bool = False  # sync: sample drafts from q (sampling rows) instead of argmax
    # window widths (rows) a round may run over; () = powers of two up to num_slots
    row_buckets: tuple[int, ...] = ()
    # auto's menu: sync block sizes b and async (C, F); None: the decoder's defaults that fit B
    auto_sync_blocks: tuple[int, ...] | None = None
    auto_async: tuple[tuple[int, int], ...] | None = None
    # auto: the drafter's offline τ, the prior of every request's acceptance; None: read from
    # the drafter's result.json
    prior_tau: float | None = None
    # tokens per KV page; 0: dense caches (a whole max_cache_len row per slot); None: the
    # command's (the server pages in PAGED_MODES, other commands keep dense caches).  Paged, the
    # drafter's pool has the same pages as the target's and a request holds the pages it fills
    kv_page_size: int | None = None
    # the paged pool's size in tokens; None: from free device memory x memory_utilization on an
    # accelerator, num_slots x max_cache_len on a CPU (decoding.settings.kv_pool_pages)
    kv_cache_tokens: int | None = None
    memory_utilization: float = 0.9  # share of an accelerator's memory the weights and pool may take
    enable_prefix_caching: bool = True  # full pages are shared by content (prefix reuse)
    kv_pages: int = 0  # the pool's pages; 0: kv_cache_tokens', else num_slots whole rows
    # a paged cache: tokens one step feeds (vLLM's name): the next round's rows x width, the rest
    # prefill chunks, so a long prompt holds running streams up for one chunk, not its whole prefill
    max_num_batched_tokens: int = 256
    # The program's own (PROGRAM_ONLY: refused in a command's section).  Finish reason "eos" (a
    # request may override them; the server and generate take them from the tokenizer)
    eos_token_ids: tuple[int, ...] = ()
    # The program's own: the prompt widths admission pads to (one program each), for a caller
    # that knows its prompts (data regeneration); () = prompt_buckets' powers of two
    prompt_widths: tuple[int, ...] = ()
    # benchmarks: an object with accept(...) (and hit(...) for async) applied after the real
    # rule; None costs nothing.  See d3d_jax.bench.simulate.
    acceptance_override: Any = None
    acceptance_rule: Callable | None = None  # experiments: replaces verify.default_rule

    # each field's valid values, checked by config.base.check_fields for every loader
    BOUNDS = dict(mode=one_of(*MODES), block_size=between(2, MAX_BLOCK_SIZE), num_slots=between(1, MAX_SLOTS),
                  max_cache_len=between(2, MAX_CACHE_LEN), branch_positions=between(1, MAX_BLOCK_SIZE),
                  branch_fanout=between(1, MAX_BRANCH_FANOUT), target_devices=between(1, MAX_DEVICES),
                  drafter_devices=between(1, MAX_DEVICES), row_buckets=between(1, MAX_SLOTS),
                  auto_sync_blocks=between(1, MAX_BLOCK_SIZE), auto_async=between(1, MAX_BLOCK_SIZE),
                  prior_tau=between(1, MAX_BLOCK_SIZE), kv_page_size=between(0, MAX_CACHE_LEN),
                  kv_cache_tokens=between(1, MAX_KV_CACHE_TOKENS), memory_utilization=above(0, 1),
                  kv_pages=between(0, MAX_CACHE_LEN), max_num_batched_tokens=between(1, MAX_CACHE_LEN),
                  eos_token_ids=between(0, 2 ** 31 - 1), prompt_widths=between(1, MAX_CACHE_LEN),
                  acceptance_override=checked("DecoderConfig.validate (programs only)"),
                  acceptance_rule=checked("DecoderConfig.validate (programs only)"))
    _RANGES = (("block_size", 2, MAX_BLOCK_SIZE), ("num_slots", 1, MAX_SLOTS), ("max_cache_len", 2, MAX_CACHE_LEN),
               ("branch_positions", 1, MAX_BLOCK_SIZE), ("branch_fanout", 1, MAX_BRANCH_FANOUT),
               ("target_devices", 1, MAX_DEVICES), ("drafter_devices", 1, MAX_DEVICES),
               ("kv_page_size", 0, MAX_CACHE_LEN), ("kv_cache_tokens", 1, MAX_KV_CACHE_TOKENS))

    def __post_init__(self):
        # device lists and the other sequences become tuples so the config stays hashable
        for key in ("target_devices", "drafter_devices"):
            value = getattr(self, key)
            if isinstance(value, list):
                object.__setattr__(self, key, tuple(value))
        for key in ("eos_token_ids", "row_buckets", "prompt_widths"):
            if isinstance(getattr(self, key), list):
                object.__setattr__(self, key, tuple(getattr(self, key)))
        self.validate()  # as far as its fields are given: a whole one, everything a decoder relies on

    @property
    def is_resolved(self) -> bool:
        """Every field a decoder reads is derived (:meth:`resolved`)."""
        mode_fields = {"async": ("branch_positions", "branch_fanout"), "auto": ("auto_sync_blocks", "auto_async")}
        needed = ("mode", "block_size", "num_slots", "max_cache_len", "kv_page_size") + mode_fields.get(self.mode, ())
        return all(getattr(self, key) is not None for key in needed)

    def validate(self, prefix: str = "decoder") -> None:
        """The fields as given, and once resolved, everything a decoder relies on."""
        _require(self.mode is None or self.mode in MODES, f"{prefix}.mode",
                 f"must be one of {'|'.join(MODES)}, got {self.mode!r}")
        for key, lo, hi in self._RANGES:
            value = getattr(self, key)
            if value is not None and not (key.endswith("_devices") and isinstance(value, tuple)):  # a program's device list
                require_int(value, f"{prefix}.{key}", lo, hi)
        if self.block_size is not None and self.branch_positions is not None:
            _require(self.branch_positions <= self.block_size, f"{prefix}.branch_positions",
                     f"C = {self.branch_positions} exceeds block_size {self.block_size}")
        for only, keys in (("async", ASYNC_ONLY), ("auto", AUTO_ONLY)):
            if self.mode is not None and self.mode != only:
                for key in keys:
                    _require(getattr(self, key) is None, f"{prefix}.{key}",
                             f"is for mode {only} only: it needs --mode {only} (mode is {self.mode})")
        _require(not (self.sample_drafts and self.mode in ("plain", "async", "auto")), f"{prefix}.sample_drafts",
                 f"is for mode sync only: async and auto draft the drafter's argmax (mode is {self.mode})")
        _require(all(b >= 1 for b in self.row_buckets), f"{prefix}.row_buckets",
                 f"widths must be >= 1, got {self.row_buckets}")
        _require(isinstance(self.memory_utilization, numbers.Real) and 0 < self.memory_utilization <= 1,
                 f"{prefix}.memory_utilization", f"must be in (0, 1], got {self.memory_utilization!r}")
        _require(len(self.eos_token_ids) <= MAX_STOP_IDS and all(int(t) >= 0 for t in self.eos_token_ids),
                 f"{prefix}.eos_token_ids", f"at most {MAX_STOP_IDS} ids >= 0, got {self.eos_token_ids}")
        self._validate_override(prefix)
        if self.is_resolved:
            self._validate_resolved(prefix)

    def _validate_resolved(self, prefix: str) -> None:
        if self.mode == "async":
            self.layout.validate(prefix=prefix)
        if self.mode == "auto":
            self._validate_auto(prefix)
        _require(all(1 <= b <= int(self.num_slots) for b in self.row_buckets), f"{prefix}.row_buckets",
                 f"widths must be in [1, num_slots {self.num_slots}], got {self.row_buckets}")
        _require(all(1 <= int(w) <= int(self.max_cache_len) for w in self.prompt_widths), f"{prefix}.prompt_widths",
                 f"widths must be in [1, max_cache_len {self.max_cache_len}], got {self.prompt_widths}")
        _require(int(self.max_cache_len) >= self.width + 1, f"{prefix}.max_cache_len",
                 f"{self.max_cache_len} leaves no room for a prompt and a block of {self.width}")
        self._validate_pages(prefix)
        try:
            hash(self)
        except TypeError as e:
            raise ConfigError(f"{prefix}: every field must be hashable ({e})") from None

    def _validate_pages(self, prefix: str) -> None:
        _require(int(self.kv_page_size or 0) >= 0 and int(self.kv_pages) >= 0,
                 f"{prefix}.kv_page_size and {prefix}.kv_pages", f"must be >= 0, got {self.kv_page_size} and {self.kv_pages}")
        _require(int(self.max_num_batched_tokens) >= 1, f"{prefix}.max_num_batched_tokens",
                 f"must be >= 1, got {self.max_num_batched_tokens}")
        _require(not self.kv_page_size or self.mode != "async", f"{prefix}.kv_page_size",  # its drafter side
                 "a paged cache serves modes plain, sync and auto, not async")  # cannot tell a done row
        key = "kv_cache_tokens" if not self.kv_pages and self.kv_cache_tokens else "kv_pages"
        _require(not self.kv_page_size or self.kv_num_pages >= self.kv_max_pages, f"{prefix}.{key}",
                 f"a pool of {self.kv_num_pages} pages of {self.kv_page_size} tokens cannot hold one request of "
                 f"max_cache_len (--max-model-len) {self.max_cache_len} ({self.kv_max_pages} pages); give "
                 f"--kv-cache-tokens >= {self.kv_max_pages * (self.kv_page_size or 0)} or a lower --max-model-len")

    def _validate_auto(self, prefix: str) -> None:
        b = int(self.block_size)
        _require(bool(self.auto_sync_blocks) and all(2 <= x <= b for x in self.auto_sync_blocks),
                 f"{prefix}.auto_sync_blocks", f"each in [2, block_size {b}], got {self.auto_sync_blocks}")
        for c, f in self.auto_async:
            BranchLayout(b, c, f).validate(prefix=f"{prefix}.auto_async")
        _require(self.prior_tau is None or 1.0 <= float(self.prior_tau) <= max(b, 16), f"{prefix}.prior_tau",
                 f"must be in [1, {max(b, 16)}] (τ of a block of max(16, block_size) tokens), got {self.prior_tau}")

    def _validate_override(self, prefix: str) -> None:
        _require(self.acceptance_rule is None or callable(self.acceptance_rule), f"{prefix}.acceptance_rule",
                 f"is set by the program (a callable), not from YAML or a flag; got {type(self.acceptance_rule).__name__}")
        o = self.acceptance_override
        if o is None:
            return
        # Simulated acceptance changes outputs: it exists for benchmarks only, which declare it.
        _require(getattr(o, "benchmark_only", False) is True, f"{prefix}.acceptance_override",
                 f"is set by the program: {type(o).__name__} is not marked benchmark_only; simulated acceptance "
                 f"is for benchmarks only (infer/bench.py --simulate-tau, d3d_jax.bench.simulate)")
        needed = ("accept", "hit") if self.mode in ("async", "auto") else ("accept",)
        missing = [m for m in needed if not callable(getattr(o, m, None))]
        _require(not missing, f"{prefix}.acceptance_override", f"{type(o).__name__} has no method "
                 f"{missing[0] if missing else ''}(...)")
        _require(self.mode != "plain", f"{prefix}.acceptance_override", "plain decoding has no drafts to accept")

    def derived(self, *, has_drafter: bool, drafter_block_size: int | None = None,
                num_slots: int | None = None, max_cache_len: int | None = None, kv_page_size: int = 0) -> dict:
        """The fields this config leaves to be derived, filled in: the one place the derived
        defaults are written (``prior_tau`` excepted: it is read from the drafter's files,
        :func:`~d3d_jax.decoding.settings.decoder_config_for`).  Fields another mode reads stay None.

        ``num_slots`` / ``max_cache_len``: the command's own value where the config gives none;
        ``kv_page_size``: the command's page size in :data:`PAGED_MODES` (0: dense)."""
        mode = _given(self.mode, "auto" if has_drafter else "plain")
        b = _given(self.block_size, _given(drafter_block_size, DEFAULT_BLOCK_SIZE))
        out = dict(mode=mode, block_size=b, num_slots=_given(self.num_slots, num_slots),
                   max_cache_len=_given(self.max_cache_len, max_cache_len),
                   kv_page_size=_given(self.kv_page_size, kv_page_size if mode in PAGED_MODES else 0))
        if mode == "async":
            out.update(branch_positions=_given(self.branch_positions, min(DEFAULT_BRANCH_POSITIONS, _int(b))),
                       branch_fanout=_given(self.branch_fanout, DEFAULT_BRANCH_FANOUT))
        if mode == "auto":
            sync = self.auto_sync_blocks
            if sync is None:
                sync = sorted({x for x in AUTO_SYNC_BLOCKS if x < _int(b)} | {_int(b)})
            geoms = self.auto_async
            if geoms is None:
                geoms = sorted({(min(c, _int(b)), f) for c, f in AUTO_ASYNC_GEOMETRIES}) if _int(b) >= 3 else ()
            out.update(auto_sync_blocks=tuple(int(x) for x in sync),
                       auto_async=tuple((int(c), int(f)) for c, f in geoms))
        return out

    def resolved(self, *, has_drafter: bool | None = None, drafter_block_size: int | None = None,
                 num_slots: int | None = None, max_cache_len: int | None = None,
                 kv_page_size: int = 0) -> "DecoderConfig":
        """This config with every derived default filled in (:meth:`derived`) and checked, the
        mode against the drafter too.  ``has_drafter`` None: as the mode says (None: auto);
        ``num_slots`` / ``max_cache_len`` / ``kv_page_size``: the command's (None: left for it to
        set; a page size applies in :data:`PAGED_MODES`).  Resolving a
        resolved config returns an equal one."""
        if has_drafter is None:
            has_drafter = self.mode != "plain"
        fields = self.derived(has_drafter=has_drafter, drafter_block_size=drafter_block_size,
                              num_slots=num_slots, max_cache_len=max_cache_len, kv_page_size=kv_page_size)
        check_drafter(fields["mode"], has_drafter)
        out = dataclasses.replace(self, **fields)
        out.validate()
        return out

    @property
    def width(self) -> int:
        """Tokens fed to the target per round."""
        return 1 if self.mode == "plain" else self.block_size

    @property
    def layout(self) -> BranchLayout:
        """Async's branch pack (mode async only: the others leave C and F underived)."""
        return BranchLayout(self.block_size, self.branch_positions, self.branch_fanout)

    @property
    def kv_max_pages(self) -> int:
        """Pages one row's table holds (0: the cache is dense)."""
        return -(-int(self.max_cache_len) // self.kv_page_size) if self.kv_page_size else 0

    @property
    def kv_num_pages(self) -> int:
        """``kv_pages``, else ``kv_cache_tokens`` in whole pages, else ``num_slots`` whole rows."""
        if self.kv_pages or not self.kv_page_size:
            return int(self.kv_pages)
        if self.kv_cache_tokens is not None:
            return int(self.kv_cache_tokens) // self.kv_page_size
        return int(self.num_slots) * self.kv_max_pages

    @property
    def buckets(self) -> tuple[int, ...]:
        """Window widths (rows) of a round, smallest first."""
        return row_buckets(self.num_slots, self.row_buckets)

    @property
    def prompt_buckets(self) -> tuple[int, ...]:
        """Prompt widths of admission: ``prompt_widths`` (and the whole cache, so every prompt
        has one), else :func:`prompt_buckets`."""
        if self.prompt_widths:
            return tuple(sorted({int(w) for w in self.prompt_widths} | {int(self.max_cache_len)}))
        return prompt_buckets(self.max_cache_len)

    def prompt_width(self, n: int) -> int:
        """The width a prompt of ``n`` tokens is padded to."""
        return prompt_bucket(n, int(self.max_cache_len), self.prompt_buckets)

    @property
    def chunked_prefill(self) -> bool:
        """Prompts prefilled chunk by chunk from a cached prefix: every paged decoder (plain,
        sync and auto; a drafter's paged cache is filled by the same chunks)."""
        return bool(self.kv_page_size)

    @property
    def chunk_widths(self) -> tuple[int, ...]:
        """A paged cache's prefill chunk widths (the same rule as prompt buckets, capped at
        ``max_num_batched_tokens``): a fixed set, whatever the prompt lengths."""
        return prompt_buckets(min(int(self.max_num_batched_tokens), int(self.max_cache_len)))


def decoder_config(mode: str, **fields) -> DecoderConfig:
    """A resolved :class:`DecoderConfig` from command-line style options (a field given as None is
    derived with the library's defaults)."""
    return DecoderConfig(mode=mode, **fields).resolved(num_slots=DEFAULT_NUM_SLOTS, max_cache_len=DEFAULT_CACHE_LEN)
