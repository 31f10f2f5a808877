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
from test_decoder import BLOCK, CACHE, MAX_NEW, SLOTS, setup  # noqa: F401  (the module fixture)
from tiny_models import serve

PAGE = 4
PAGES = 18  # 3 requests of up to 29 tokens (8 pages) fit; the dense cache would take 48


@pytest.fixture(scope="module")
def paged(setup):  # noqa: F811
    cfg = DecoderConfig(mode="plain", num_slots=SLOTS, max_cache_len=CACHE, block_size=BLOCK,
                        kv_page_size=PAGE, kv_pages=PAGES)
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
    """A sync or auto decoder over pages (one per mode for the module)."""
    key = ("paged", mode)
    if key not in s["decoders"]:
        cfg = DecoderConfig(mode=mode, num_slots=SLOTS, max_cache_len=CACHE, block_size=BLOCK,
                            kv_page_size=PAGE, kv_pages=PAGES)
        s["decoders"][key] = SpecDecoder(s["target"], s["drafter"], cfg)
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
    assert slots_in_use(dec) == [] and dec.pages.pool.usage == 0
    assert sum(checked) > 20, checked  # generated tokens were cached and checked


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
