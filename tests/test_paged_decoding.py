"""Decoding over paged caches against the solo greedy references of test_decoder (each prompt
decoded alone by the dense engine, itself checked against transformers), and the drafter's paged
cache against a fresh prefill of the committed tokens (greedy outputs cannot show a wrong draft).

The pool is smaller than the dense cache the slots would reserve, so pages freed by one request
are handed to the next (in a different order): a read or write through a stale or wrong table
would change tokens, or the drafter's cached K/V.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from d3d_jax.config import ConfigError
from d3d_jax.decoding.core import MAX_STOP_IDS, DecodeCore, RowInput
from d3d_jax.decoding.drafting import ModelDrafter
from d3d_jax.decoding.verify import SamplingParams
from d3d_jax.model.paged_kv import UNMAPPED, row_positions
from d3d_jax.model.qwen3 import unstacked
from d3d_jax.decoding.decoder import DecoderConfig, Request, RequestError, SpecDecoder, slots_in_use
from d3d_jax.decoding.engine import generate as decode
from test_auto import Cycle, ungate
from test_decoder import BLOCK, CACHE, MAX_NEW, SLOTS, VOCAB, generate, setup  # noqa: F401  (the module fixture)
from tiny_models import serve

PAGE = 4
PAGES = 18  # 3 requests of up to 29 tokens (8 pages) fit; the dense cache would take 48
SPEC_PAGES = 24  # the speculative decoders' pool: 3 rows of 32 tokens
CHUNK = 8  # prompt tokens prefilled between two rounds: a 30-token prompt takes four chunks


@pytest.fixture(scope="module")
def paged(setup):  # noqa: F811
    """The module's plain decoder over pages (admission by chunks of CHUNK tokens)."""
    cfg = DecoderConfig(mode="plain", num_slots=SLOTS, max_cache_len=CACHE, block_size=BLOCK,
                        kv_page_size=PAGE, kv_pages=PAGES, max_num_batched_tokens=CHUNK)
    return SpecDecoder(setup["target"], None, cfg)


def test_continuous_batching_over_pages_equals_solo_greedy(setup, paged):  # noqa: F811
    s, dec = setup, paged
    reqs = [Request(p, max_new_tokens=n, index=i) for i, (p, n) in enumerate(zip(s["prompts"], MAX_NEW))]
    tokens, reasons = serve(dec, reqs, schedule=[0, 0, 1, 2, 2, 5], cancel={1: 3})
    assert reasons[1] == "cancelled" and tokens[1] == s["solo"][1][:len(tokens[1])]
    for i in (0, 2, 3, 4, 5):
        assert (reasons[i], tokens[i]) == ("length", s["solo"][i][:MAX_NEW[i]]), i
    assert slots_in_use(dec) == [] and dec.pages.pool.usage == 0


def _speculative(s, mode: str) -> SpecDecoder:
    """The module's one sync or auto decoder over pages: admission by chunks of CHUNK tokens,
    rows growing page by page (as under the scheduler).  Every speculative test shares it, so
    each mode's programs compile once.  Its pool (SPEC_PAGES) holds three rows of up to 32
    tokens, fewer than a dense cache's, so freed pages are handed to later requests.  Auto runs
    windows of one row and of all three (each width compiles every geometry's round again)."""
    key = ("paged", mode)
    if key not in s["decoders"]:
        cfg = DecoderConfig(mode=mode, num_slots=SLOTS, max_cache_len=CACHE, block_size=BLOCK,
                            kv_page_size=PAGE, kv_pages=SPEC_PAGES, max_num_batched_tokens=CHUNK,
                            row_buckets=(1,) if mode == "auto" else ())
        s["decoders"][key] = SpecDecoder(s["target"], s["drafter"], cfg)
        s["decoders"][key].allow_preemption()
    return s["decoders"][key]


