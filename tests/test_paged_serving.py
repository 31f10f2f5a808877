"""The server over a paged KV cache: admission by free pages, the pool's size from the flags or
the device's memory, and the pool's series on /metrics.

Outputs are checked against the solo greedy references of test_decoder (each prompt decoded alone
by the dense engine, itself checked against transformers); pool sizes against closed forms.
"""

import argparse
import types

import pytest

from d3d_jax.config import ConfigError
from d3d_jax.config.flags import load_command_config
from d3d_jax.config.model import ModelConfig
from d3d_jax.config.serve import ServeConfig
from d3d_jax.decoding.decoder import Request
from d3d_jax.decoding.settings import kv_pool_pages
from d3d_jax.decoding.verify import SamplingParams
from d3d_jax.serving import server as S
from d3d_jax.serving.scheduler import Scheduler
from test_decoder import setup  # noqa: F401  (the module fixture)
from test_paged_decoding import PAGES, paged  # noqa: F401

MAX_NEW = 20  # prompts of 1-9 tokens: 6 to 8 pages of 4 each, so 2 or 3 of them fill the 18


def _served(sched, requests) -> list[list[int]]:
    """Each request's tokens through ``sched`` (all submitted at once), none failing."""
    events = {i: [] for i in range(len(requests))}
    for i, r in enumerate(requests):
        sched.submit(r, events[i].append)
    sched.run_until_idle(timeout_s=600)
    assert all(ev[-1].finish_reason == "length" for ev in events.values()), events
    return [[t for ev in events[i] for t in ev.token_ids] for i in range(len(requests))]


def test_rows_grow_page_by_page_and_a_preempted_request_resumes_with_the_same_tokens(setup, paged):  # noqa: F811
    """Three slots, pages for two whole requests: the rows grow until a page is short, the newest
    is preempted and queued again as prompt + its tokens, and every request gets the tokens it
    gets alone: greedy ones their solo references, seeded sampling ones their own run alone.
    /metrics shows the pool's usage and the preemptions."""
    s, dec = setup, paged
    sched = Scheduler(dec)
    hot = SamplingParams(temperature=1.0)
    reqs = [Request(s["prompts"][i], MAX_NEW, sampling=hot if i % 2 else SamplingParams(), seed=7 + i, index=i)
            for i in range(5)]
    sched.submit(reqs[0], lambda ev: None)
    sched.run_round()
    text = sched.metrics.render(sched.num_active, sched.num_queued, 3, "plain", kv=sched.kv_stats())
    assert f"d3d_kv_cache_usage_perc {1 / PAGES:.6g}" in text and f"d3d_kv_pages_total {PAGES}" in text
    sched.run_until_idle(timeout_s=600)  # a prompt of 1 token holds 1 page of 4, not 6 for its 20 more
    together = _served(sched, reqs)
    assert sched.metrics.counters["preemptions"] >= 1
    assert f"d3d_num_preemptions_total {sched.metrics.counters['preemptions']}" in sched.metrics.render(
        0, 0, 3, "plain", kv=sched.kv_stats())
    alone = [_served(sched, [r])[0] for r in reqs]
    assert together == alone
    assert [alone[i] for i in (0, 2, 4)] == [s["solo"][i][:MAX_NEW] for i in (0, 2, 4)]
    assert dec.pages.pool.usage == 0


def test_requests_the_free_pages_cannot_hold_wait_and_all_equal_solo(setup, paged):  # noqa: F811
    """Requests that hold every page they can fill from admission (a presence penalty counts
    generated tokens, so such a request is never preempted; 1e-30 leaves every logit as it is):
    with pages for two, the third waits in the queue with a slot free (the old scheduler inserted
    it and its RequestError ended it), and every request gets its solo greedy tokens."""
    s, dec = setup, paged
    sched = Scheduler(dec)
    events = {i: [] for i in range(6)}
    for i, p in enumerate(s["prompts"]):  # the penalty counts generated tokens: not resumable
        req = Request(p, max_new_tokens=MAX_NEW, index=i, sampling=SamplingParams(presence_penalty=1e-30))
        sched.submit(req, events[i].append)
    sched.run_round()
    held = [h.request.index for h in sched._active.values()]
    assert held == [0, 1] and sched.num_queued == 4  # 6 + 8 pages held, 6 more needed, 4 free
    sched.run_until_idle(timeout_s=600)
    for i in range(6):
        tokens = [t for ev in events[i] for t in ev.token_ids]
        assert (events[i][-1].finish_reason, tokens) == ("length", s["solo"][i][:MAX_NEW]), i
    assert dec.pages.pool.usage == 0 and sched.metrics.counters["preemptions"] == 0


def test_vllm_names_of_the_pool_series():
    from d3d_jax.serving.metrics import ServerMetrics

    kv = dict(kv_cache_usage_perc=0.25, num_pages=64, num_free_pages=48, prefix_cache_queries=40,
              prefix_cache_hits=16)
    text = ServerMetrics(vllm_names=True).render(1, 0, 4, "plain", model="m", kv=kv)
    for line in ('vllm:kv_cache_usage_perc{model_name="m"} 0.25', 'vllm:prefix_cache_queries{model_name="m"} 40',
                 'vllm:prefix_cache_hits{model_name="m"} 16', 'vllm:num_preemptions{model_name="m"} 0',
                 "d3d_kv_pages_total 64"):
        assert line in text
    assert "kv_cache_usage_perc" not in ServerMetrics().render(1, 0, 4, "plain")  # a dense cache


