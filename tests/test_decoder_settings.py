"""One config system for the decoding commands (d3d_jax/config/{decoding,serve,generate,evaluation,flags}.py):
YAML + flags + key=value in that order, checked at load with the key named, and derived decoder
defaults written once."""

from __future__ import annotations

import argparse

import pytest

from d3d_jax.config import (CONFIG_DIR, ConfigError, DecoderSettings, EvalConfig, GenerateConfig, ServeConfig,
                            add_config_arguments, config_flag, load_command_config, load_config)


def _parser():
    p = argparse.ArgumentParser()
    add_config_arguments(p, "x.yaml")
    config_flag(p, "--port", key="server.port", type=int)
    config_flag(p, "--mode", key="decoder.mode")
    config_flag(p, "--warmup-wait", key="server.warmup_wait", action="store_true")
    return p


def test_serve_demo_yaml_loads_and_layers_win_in_order():
    p = _parser()
    args = p.parse_intermixed_args(["--config", str(CONFIG_DIR / "serve" / "demo.yaml"), "--port", "0",
                                    "server.port=9", "decoder.num_slots=4"])
    cfg = load_command_config(ServeConfig, args)
    assert cfg.models.target == "artifacts/demo/models/target" and cfg.decoder.mode == "sync"
    assert cfg.server.port == 9  # key=value after the flag
    assert cfg.decoder.num_slots == 4 and cfg.server.warmup_wait is False  # an absent flag leaves the field
    args = p.parse_args(["--config", str(CONFIG_DIR / "serve" / "demo.yaml"), "--port", "0", "--warmup-wait"])
    cfg = load_command_config(ServeConfig, args)
    assert cfg.server.port == 0 and cfg.server.warmup_wait is True  # the flag over the file


@pytest.mark.parametrize("cls, overrides, key", [
    (ServeConfig, ["server.port=70000"], "server.port"),
    (ServeConfig, ["decoder.num_slots=0"], "decoder.num_slots"),
    (ServeConfig, ["decoder.mode=fast"], "decoder.mode"),
    (ServeConfig, ["decoder.mode=sync"], "decoder.mode"),  # sync without a drafter
    (ServeConfig, ["models.drafter=d", "decoder.mode=sync", "decoder.branch_fanout=3"], "decoder.branch_fanout"),
    (ServeConfig, ["models.drafter=d", "decoder.block_size=8", "decoder.branch_positions=9"],
     "decoder.branch_positions"),
    (ServeConfig, ["server.log_level=loud"], "server.log_level"),
    (ServeConfig, ["server.max_body_bytes=-1"], "server.max_body_bytes"),
    (GenerateConfig, ["generate.top_p=0"], "generate.top_p"),
    (GenerateConfig, ["generate.loop=gpu"], "generate.loop"),
    (EvalConfig, ["models.drafter=d", "eval.modes=sync,async"], "eval.modes"),
    (EvalConfig, ["models.drafter=d", "decoder.mode=sync"], "decoder.mode"),
    (EvalConfig, [], "models.drafter"),
])
def test_bad_values_fail_at_load_naming_the_key(cls, overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(cls, [], ["models.target=t", *overrides])


def test_target_is_required():
    with pytest.raises(ConfigError, match=r"models\.target: is required"):
        load_config(ServeConfig)


@pytest.mark.parametrize("given, drafter_block, mode, want", [
    # (settings, the drafter's trained B, resolved mode, (B, C, F))
    ({}, 16, "auto", (16, None, None)),
    ({}, None, "plain", (16, None, None)),
    ({"mode": "async"}, 16, "async", (16, 12, 2)),
    ({"mode": "async"}, 8, "async", (8, 8, 2)),  # C = min(12, B)
    ({"mode": "async", "block_size": 4, "branch_fanout": 3}, 16, "async", (4, 4, 3)),
    ({"mode": "sync", "block_size": 8}, 16, "sync", (8, None, None)),
])
def test_derived_defaults(given, drafter_block, mode, want):
    got = DecoderSettings(**given).resolved(has_drafter=drafter_block is not None, drafter_block_size=drafter_block,
                                            num_slots=8, max_cache_len=512)
    assert (got.mode, (got.block_size, got.branch_positions, got.branch_fanout)) == (mode, want)
    assert (got.num_slots, got.max_cache_len) == (8, 512)


def test_block_size_beyond_the_drafters_is_refused():
    with pytest.raises(ConfigError, match=r"decoder\.block_size: 32 is more than the drafter was trained for \(16\)"):
        DecoderSettings(block_size=32).resolved(has_drafter=True, drafter_block_size=16)


def test_eval_modes_share_the_decoder_section():
    cfg = load_config(EvalConfig, [], ["models.target=t", "models.drafter=d", "decoder.block_size=8",
                                       "decoder.branch_fanout=3", "eval.modes=plain,sync,async,auto"])
    async_, sync = cfg.mode_settings("async", 16), cfg.mode_settings("sync", 16)
    assert (async_.block_size, async_.branch_positions, async_.branch_fanout) == (8, 8, 3)
    assert (sync.block_size, sync.branch_positions, sync.branch_fanout) == (8, None, None)
    assert cfg.mode_settings("plain", 16).mode == "plain"