def assert_drafter_pages_hold_a_fresh_prefill(state, drafter_model) -> int:
    """Every running row's drafter cache, read through its page table, holds the K/V a fresh
    dense prefill of its committed tokens writes; the table is the target's.  Returns the
    number of cached generated tokens checked."""
    st = jax.device_get(state)
    cache = st.drafter_state
    np.testing.assert_array_equal(cache.page_table, st.target_cache.page_table)
    k, v = row_positions(cache, CACHE)
    md = ModelDrafter(drafter_model)
    generated = 0
    for row in np.flatnonzero(~st.done):
        n = int(cache.lengths[row])
        ref = _prefill(md, st.seq[row: row + 1], n)
        for got, want in ((k, ref.k_lbskh), (v, ref.v_lbskh)):
            np.testing.assert_allclose(np.asarray(got[:, row, :n]), np.asarray(want[:, 0, :n]), atol=2e-5)
        generated += max(n - int(st.prompt_len[row]), 0)
    return generated


def _prefill(md, seq, n):
    if "fn" not in _prefill.__dict__:  # one shape (the whole row): compiled once
        _prefill.fn = jax.jit(lambda p, seq, n: md.prefill(p, None, seq, n))
    return _prefill.fn(md.params, jnp.asarray(seq), jnp.asarray([n], jnp.int32))


@pytest.mark.parametrize("mode", ["sync", "auto"])
def test_speculative_decoding_over_pages_equals_solo_greedy(setup, mode, monkeypatch):  # noqa: F811
    """Sync, and auto cycling plain, sync, async and split rounds, over paged target and drafter
    caches: requests join, finish, are cancelled (rows swap), pages are reused; every output is
    the solo greedy one and the drafter's pages hold exactly its committed tokens' K/V."""
    s = setup
    dec = _speculative(s, mode)
    if mode == "auto":
        monkeypatch.setattr(dec.strategy.policy, "choose", Cycle(dec.strategy.policy))
        ungate(dec, monkeypatch)
    step, checked = dec.step, []

    def checking_step():
        out = step()
        if dec.carry is not None and len(checked) < 12:
            checked.append(assert_drafter_pages_hold_a_fresh_prefill(dec.carry.state, s["drafter"]))
        return out

    monkeypatch.setattr(dec, "step", checking_step)
    reqs = [Request(p, max_new_tokens=n, index=i) for i, (p, n) in enumerate(zip(s["prompts"], MAX_NEW))]
    tokens, reasons = serve(dec, reqs, schedule=[0, 0, 1, 2, 2, 5], cancel={1: 3})
    assert reasons[1] == "cancelled" and tokens[1] == s["solo"][1][:len(tokens[1])]
    for i in (0, 2, 3, 4, 5):
        assert (reasons[i], tokens[i]) == ("length", s["solo"][i][:MAX_NEW[i]]), (mode, i)
    assert slots_in_use(dec) == [] and dec.pages.pool.usage == 0 and dec.take_preempted() == []
    assert sum(checked) > 20, checked  # generated tokens were cached and checked


def test_a_sync_round_over_pages_carries_no_prefill_by_rounds(setup):  # noqa: F811
    """Chunks prefill a paged row's prompt before it joins, so no row of a paged sync decoder
    is ever prefilled by its rounds: the round program holds none of that path's selects."""
    core = _speculative(setup, "sync").strategy.home
    assert core.prefilling(core.init_state(SLOTS)) is None


def test_the_on_device_loop_over_pages_equals_solo_greedy(setup, paged):  # noqa: F811
    s = setup
    out = decode(paged, s["prompts"][:SLOTS], max_new_tokens=8)
    assert [o.token_ids for o in out] == [r[:8] for r in s["solo"][:SLOTS]]


