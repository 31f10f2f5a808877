"""Which pages of a paged KV cache hold what: allocation, reference counts and prefix reuse, on the host.

A :class:`PagePool` hands out page ids of one pool (:mod:`~d3d_jax.model.paged_kv`); the device
never learns more than the page tables built from them.  Prefix reuse follows vLLM's automatic
prefix caching: a *full* page is known by a hash chained over its parent page's hash and its own
token ids, so equal hashes mean equal whole prefixes, not just equal pages.  A sequence's
longest cached prefix is the run of its leading full pages whose chain hashes are known.

Page lives: *free* (holds nothing reusable) → *referenced* (``refs > 0``; by one sequence, or by
several sharing a prefix) → on release either free again, or, if its content is registered,
*cached*: unreferenced but findable until evicted.  Allocation takes free pages first, then
evicts cached ones least recently released first; a sequence's pages are released tail first,
since a tail page is unreachable once its head is gone.  One host thread owns a pool (the
scheduler's), so nothing here locks.

It is ours rather than a library's because it is small and host-only; sglang-jax's radix tree
does the same job over token slots, where pages of a fixed size make a hash chain enough.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Sequence

import numpy as np


class PoolExhausted(RuntimeError):
    """More pages were asked for than are free or evictable (check :attr:`PagePool.num_free`)."""


class PagePool:
    """``num_pages`` pages of ``page_size`` tokens; ``prefix_caching=False`` never shares a page.
    ``salt`` separates pools whose equal tokens mean different K/V (another model, another LoRA)."""

    def __init__(self, num_pages: int, page_size: int, *, prefix_caching: bool = True, salt: bytes = b""):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"page pool: num_pages {num_pages} and page_size {page_size} must be >= 1")
        self.num_pages, self.page_size = int(num_pages), int(page_size)
        self.prefix_caching = bool(prefix_caching)
        self._root = hashlib.blake2b(b"d3d-pages" + salt, digest_size=16).digest()
        self._refs = [0] * self.num_pages
        self._free = collections.deque(range(self.num_pages))  # unreferenced, holding nothing reusable
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # evictable, oldest first
        self._hash_of: dict[int, bytes] = {}  # page -> its chain hash (registered content)
        self._page_of: dict[bytes, int] = {}  # chain hash -> the page holding it
        self.queried_tokens = 0  # prompt tokens looked up (vllm:prefix_cache_queries)
        self.hit_tokens = 0  # of them, found cached (vllm:prefix_cache_hits)

    # ---------------------------------------------------------------- accounting
    @property
    def num_free(self) -> int:
        """Pages :meth:`allocate` can hand out now (free or cached-and-unreferenced)."""
        return len(self._free) + len(self._cached)

    @property
    def usage(self) -> float:
        """Share of pages referenced by some sequence (vllm:kv_cache_usage_perc, a fraction)."""
        return 1.0 - self.num_free / self.num_pages

    def refs(self, page: int) -> int:
        return self._refs[page]

    def stats(self) -> dict[str, float]:
        return {"kv_cache_usage_perc": self.usage, "prefix_cache_queries": self.queried_tokens,
                "prefix_cache_hits": self.hit_tokens, "num_free_pages": self.num_free,
                "num_cached_pages": len(self._hash_of)}

    def pages_for(self, num_tokens: int) -> int:
        return -(-int(num_tokens) // self.page_size)

    # ---------------------------------------------------------------- prefix reuse
    def chain_hashes(self, tokens: Sequence[int]) -> list[bytes]:
        """The hash of each full page of ``tokens``, each chained over the one before."""
        arr = np.asarray(tokens, np.int64)
        out, parent = [], self._root
        for i in range(len(arr) // self.page_size):
            page = arr[i * self.page_size:(i + 1) * self.page_size]
            parent = hashlib.blake2b(parent + page.tobytes(), digest_size=16).digest()
            out.append(parent)
        return out

    def cached_prefix(self, tokens: Sequence[int], *, record: bool = True) -> list[int]:
        """The pages of ``tokens``' longest cached prefix (whole pages), taking no reference:
        :meth:`take` them before anything else allocates.  ``record`` counts the tokens as
        queried and the pages' tokens as hits."""
        pages: list[int] = []
        if self.prefix_caching:
            for h in self.chain_hashes(tokens):
                page = self._page_of.get(h)
                if page is None:
                    break
                pages.append(page)
            if record:
                self.queried_tokens += len(tokens)
                self.hit_tokens += len(pages) * self.page_size
        return pages

    def register(self, pages: Sequence[int], tokens: Sequence[int]) -> None:
        """Make the full pages of a sequence findable: ``pages`` hold ``tokens`` (their K/V
        computed), in order.  A page whose content another page already holds stays private."""
        if not self.prefix_caching:
            return
        hashes = self.chain_hashes(tokens)
        if len(hashes) > len(pages):
            raise ValueError(f"register: {len(tokens)} tokens fill {len(hashes)} pages, "
                             f"but the sequence holds {len(pages)}")
        for page, h in zip(pages, hashes):
            self._check_held(page, "register")
            known = self._hash_of.get(page)
            if known is not None:
                if known != h:
                    raise ValueError(f"register: page {page} already holds other tokens")
                continue
            if h not in self._page_of:
                self._page_of[h], self._hash_of[page] = page, h

    # ---------------------------------------------------------------- references
    def allocate(self, n: int) -> list[int]:
        """``n`` pages for new content, each referenced once: free pages first, then the least
        recently released cached ones (forgotten as they are taken)."""
        if n > self.num_free:
            raise PoolExhausted(f"{n} pages asked for, {self.num_free} of {self.num_pages} free")
        out = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._cached.popitem(last=False)
                del self._page_of[self._hash_of.pop(page)]
            self._refs[page] = 1
            out.append(page)
        return out

    def take(self, pages: Sequence[int]) -> None:
        """One more reference on each of ``pages`` (cached ones leave the evictable list)."""
        for page in pages:
            if self._refs[page] == 0:
                if page not in self._cached:
                    raise ValueError(f"take: page {page} is free; only held or cached pages are shared")
                del self._cached[page]
            self._refs[page] += 1

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference on each of a sequence's ``pages`` (given in order, released tail first)."""
        for page in reversed(list(pages)):
            self._check_held(page, "release")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._hash_of:
                    self._cached[page] = None
                else:
                    self._free.append(page)

    def _check_held(self, page: int, what: str) -> None:
        if not 0 <= page < self.num_pages or self._refs[page] < 1:
            raise ValueError(f"{what}: page {page} is not held by any sequence")


