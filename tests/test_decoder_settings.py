"""One config system for the decoding commands (d3d_jax/config/{decoding,serve,generate,evaluation,flags}.py):
YAML + flags + key=value in that order, checked at load with the key named, and derived decoder
defaults written once."""

from __future__ import annotations

import argparse

import pytest

from d3d_jax.config import (CONFIG_DIR, ConfigError, DecoderConfig, EvalConfig, GenerateConfig, ServeConfig,
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
    (GenerateConfig, ["generate.max_new_tokens=0"], "generate.max_new_tokens"),
    (GenerateConfig, ["generate.loop=gpu"], "generate.loop"),
    (EvalConfig, ["models.drafter=d", "eval.modes=sync,async"], "eval.modes"),
    (EvalConfig, ["models.drafter=d", "decoder.mode=sync"], "decoder.mode"),
    (EvalConfig, [], "models.drafter"),
    (EvalConfig, ["models.drafter=d", "eval.benchmarks=[humaneval,eval.samples=4]"], "eval.benchmarks"),
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
    got = DecoderConfig(**given).resolved(has_drafter=drafter_block is not None, drafter_block_size=drafter_block,
                                            num_slots=8, max_cache_len=512)
    assert (got.mode, (got.block_size, got.branch_positions, got.branch_fanout)) == (mode, want)
    assert (got.num_slots, got.max_cache_len) == (8, 512)


def test_eval_modes_share_the_decoder_section():
    cfg = load_config(EvalConfig, [], ["models.target=t", "models.drafter=d", "decoder.block_size=8",
                                       "decoder.branch_fanout=3", "eval.modes=plain,sync,async,auto"])
    async_, sync = cfg.mode_settings("async", 16), cfg.mode_settings("sync", 16)
    assert (async_.block_size, async_.branch_positions, async_.branch_fanout) == (8, 8, 3)
    assert (sync.block_size, sync.branch_positions, sync.branch_fanout) == (8, None, None)
    assert cfg.mode_settings("plain", 16).mode == "plain"


# --------------------------------------------------------------------------------------------
# Every command that decodes builds the same decoder from the same settings
# --------------------------------------------------------------------------------------------
FIELDS = ("mode", "block_size", "branch_positions", "branch_fanout", "auto_sync_blocks", "auto_async",
          "prior_tau", "sample_drafts")


def _load_generate_cli():
    import importlib.util

    spec = importlib.util.spec_from_file_location("generate_cli", CONFIG_DIR.parent / "infer" / "generate.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli


def _serve(flags, target_cfg, drafter_cfg):
    from d3d_jax.serving import server

    args = server.add_arguments(argparse.ArgumentParser()).parse_intermixed_args(flags)
    return server.decoder_config(load_command_config(ServeConfig, args), target_cfg, drafter_cfg)


def _generate(flags, target_cfg, drafter_cfg):
    from d3d_jax.decoding.decoder_config import decoder_config

    cli = _load_generate_cli()
    args, cfg = cli.parse_args(flags + ["--prompt-ids", "1"])
    settings = cli.decoder_settings(cfg, drafter_cfg, 1)
    options = cli.mode_options(args, settings, cfg.models.drafter)
    return decoder_config(settings.mode, block_size=settings.block_size, num_slots=1, max_cache_len=256, **options)


def _eval(flags, target_cfg, drafter_cfg):
    from d3d_jax.bench.evaluation import cli
    from d3d_jax.bench.evaluation.runner import mode_fields
    from d3d_jax.decoding.decoder_config import decoder_config

    mode = flags[flags.index("--mode") + 1]
    rest = [f for i, f in enumerate(flags) if "--mode" not in (f, flags[i - 1] if i else None)]
    args = cli.add_arguments(argparse.ArgumentParser()).parse_args(rest + ["--modes", f"plain,{mode}"])
    settings = cli.eval_settings(load_command_config(EvalConfig, args), drafter_cfg.block_size, 10, devices=1)
    return decoder_config(mode, num_slots=1, max_cache_len=256, **mode_fields(settings, mode))


@pytest.mark.parametrize("flags", [["--mode", "sync"], ["--mode", "async"], ["--mode", "auto"],
                                   ["--mode", "async", "--block-size", "4"], ["--mode", "async", "--branch-fanout", "3"],
                                   ["--mode", "sync", "--block-size", "8"],
                                   ["--mode", "auto", "--auto-async", "none"]])
def test_serve_generate_and_eval_build_the_same_decoder(tmp_path, flags):
    """No command keeps defaults of its own: with the same flags and the same drafter (trained at
    B = 8, offline τ 3.5 in its result.json) the server, infer/generate.py and infer/bench.py eval
    build decoders whose every chosen field agrees, and agrees with the closed forms."""
    import json
    import types

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "result.json").write_text(json.dumps({"offline_tau_dev": 3.5}))
    target_cfg = types.SimpleNamespace(max_position_embeddings=4096)
    drafter_cfg = types.SimpleNamespace(block_size=8, mask_token_id=0)
    models = ["--target", str(tmp_path / "t"), "--drafter", str(tmp_path / "d")]
    built = {name: fn(models + flags, target_cfg, drafter_cfg) for name, fn in
             (("serve", _serve), ("generate", _generate), ("eval", _eval))}
    got = {name: {k: getattr(c, k) for k in FIELDS} for name, c in built.items()}
    assert got["serve"] == got["generate"] == got["eval"], got
    want_b = int(flags[flags.index("--block-size") + 1]) if "--block-size" in flags else 8
    cfg = built["serve"]
    assert cfg.block_size == want_b and cfg.mode == flags[1]
    if cfg.mode == "async":
        f = int(flags[flags.index("--branch-fanout") + 1]) if "--branch-fanout" in flags else 2
        assert (cfg.branch_positions, cfg.branch_fanout) == (min(12, want_b), f)
    assert cfg.prior_tau == (3.5 if cfg.mode == "auto" else None)
    if "--auto-async" in flags:
        assert cfg.auto_async == ()  # 'none': auto without async geometries


@pytest.mark.parametrize("given", [{"mode": "async", "block_size": 8}, {"mode": "async", "branch_fanout": 3},
                                   {"mode": "auto", "block_size": 4}, {"mode": "sync"}, {"mode": "plain"}, {}])
def test_a_library_config_resolves_with_the_library_defaults(given):
    """A DecoderConfig a program builds is resolved by the same rule a command's section is, with
    the library's slot count and cache length; resolving twice changes nothing."""
    from d3d_jax.config.decoding import DEFAULT_CACHE_LEN, DEFAULT_NUM_SLOTS, decoder_config

    config = DecoderConfig(**given)
    assert not config.is_resolved
    got = decoder_config(**{"mode": None, **given})
    assert got.is_resolved and (got.num_slots, got.max_cache_len) == (DEFAULT_NUM_SLOTS, DEFAULT_CACHE_LEN)
    assert got.mode == given.get("mode", "auto")  # no mode: auto, as with a drafter
    assert (got.mode == "async") == (got.branch_positions is not None)
    assert got.resolved(num_slots=1, max_cache_len=2) == got  # a resolved config keeps its values


def test_one_decoder_config():
    """The decoder's fields are declared once: no other config or decoding dataclass repeats them."""
    import dataclasses
    import importlib
    import pkgutil

    import d3d_jax.config
    import d3d_jax.decoding

    ours = {f.name for f in dataclasses.fields(DecoderConfig)}
    repeats = {}
    for pkg in (d3d_jax.config, d3d_jax.decoding):
        for info in pkgutil.iter_modules(pkg.__path__):
            module = importlib.import_module(f"{pkg.__name__}.{info.name}")
            for name, obj in vars(module).items():
                if dataclasses.is_dataclass(obj) and isinstance(obj, type) and obj is not DecoderConfig:
                    shared = ours & {f.name for f in dataclasses.fields(obj)}
                    if len(shared) >= 3:
                        repeats[f"{module.__name__}.{name}"] = sorted(shared)
    assert not repeats, repeats


@pytest.mark.parametrize("key", ["acceptance_rule", "acceptance_override", "eos_token_ids"])
def test_fields_only_programs_set_are_refused_in_a_section(key):
    with pytest.raises(ConfigError, match=rf"decoder\.{key}: is set by the program"):
        load_config(ServeConfig, overrides=["models.target=x", f"decoder.{key}=[1]"])