def test_a_request_the_free_pages_cannot_hold_is_refused_and_nothing_is_lost(setup, paged):  # noqa: F811
    s, dec = setup, paged
    runs = {0: (1, 20), 1: (4, 20), 2: (0, 9)}  # slot: (prompt, max_new): 8 + 6 + 3 pages
    for slot in (0, 1):
        p, n = runs[slot]
        dec.insert(dec.prefill(Request(s["prompts"][p], n, index=p)), slot)
    with pytest.raises(RequestError, match="5 KV pages needed, 4 of 18 free.*decoder.kv_pages"):
        dec.insert(dec.prefill(Request(s["prompts"][3], 12, index=3)), 2)  # 19 tokens
    assert slots_in_use(dec) == [0, 1] and dec.pages.pool.num_free == 4
    p, n = runs[2]
    dec.insert(dec.prefill(Request(s["prompts"][p], n, index=p)), 2)
    tokens, done = {0: [], 1: [], 2: []}, set()
    while len(done) < 3:
        for slot, o in dec.step().items():
            tokens[slot] += o.token_ids
            done |= {slot} if o.finished else set()
    dec.free([0, 1, 2])
    assert tokens == {slot: s["solo"][p][:n] for slot, (p, n) in runs.items()}
    assert dec.pages.pool.usage == 0


