"""The contract between a decoder and what drives it (the server's scheduler, ``engine.generate``,
the benchmarks, the serving tests' fake): JetStream's narrow engine API over a fixed set of slots.

The caller owns which slots it uses: it inserts a prefilled request into a slot it knows is free
and frees it when the request finishes or is cancelled.  The decoder owns its rounds.
:class:`~d3d_jax.decoding.decoder.SpecDecoder` implements it; ``isinstance(x, Decoder)`` checks
that ``x`` has every member (not their signatures).
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable


@runtime_checkable
class Decoder(Protocol):
    """What a caller may do with a decoder and read from it."""

    # the static shape: ``mode``, ``num_slots``, ``max_cache_len``, ``block_size``, ``buckets``
    # (window widths, smallest first) and ``eos_token_ids`` (a DecoderConfig)
    config: Any
    vocab_size: int  # token ids a request may hold are in [0, vocab_size)
    # the compiled-program store (``enabled``, ``counts``, ``stored()``, ``preload()``); None:
    # the decoder keeps no compiled programs
    programs: Any

    def validate_request(self, request) -> None:
        """Raise a ``ValueError`` naming the request's first problem (any thread may call it)."""

    def prefill(self, request) -> Any:
        """Check one request (or a sequence of them) and stage it for :meth:`insert`."""

    def insert(self, prefix, slot) -> None:
        """Put prefilled requests into free slots (``slot``: one, or one per request)."""

    def step(self) -> dict:
        """One round for every active slot: ``{slot: StepOutput}`` (``token_ids``, ``finished``,
        ``finish_reason``, ``accepted``, ``hit``, ``logprobs``)."""

    def free(self, slot) -> None:
        """The slot's request leaves (finished or cancelled); a free slot stays free."""

    def results(self, slots: Sequence[int]) -> list[dict]:
        """Per slot: ``token_ids``, ``finish_reason``, ``accept_hist`` (and the mode's counts)."""

    def warm_up(self, widths: Sequence[int] | None = None, run: bool = True,
                prompt_cap: int | None = None) -> float:
        """Compile (or read) the programs of every window width (``widths``: only those) and the
        admission of prompts of up to ``prompt_cap`` tokens (None: all) before a client waits;
        the seconds it took.  ``run=False``: compile only, dispatching nothing
        (safe on another thread while rounds run)."""

    def decisions(self) -> dict[str, dict]:
        """Per geometry (``plain``, ``sync/8``, ``async/12x2``): rounds run and tokens committed."""

    def slot_metrics(self, slot: int) -> dict:
        """The slot's request so far: ``tau``, ``accept_hist``, ``rounds``, ``n_out``, ``modes``,
        ``hits`` and ``misses`` (None where the mode has none)."""

    # KV memory in pages (a dense decoder: always admits, never preempts, no pool)
    def can_admit(self, request) -> bool:
        """Whether :meth:`insert` finds KV pages for ``request`` now (else it waits queued)."""

    def allow_preemption(self) -> None:
        """From here on rows grow page by page, and the newest may be preempted when one is short."""

    def take_preempted(self) -> list[int]:
        """Slots preempted since the last call (freed already): the caller queues them again."""

    def page_stats(self) -> dict | None:
        """The pool's usage, pages and prefix-cache counts; None for a dense cache."""

    def param_leaves(self) -> tuple[list, list]:
        """The target's and the drafter's parameter arrays as the programs read them (read-only:
        prompt scoring reads the placed target, never a second copy)."""