class SlotPages:
    """Each decoder slot's pages of a :class:`PagePool`: held from insert to free (grown page by
    page where the decoder asks), and the page tables (``UNMAPPED``-padded rows) the device gets."""

    def __init__(self, pool: PagePool, max_pages: int, unmapped: int = -1):
        self.pool, self.max_pages, self.unmapped = pool, int(max_pages), int(unmapped)
        self._held: dict[int, list[int]] = {}

    @staticmethod
    def of(config) -> "SlotPages | None":
        """A decoder config's pages, or None for a dense cache."""
        if not config.kv_page_size:
            return None
        return SlotPages(PagePool(config.kv_num_pages, config.kv_page_size,
                                  prefix_caching=config.enable_prefix_caching), config.kv_max_pages)

    @staticmethod
    def need(request, cap: int) -> int:
        """Tokens a request's pages are held for: what its prompt and ``max_new_tokens`` can
        fill, ``cap`` at most."""
        return min(len(request.prompt) + int(request.max_new_tokens), int(cap))

    def fits(self, requests, cap: int) -> bool:
        """Whether the free pages (evictable cached ones included) hold ``requests`` now."""
        return sum(self.pool.pages_for(self.need(r, cap)) for r in requests) <= self.pool.num_free

    def hold(self, need: dict[int, int], prefixes: dict[int, Sequence[int]] | None = None) -> None:
        """Pages for ``need[slot]`` tokens per slot, all or none (:class:`PoolExhausted`); a slot's
        leading pages are those of ``prefixes[slot]``'s cached prefix where there is one (taken
        now, so allocating the rest cannot evict them)."""
        hits = {s: self.pool.cached_prefix(t, record=False) for s, t in (prefixes or {}).items()}
        pages = {s: self.pool.pages_for(n) - len(hits.get(s, ())) for s, n in need.items()}
        idle = {p for hit in hits.values() for p in hit if self.pool.refs(p) == 0}  # cached: counted free
        if sum(pages.values()) + len(idle) > self.pool.num_free:
            raise PoolExhausted(f"{sum(pages.values()) + len(idle)} KV pages needed, "
                                f"{self.pool.num_free} of {self.pool.num_pages} free")
        for s, n in pages.items():
            self.pool.take(hits.get(s, []))
            self._held[s] = list(hits.get(s, [])) + self.pool.allocate(n)

    def hold_requests(self, slots: Sequence[int], requests, cap: int, need=None, prefixes: bool = True) -> None:
        """Each request's pages for ``need(request)`` tokens (default: what its prompt and
        ``max_new_tokens`` can fill, ``cap`` at most), its prompt's cached prefix among them
        (``prefixes``: where the prefill starts past it); a pool too short for them all refuses
        them all, by a request error."""
        from d3d_jax.decoding.decoder_config import RequestError  # the pool stays free of JAX

        need = need or (lambda r: self.need(r, cap))
        try:
            self.hold({s: need(r) for s, r in zip(slots, requests)},
                      {s: list(r.prompt)[:-1] for s, r in zip(slots, requests)} if prefixes else None)
        except PoolExhausted as e:
            raise RequestError(f"{e} (decoder.kv_pages)") from None

    def reuse_prefix(self, slot: int, tokens: Sequence[int]) -> int:
        """The slot's leading pages swapped for the pages of ``tokens``' longest cached prefix
        (its own, fresh and unwritten, go back); how many tokens they hold.  Called right before
        the slot's first prefill chunk, so a prefix that rows admitted since its insert registered
        hits too (the pages it took at insert are that prefix's first ones already)."""
        hit = self.pool.cached_prefix(tokens)
        held = self._held[slot]
        for i, page in enumerate(hit):
            if held[i] != page:
                self.pool.take([page])
                self.pool.release([held[i]])
                held[i] = page
        return len(hit) * self.pool.page_size

    def register(self, slot: int, tokens: Sequence[int]) -> None:
        """The slot's full pages made findable: its first ``len(tokens)`` positions hold them (a
        slot whose pages went already, a preempted one's, has none to register)."""
        held = self._held.get(slot, [])
        self.pool.register(held[:min(len(held), self.pool.pages_for(len(tokens)))], tokens[:len(held) * self.pool.page_size])

    def release(self, slot: int) -> None:
        self.pool.release(self._held.pop(slot, []))

    def held_tokens(self, slot: int) -> int:
        return len(self._held.get(slot, ())) * self.pool.page_size

    def grow(self, slot: int, tokens: int) -> bool:
        """Pages for ``slot``'s first ``tokens`` positions; False (nothing taken) when the free
        pages fall short."""
        more = min(self.pool.pages_for(tokens), self.max_pages) - len(self._held[slot])
        if more <= 0:
            return True
        if more > self.pool.num_free:
            return False
        self._held[slot] += self.pool.allocate(more)
        return True

    def rows_table(self, slot_at: Sequence[int | None]) -> np.ndarray:
        """``[len(slot_at), max_pages]``: the table of the slot at each device row (a free row maps
        nothing)."""
        out = np.full((len(slot_at), self.max_pages), self.unmapped, np.int32)
        for r, s in enumerate(slot_at):
            held = self._held.get(s, ()) if s is not None else ()
            out[r, :len(held)] = held
        return out

    def table(self, slots: Sequence[int], rows: int) -> np.ndarray:
        """``[rows, max_pages]``: ``slots``' tables, the rows past them repeating the first."""
        out = np.full((rows, self.max_pages), self.unmapped, np.int32)
        for r in range(rows):
            held = self._held[slots[r] if r < len(slots) else slots[0]]
            out[r, :len(held)] = held
        return out
