"""PagePool against a brute-force model of the same rules, over random operation sequences.

The model knows a cached page by its whole token prefix (no hashes), finds the longest cached
prefix by trying every length, and orders evictions by explicit release times; a simulated device
records what each page was written with, so a hit on the wrong content shows.
"""

import random

import pytest

from d3d_jax.decoding.page_pool import PagePool, PoolExhausted, SlotPages

PAGE = 4


class BruteForce:
    def __init__(self, num_pages: int):
        self.refs = {p: 0 for p in range(num_pages)}
        self.key: dict[int, tuple] = {}  # cached page -> every token up to its end
        self.released_at: dict[int, int] = {}  # unreferenced cached page -> release time
        self.clock = self.queried = self.hits = 0

    @property
    def num_free(self) -> int:
        return sum(r == 0 for r in self.refs.values())

    def hit(self, tokens) -> int:
        known = set(self.key.values())
        n = 0
        while (n + 1) * PAGE <= len(tokens) and tuple(tokens[:(n + 1) * PAGE]) in known:
            n += 1
        return n

    def check_allocation(self, got: list[int]) -> None:
        for page in got:
            plain = [p for p, r in self.refs.items() if r == 0 and p not in self.key]
            if plain:
                assert page in plain
            else:
                assert page == min(self.released_at, key=self.released_at.get)
                del self.key[page], self.released_at[page]
            self.refs[page] = 1

    def take(self, pages) -> None:
        for p in pages:
            self.released_at.pop(p, None)
            self.refs[p] += 1

    def release(self, pages) -> None:
        for p in reversed(pages):
            self.refs[p] -= 1
            if self.refs[p] == 0 and p in self.key:
                self.released_at[p] = self.clock
                self.clock += 1

    def register(self, pages, tokens) -> None:
        for i in range(len(tokens) // PAGE):
            k = tuple(tokens[:(i + 1) * PAGE])
            if pages[i] in self.key:
                assert self.key[pages[i]] == k
            elif k not in self.key.values():
                self.key[pages[i]] = k


class Scenario:
    """Requests arriving (prompts drawn from a few shared ones), generating and finishing, each
    operation applied to the pool and the model alike."""

    def __init__(self, seed: int, num_pages: int):
        self.rng = random.Random(seed)
        self.pool, self.model = PagePool(num_pages, PAGE), BruteForce(num_pages)
        self.content: dict[int, tuple] = {}  # what the simulated device wrote to each page
        self.bases = [[self.rng.randrange(3) for _ in range(6 * PAGE)] for _ in range(3)]
        self.live: list[tuple[list[int], list[int]]] = []
        self.seen = dict(hits=0, exhausted=0, evicted=0)

    def grow(self, pages, tokens, written) -> bool:
        """``tokens[written:]`` get pages and are written (a partial last page fills up)."""
        pool, model = self.pool, self.model
        need = pool.pages_for(len(tokens)) - len(pages)
        if need > model.num_free:
            with pytest.raises(PoolExhausted):
                pool.allocate(need)
            self.seen["exhausted"] += 1
            return False
        cached_before = set(model.key)
        new = pool.allocate(need)
        model.check_allocation(new)
        self.seen["evicted"] += len(cached_before - set(model.key))
        pages += new
        for i in range(written // PAGE, len(pages)):
            self.content[pages[i]] = tuple(tokens[i * PAGE:(i + 1) * PAGE])
        pool.register(pages, tokens)
        model.register(pages, tokens)
        return True

    def arrive(self) -> None:
        """Look up the prompt, share the hit, allocate the rest (or give the hit back)."""
        rng, pool, model = self.rng, self.pool, self.model
        tail = [rng.randrange(3) for _ in range(rng.randrange(9))]
        tokens = rng.choice(self.bases)[:rng.randrange(1, 6 * PAGE)] + tail
        lookup = rng.random() < 0.9  # else: admitted beside an equal prompt, before it registered
        hit = pool.cached_prefix(tokens) if lookup else []
        n = model.hit(tokens) if lookup else 0
        if lookup:
            model.queried += len(tokens)
            model.hits += n * PAGE
        assert len(hit) == n
        for i, p in enumerate(hit):
            assert self.content[p] == tuple(tokens[i * PAGE:(i + 1) * PAGE])
            assert model.key[p] == tuple(tokens[:(i + 1) * PAGE])
        self.seen["hits"] += n
        pool.take(hit)
        model.take(hit)
        pages = list(hit)
        if self.grow(pages, tokens, n * PAGE):
            self.live.append((pages, tokens))
        else:
            pool.release(pages)
            model.release(pages)

    def step(self) -> None:
        op = self.rng.random()
        if op < 0.45 or not self.live:
            self.arrive()
        elif op < 0.75:  # a request finishes
            pages, _ = self.live.pop(self.rng.randrange(len(self.live)))
            self.pool.release(pages)
            self.model.release(pages)
        else:  # a running request generates a few tokens
            pages, tokens = self.rng.choice(self.live)
            more = tokens + [self.rng.randrange(3) for _ in range(self.rng.randrange(1, 2 * PAGE))]
            if self.grow(pages, more, len(tokens)):
                tokens[:] = more

    def check(self) -> None:
        pool, model = self.pool, self.model
        assert pool.num_free == model.num_free
        assert [pool.refs(p) for p in range(pool.num_pages)] == [model.refs[p] for p in range(pool.num_pages)]
        assert (pool.queried_tokens, pool.hit_tokens) == (model.queried, model.hits)
        assert pool.usage == pytest.approx(1 - model.num_free / pool.num_pages)


@pytest.mark.parametrize("seed", range(4))
def test_random_operations_follow_the_brute_force_rules(seed):
    run = Scenario(seed, num_pages=24)
    for _ in range(600):
        run.step()
        run.check()
    seen = run.seen
    # the sequences reached every rule: hits, evictions and a full pool
    assert seen["hits"] > 50 and seen["evicted"] > 10 and seen["exhausted"] > 5, seen


def test_equal_pages_after_different_prefixes_are_not_shared():
    pool = PagePool(8, PAGE)
    a = pool.allocate(2)
    pool.register(a, [1, 1, 1, 1, 2, 2, 2, 2])
    assert pool.cached_prefix([1, 1, 1, 1, 2, 2, 2, 2, 3]) == a
    assert pool.cached_prefix([0, 1, 1, 1, 2, 2, 2, 2]) == []  # second page equal, parent not
    assert pool.stats()["prefix_cache_queries"] == 17 and pool.stats()["prefix_cache_hits"] == 8


def test_without_prefix_caching_nothing_is_shared():
    pool = PagePool(4, PAGE, prefix_caching=False)
    a = pool.allocate(2)
    pool.register(a, list(range(8)))
    assert pool.cached_prefix(list(range(8))) == []
    pool.release(a)
    assert pool.num_free == 4 and pool.usage == 0


def test_misuse_is_refused_by_name():
    pool = PagePool(4, PAGE)
    with pytest.raises(ValueError, match="page 2 is not held"):
        pool.release([2])
    with pytest.raises(ValueError, match="page 1 is free"):
        pool.take([1])
    a = pool.allocate(1)
    with pytest.raises(ValueError, match="8 tokens fill 2 pages"):
        pool.register(a, list(range(8)))
    with pytest.raises(PoolExhausted, match="4 pages asked for, 3 of 4 free"):
        pool.allocate(4)
    with pytest.raises(ValueError, match="num_pages 0"):
        PagePool(0, PAGE)


def test_a_slot_holds_its_cached_prefix_before_allocating_so_the_rest_cannot_evict_it():
    """Every free page gone but the two cached ones of a prefix: a request with that prefix holds
    them plus fresh pages; the fresh ones must not be the prefix's own (evicted), and a later
    lookup swaps nothing back."""
    pool = PagePool(6, PAGE)
    first = pool.allocate(2)
    pool.register(first, list(range(8)))
    pool.release(first)  # cached, findable
    others = pool.allocate(4)  # every free page: only the cached ones remain allocatable
    pool.release(others[2:])  # two free again
    slots = SlotPages(pool, max_pages=4)
    slots.hold({0: 16}, {0: list(range(9))})  # 4 pages: the 2 cached + 2 fresh
    assert slots._held[0][:2] == first and len(set(slots._held[0])) == 4
    assert slots.reuse_prefix(0, list(range(9))) == 8 and slots._held[0][:2] == first
    with pytest.raises(PoolExhausted, match="1 KV pages needed, 0 of 6 free"):
        slots.hold({1: 4}, {1: [7]})


def test_a_steps_token_budget_covers_the_decode_rows_before_the_prefill_chunk():
    """vLLM's budget: the round after the chunks feeds ``decoding`` tokens, so the chunk gets the
    rest (a 40-token prompt, budget 16: 10 tokens beside 6 decode tokens), never less than the
    smallest chunk width (8), and a prompt with nothing cached runs from position 0."""
    import types

    from d3d_jax.decoding.admission import ChunkedAdmission
    from d3d_jax.decoding.decoder_config import Request

    pages = SlotPages(PagePool(16, PAGE), 16)
    pages.hold({0: 44})
    info = types.SimpleNamespace(request=Request(list(range(1, 41)), 4), cached=-1, pending=True)
    chunks = ChunkedAdmission(pages, 16, (8, 16))
    chunks.add(0, info)
    calls = []
    record = lambda slot, info, start, count, width, last: calls.append((start, count, width, last))  # noqa: E731
    chunks.run(record, lambda slot, info: True, decoding=6)
    chunks.run(record, lambda slot, info: True, decoding=40)
    chunks.run(record, lambda slot, info: True, everything=True)
    assert calls == [(0, 10, 16, False), (10, 8, 8, False), (18, 16, 16, False), (34, 5, 8, True)]
    assert not info.pending and len(chunks) == 0