def test_each_models_prefill_work_is_a_d3d_counter():
    from d3d_jax.serving.metrics import ServerMetrics

    kv = dict(num_pages=64, prefill_tokens_computed=120, prefill_tokens_reused=600,
              drafter_prefill_tokens_computed=120, drafter_prefill_tokens_reused=600)
    text = ServerMetrics(vllm_names=True).render(1, 0, 4, "sync", model="m", kv=kv)
    for line in ('d3d_prefill_tokens_total{model="target",source="computed"} 120',
                 'd3d_prefill_tokens_total{model="drafter",source="cached"} 600'):
        assert line in text
    plain = dict(kv, drafter_prefill_tokens_computed=None)
    del plain["drafter_prefill_tokens_computed"], plain["drafter_prefill_tokens_reused"]
    assert 'model="drafter"' not in ServerMetrics().render(1, 0, 4, "plain", kv=plain)


def _serve_config(*argv):
    p = S.add_arguments(argparse.ArgumentParser())
    return load_command_config(ServeConfig, p.parse_args(["--target", "t", *argv]))


TARGET = ModelConfig(max_position_embeddings=4096)  # 4 layers, 2 KV heads of 64, float32


def test_server_flags_size_the_pool_and_page_plain_mode_by_default():
    cfg = S.decoder_config(_serve_config("--max-model-len", "1024", "--kv-cache-tokens", "4096",
                                         "--max-num-seqs", "32", "--no-enable-prefix-caching",
                                         "--max-num-batched-tokens", "128"), TARGET, None)
    assert (cfg.mode, cfg.kv_page_size, cfg.kv_num_pages, cfg.num_slots) == ("plain", 16, 4096 // 16, 32)
    assert cfg.enable_prefix_caching is False and cfg.chunk_widths == (16, 32, 64, 128)
    cfg = S.decoder_config(_serve_config("--num-slots", "4", "--max-model-len", "256", "--kv-page-size", "64"),
                           TARGET, None)
    assert (cfg.kv_page_size, cfg.kv_num_pages, cfg.enable_prefix_caching) == (64, 4 * 256 // 64, True)
    assert S.decoder_config(_serve_config("--kv-page-size", "0"), TARGET, None).kv_page_size == 0


@pytest.mark.parametrize("argv,message", [
    (("--max-model-len", "1024", "--kv-cache-tokens", "1000"),
     "decoder.kv_cache_tokens: a pool of 62 pages of 16 tokens cannot hold one request of max_cache_len "
     r"\(--max-model-len\) 1024 \(64 pages\); give --kv-cache-tokens >= 1024"),
    (("--drafter", "d", "--mode", "async", "--kv-page-size", "16"), "decoder.kv_page_size: a paged cache serves modes plain, sync and auto, not async"),
])
def test_pool_flag_errors_name_the_field(argv, message):
    with pytest.raises(ConfigError, match=message):
        S.decoder_config(_serve_config(*argv), TARGET, ModelConfig(block_size=4) if "--drafter" in argv else None)


@pytest.mark.parametrize("argv,message", [
    (("--memory-utilization", "0"), "--memory-utilization/--gpu-memory-utilization: must be > 0"),
    (("--memory-utilization", "1.5"), "must be <= 1, got 1.5"),
    (("--kv-cache-tokens", "0"), "--kv-cache-tokens: must be >= 1"),
    (("--kv-page-size", "x"), "--kv-page-size: 'x' is not an integer"),
])
def test_bad_pool_flags_are_one_line_at_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit):
        _serve_config(*argv)
    assert message in capsys.readouterr().err


def _gpu(limit, in_use):
    return types.SimpleNamespace(platform="gpu", memory_stats=lambda: dict(bytes_limit=limit, bytes_in_use=in_use))


def test_an_accelerators_pool_is_what_the_memory_utilization_leaves():
    settings = _serve_config("--max-model-len", "512", "--max-num-seqs", "8",
                             "--memory-utilization", "0.5").decoder.resolved(
        has_drafter=False, kv_page_size=16)
    per_token = 2 * 4 * 2 * 64 * 4  # K and V x layers x KV heads x head dim x float32
    temporaries = 4 * TARGET.vocab_size * (2 * 512 + 4 * 8)
    limit, in_use = 1 << 30, 100 << 20
    want = int((limit * 0.5 - in_use - temporaries) // per_token) // 16
    assert kv_pool_pages(settings, TARGET, device=_gpu(limit, in_use)) == want
    assert kv_pool_pages(settings, TARGET, device=types.SimpleNamespace(platform="cpu")) is None
    with pytest.raises(ConfigError, match="decoder.memory_utilization: 0.5 of the device's memory leaves"):
        kv_pool_pages(settings, TARGET, device=_gpu(limit, limit // 2))