def test_a_done_row_writes_nothing_into_pages_it_no_longer_holds(setup):  # noqa: F811
    """Row 1 left, and its stale table still maps row 0's pages; a round over both rows must
    leave row 0's cached K/V as they were (row 1's anchor falls on row 0's position 4)."""
    graphdef, params = nnx.split(unstacked(setup["target"]))
    core = DecodeCore(graphdef, setup["target"].config, None, width=1, cache_len=CACHE,
                      page_size=PAGE, num_pages=4)
    table = np.full((2, CACHE // PAGE), UNMAPPED, np.int32)
    table[:, :2] = [[2, 0], [2, 0]]  # both rows: positions 0-7 in pages 2 and 0
    n = 2
    rows = RowInput(jnp.asarray([[5, 6, 7, 8, 9, 10, 11, 12]] * n), jnp.asarray([8, 5]), jnp.zeros(n, jnp.int32),
                    jnp.zeros(n, jnp.int32), jnp.asarray([4, 4]), jnp.full((n, MAX_STOP_IDS), -1, jnp.int32),
                    jnp.zeros((n, MAX_STOP_IDS), bool), SamplingParams.rows(n), None, jnp.asarray(table))
    state = jax.jit(lambda p, r: core.insert(core.init_state(2), core.prefill_target(p, r), None,
                                             jnp.arange(2)))(params, rows)
    state = core.free(state, jnp.asarray([1]))
    before = np.asarray(state.target_cache.k_lpskh)
    state, _ = jax.jit(lambda p, st: core.round(p, None, st))(params, state)
    after = np.asarray(state.target_cache.k_lpskh)
    row0 = lambda pool: pool[:, [2, 0]].reshape((pool.shape[0], 2 * PAGE) + pool.shape[3:])  # noqa: E731
    np.testing.assert_array_equal(row0(after)[:, :7], row0(before)[:, :7])  # its cached positions
    assert np.abs(after[:, 0, 3] - before[:, 0, 3]).max() > 0  # row 0 wrote its anchor (position 7)


@pytest.mark.parametrize("kw,key", [
    (dict(mode="async", kv_page_size=PAGE), "decoder.kv_page_size"),
    (dict(kv_page_size=-1), "decoder.kv_page_size"),
    (dict(kv_page_size=PAGE, kv_pages=CACHE // PAGE - 1), "decoder.kv_pages"),
])
def test_paged_config_errors_name_the_key(kw, key):
    with pytest.raises(ConfigError, match=key):
        DecoderConfig(**{"mode": "plain", "num_slots": SLOTS, "max_cache_len": CACHE, "block_size": BLOCK, **kw}).resolved()



# ---------------------------------------------------------------- prefix reuse and chunked prefill


@pytest.fixture(scope="module")
def chunked(paged):
    """The plain paged decoder: the long-prompt test's two requests take all PAGES pages."""
    return paged


def _alone(setup, prompts, n):  # noqa: F811
    """Each prompt decoded alone by the dense engine (checked against transformers in test_engine)."""
    return [o.token_ids for o in generate(setup["target"], prompts, max_new_tokens=n, batch_size=1,
                                          block_size=BLOCK, max_cache_len=CACHE)]


def _run(dec, slots: dict) -> dict:
    """Step until every slot of ``slots`` (slot: tokens so far) finished."""
    done: set = set()
    while len(done) < len(slots):
        for slot, out in dec.step().items():
            slots[slot] += out.token_ids
            done |= {slot} if out.finished else set()
    return slots


def test_a_shared_prefix_is_prefilled_once_and_each_request_decodes_as_alone(setup, chunked):  # noqa: F811
    """Two requests inserted together (the n choices of one request, or one system prompt sent
    twice): the second maps the first's prefix pages, prefills only its own tail, and both decode
    exactly as alone."""
    held, counted = _two_sharing_a_prefix(setup, chunked, seed=7)
    assert held[0][:5] == held[1][:5]  # the prefix's five full pages, shared
    assert counted["prefix_cache_hits"] == 20
    assert chunked.pages.pool.usage == 0


def _two_sharing_a_prefix(setup, dec, seed: int):  # noqa: F811
    """Two requests with one 20-token prefix, inserted together and run to their ends, each
    checked against its output alone: their pages, and how much ``page_stats`` counted."""
    prefix = np.random.default_rng(seed).integers(0, VOCAB - 1, 20).tolist()
    prompts = [prefix + [3, 9], prefix + [5, 1, 7]]
    before = dec.page_stats()
    for slot, p in enumerate(prompts):
        dec.insert(dec.prefill(Request(p, 10, index=slot)), slot)
    out = _run(dec, {0: [], 1: []})
    held = dict(dec.pages._held)
    dec.free([0, 1])
    assert [out[0], out[1]] == _alone(setup, prompts, 10)
    return held, {k: v - before[k] for k, v in dec.page_stats().items()}


def test_turn_two_of_a_chat_hits_turn_one_and_its_answer(setup, chunked):  # noqa: F811
    dec, rng = chunked, np.random.default_rng(8)
    turn1 = rng.integers(0, VOCAB - 1, 10).tolist()
    dec.insert(dec.prefill(Request(turn1, 12)), 0)
    answer = _run(dec, {0: []})[0]
    dec.free(0)
    turn2 = turn1 + answer + [4, 2]  # 24 tokens: its first 23 are cached but the last one's
    before = dec.page_stats()
    dec.insert(dec.prefill(Request(turn2, 9)), 2)
    out = _run(dec, {2: []})[2]
    dec.free(2)
    assert dec.page_stats()["prefix_cache_hits"] - before["prefix_cache_hits"] == 20  # 5 full pages
    assert out == _alone(setup, [turn2], 9)[0]


def test_a_prompt_longer_than_a_chunk_joins_after_its_chunks_while_others_decode(setup, chunked):  # noqa: F811
    """A 30-token prompt takes four chunks of CHUNK tokens, each between two rounds: the running
    request gets a token every step meanwhile, and both decode as alone."""
    s, dec = setup, chunked
    long_prompt = np.random.default_rng(9).integers(0, VOCAB - 1, 30).tolist()
    dec.insert(dec.prefill(Request(s["prompts"][1], 20, index=1)), 0)
    tokens = {0: [], 1: []}
    tokens[0] += dec.step()[0].token_ids
    dec.insert(dec.prefill(Request(long_prompt, 8, index=7)), 1)
    waited = 0
    while not tokens[1]:
        outs = dec.step()
        assert len(outs[0].token_ids) == 1  # the running stream is never held up for a whole prompt
        tokens[0] += outs[0].token_ids
        tokens[1] += outs[1].token_ids if 1 in outs else []
        waited += 1
    assert waited >= 4
    _run(dec, tokens)
    dec.free([0, 1])
    assert tokens[0] == s["solo"][1][:20]
    assert tokens[1] == _alone(s, [long_prompt], 8)[0]


# ---------------------------------------------------------------- the drafter's pages too (sync, auto)
def _chunked_speculative(s, mode: str, monkeypatch) -> SpecDecoder:
    """A sync or auto decoder admitting by chunks of CHUNK tokens, growing its rows page by page
    (as under the scheduler), each step checking that every running row's drafter pages hold a
    fresh prefill of its committed tokens (a prefix hit on a page the drafter never wrote, or a
    drafter table left behind by growth, would fail it).  Auto cycles every mix of rounds."""
    dec = _speculative(s, mode)
    if mode == "auto":
        monkeypatch.setattr(dec.strategy.policy, "choose", Cycle(dec.strategy.policy))
        ungate(dec, monkeypatch)
    step = dec.step

    def checking_step():
        out = step()
        assert_drafter_pages_hold_a_fresh_prefill(dec.carry.state, s["drafter"])
        return out

    monkeypatch.setattr(dec, "step", checking_step)
    return dec


@pytest.mark.parametrize("mode", ["sync", "auto"])
def test_a_shared_prefix_fills_target_and_drafter_pages_once(setup, mode, monkeypatch):  # noqa: F811
    """Two requests with a 20-token prefix inserted together: the second maps the first's pages
    in both pools (one lookup), the drafter prefills only the tails, and both decode as alone."""
    dec = _chunked_speculative(setup, mode, monkeypatch)
    held, counted = _two_sharing_a_prefix(setup, dec, seed=17)
    assert held[0][:5] == held[1][:5]
    assert counted["drafter_prefill_tokens_reused"] == 20
    # 21 + 22 prompt tokens cached in all, 20 of them found: the drafter computed the other 23
    assert counted["drafter_prefill_tokens_computed"] == 23
    assert dec.pages.pool.usage == 0


@pytest.mark.parametrize("mode", ["sync", "auto"])
def test_turn_two_hits_only_pages_the_drafter_wrote_too(setup, mode, monkeypatch):  # noqa: F811
    """Turn 1 (10 tokens, 11 answered) ends with the target holding 20 positions (5 pages) and
    the drafter fewer (it trails by the last round's accepted tokens + 1): only the pages both
    caches filled are registered, so turn 2 hits 4 pages in sync (the drafter holds >= 16), and
    decodes as alone."""
    dec, rng = _chunked_speculative(setup, mode, monkeypatch), np.random.default_rng(18)
    turn1 = rng.integers(0, VOCAB - 1, 10).tolist()
    dec.insert(dec.prefill(Request(turn1, 11)), 0)
    answer = _run(dec, {0: []})[0]
    drafted = dec._slots[0].drafted
    dec.free(0)
    turn2 = turn1 + answer + [4, 2]
    before = dec.page_stats()
    dec.insert(dec.prefill(Request(turn2, 9)), 2)
    out = _run(dec, {2: []})[2]
    dec.free(2)
    hit = dec.page_stats()["prefix_cache_hits"] - before["prefix_cache_hits"]
    assert hit == (9 + min(drafted, 11)) // PAGE * PAGE
    assert hit == 16 if mode == "sync" else hit <= 16
    assert out == _alone(setup, [turn2], 9)[0]


@pytest.mark.parametrize("mode", ["sync", "auto"])
def test_a_long_prompt_joins_by_chunks_while_a_speculative_stream_decodes(setup, mode, monkeypatch):  # noqa: F811
    s, dec = setup, _chunked_speculative(setup, mode, monkeypatch)
    long_prompt = np.random.default_rng(19).integers(0, VOCAB - 1, 30).tolist()
    dec.insert(dec.prefill(Request(s["prompts"][4], 20, index=4)), 0)
    tokens, done, first = {0: dec.step()[0].token_ids, 1: []}, set(), None
    dec.insert(dec.prefill(Request(long_prompt, 8, index=7)), 1)
    for steps in range(1, 100):
        for slot, o in dec.step().items():
            tokens[slot] += o.token_ids
            done |= {slot} if o.finished else set()
        first = first or (steps if tokens[1] else None)
        if done == {0, 1}:
            break
    assert first >= 4  # 29 prompt tokens, at most CHUNK of them between two rounds
    dec.free([0, 1])
    assert tokens[0] == s["solo"][4][:20]
    assert tokens[1] == _alone(s, [long_prompt], 8)[0]
