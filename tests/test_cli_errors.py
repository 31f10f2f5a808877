"""Every command line ends a config error or a missing path with ONE line on
stderr (exit 2 usage, 1 runtime), no traceback; ``--debug`` brings the traceback back."""
import pytest

from cli_util import assert_one_line_error, run_script
from d3d_jax.cli import run_cli
from d3d_jax.config import ConfigError
from d3d_jax.errors import DataError

REPO_CONFIG = "configs/pipelines/demo.yaml"


def test_run_cli_maps_project_errors_to_one_line_and_an_exit_status(capsys):
    def fails(err):
        def main(argv):
            assert "--debug" not in argv
            raise err
        return main

    assert run_cli(fails(ConfigError("train.steps: must be >= 1\n(second line)")), []) == 2
    assert capsys.readouterr().err == "error: train.steps: must be >= 1; (second line)\n"
    assert run_cli(fails(DataError("x.jsonl: no usable records")), []) == 1
    assert capsys.readouterr().err == "error: x.jsonl: no usable records\n"
    assert run_cli(fails(FileNotFoundError(2, "No such file or directory", "/no/such")), []) == 2
    assert capsys.readouterr().err == "error: /no/such: No such file or directory\n"
    assert run_cli(lambda argv: 3, ["a"]) == 3 and run_cli(lambda argv: None, []) == 0
    with pytest.raises(KeyError):  # a bug keeps its traceback
        run_cli(fails(KeyError("bug")), [])
    with pytest.raises(ConfigError):  # and --debug keeps it for every error
        run_cli(fails(ConfigError("x")), ["--debug"])


@pytest.mark.parametrize("script,args,fragment", [
    ("train/train_drafter.py", ["objective.gamma=-1"], "objective.gamma: must be > 0, got -1"),
    ("train/train_drafter.py", ["train.stepz=3"], "train.stepz: unknown key"),
    ("train/train_drafter.py", ["--config", "/no/such.yaml"], "config file not found: /no/such.yaml"),
    ("train/regenerate_data.py", ["--prompts", "p.jsonl", "--out", "o.jsonl", "top_p=1.5"],
     "regenerate.top_p: must be <= 1, got 1.5"),
    ("train/regenerate_data.py", ["--prompts", "/no/such.jsonl", "--out", "o.jsonl", "--target", "/no/model"],
     "--prompts /no/such.jsonl: no such file"),
    ("train/prune_drafter.py", ["prune.drafter=d", "prune.target_layers=0"], "prune.target_layers: must be >= 1"),
    ("train/pipeline.py", ["--config", REPO_CONFIG, "nonsense=1"], "nonsense: unknown key"),
    ("infer/generate.py", ["--target", "/no/model", "--prompt-ids", "1"], "/no/model: not a directory"),
])
def test_config_errors_and_missing_paths_are_one_line(script, args, fragment):
    assert_one_line_error(run_script(script, *args), 2, fragment)


def test_missing_data_path_is_one_line_and_debug_shows_the_traceback(tmp_path):
    args = ["model.vocab_size=64", "model.num_layers=1", "model.hidden_size=32", "model.intermediate_size=64",
            "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16", "data.packed_length=96",
            "data.num_anchors=4", "data.block_size=8", "data.batch_size=8", "data.mask_token_id=3",
            "num_devices=1", f"train.out_dir={tmp_path}/run", f"data.train_path={tmp_path}/missing.jsonl"]
    assert_one_line_error(run_script("train/train_drafter.py", *args), 2,
                          f"{tmp_path}/missing.jsonl: No such file or directory")
    debug = run_script("train/train_drafter.py", "--debug", "objective.gamma=-1")
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "ConfigError" in debug.stderr


# ---- one error line everywhere, numbers bounded at the door ----------------------------------
import errno  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from cli_util import ROOT  # noqa: E402

DEMO = ROOT / "artifacts" / "demo"
TARGET, DRAFTER = DEMO / "models" / "target", DEMO / "drafters" / "small"


def _module(script: str):
    spec = importlib.util.spec_from_file_location(Path(script).stem + "_cli", ROOT / script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def assert_one_line(capsys, status: int, code: int, *fragments: str) -> str:
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert status == code and len(lines) == 1 and lines[0].startswith("error: "), (status, err[-2000:])
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


def _model_copy(tmp_path, src: Path, name: str, **config_changes) -> Path:
    """``src`` with its weights linked and config.json edited (``None`` deletes a key)."""
    out = tmp_path / name
    out.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            os.symlink(f, out / f.name)
    cfg = {**json.loads((src / "config.json").read_text()), **config_changes}
    (out / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return out


@pytest.mark.parametrize("err, code, line", [
    (OSError(errno.ENOSPC, "No space left on device", "/data/out.jsonl"), 1, "/data/out.jsonl: No space left on device"),
    (OSError(errno.EROFS, "Read-only file system", "/ro/run"), 2, "/ro/run: Read-only file system"),
    (OSError(errno.ELOOP, "Too many levels of symbolic links", "/loop"), 2, "/loop: Too many levels of symbolic links"),
    (FileExistsError(errno.EEXIST, "File exists", "/runs/out"), 2, "/runs/out: File exists"),
    (OSError(errno.EADDRINUSE, "Address already in use"), 1, "[Errno 98] Address already in use"),
    (OSError(errno.EXDEV, "Invalid cross-device link", "/a", None, "/b"), 2, "/a -> /b: Invalid cross-device link"),
])
def test_every_filesystem_and_resource_error_is_one_line(capsys, err, code, line):
    def main(argv):
        raise err

    assert run_cli(main, []) == code
    assert capsys.readouterr().err == f"error: {line}\n"


def test_serve_ends_through_run_cli_a_missing_target_is_one_line_exit_2():
    out = run_script("infer/serve.py", "--target", "/nonexistent")  # said "no tokenizer next to --target"
    assert_one_line_error(out, 2, "--target /nonexistent: not a directory")


def test_serve_refuses_a_bad_port_at_start_exit_2_without_a_traceback():
    out = run_script("infer/serve.py", "--target", TARGET, "--port", "70000")  # was an OverflowError traceback
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].endswith("argument --port: must be <= 65535, got 70000"), out.stderr


@pytest.mark.parametrize("args, code, fragment", [
    (["--target", "/nonexistent"], 2, "--target /nonexistent: not a directory"),
    (["--target", str(TARGET), "--mode", "sync"], 2, "decoder.mode: sync needs --drafter"),
    (["--target", str(TARGET), "--tokenizer", "/nonexistent"], 2, "--tokenizer /nonexistent: no tokenizer files"),
])
def test_serve_usage_errors_are_one_line_exit_2(capsys, args, code, fragment):
    serve = _module("infer/serve.py")
    assert_one_line(capsys, run_cli(serve.main, args), code, fragment)


def test_serve_a_corrupt_tokenizer_is_one_line(capsys, tmp_path):
    serve = _module("infer/serve.py")
    bad = _model_copy(tmp_path, TARGET, "target")
    os.unlink(bad / "tokenizer.json")
    (bad / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nope"')
    assert_one_line(capsys, run_cli(serve.main, ["--target", str(bad)]), 1, f"{bad}: cannot load the tokenizer")


@pytest.mark.parametrize("flags, fragment", [
    (["--mode", "sync", "--drafter", str(DRAFTER), "--block-size", "10000"], "--block-size: must be in [2, 256]"),
    (["--top-k", str(2 ** 40)], "--top-k: must be in [0, 2147483647] (0 = off)"),
    (["--seed", "-1"], "--seed: must be in [0, 2147483647], got -1"),
    (["--max-new-tokens", "0"], "--max-new-tokens: must be in [1, 1048576]"),
    (["--temperature", "nan"], "--temperature: expected a finite number"),
    (["--batch-size", "100000"], "--batch-size: must be in [1, 65536]"),
])
def test_generate_refuses_numbers_past_what_it_can_do_before_loading(capsys, flags, fragment):
    gen = _module("infer/generate.py")
    status = run_cli(gen.main, ["--target", "/not/loaded", "--prompt-ids", "1,2", *flags])
    assert_one_line(capsys, status, 2, fragment)


def test_generate_refuses_a_block_larger_than_the_drafter_was_trained_for(capsys):
    gen = _module("infer/generate.py")
    status = run_cli(gen.main, ["--target", str(TARGET), "--drafter", str(DRAFTER), "--mode", "sync",
                                "--prompt-ids", "5,6", "--block-size", "32", "--dtype", "float32"])
    assert_one_line(capsys, status, 2, "--block-size 32 is more than the drafter was trained for (16)")


@pytest.mark.parametrize("script, args", [
    ("infer/generate.py", ["--mode", "sync", "--prompt-ids", "5,6"]),
    ("infer/serve.py", ["--mode", "sync"]),
    ("infer/bench.py", ["--samples", "1"]),
])
def test_a_drafter_with_another_mask_id_than_the_tokenizer_is_refused(capsys, tmp_path, script, args):
    other = _model_copy(tmp_path, DRAFTER, "drafter", mask_token_id=5)
    argv = ["--target", str(TARGET), "--drafter", str(other), "--dtype", "float32", *args]
    status = run_cli(_module(script).main, ["eval", *argv] if script == "infer/bench.py" else argv)
    assert_one_line(capsys, status, 1, "config.json mask_token_id is 5 but the tokenizer's <|MASK|> is id 3")


@pytest.mark.parametrize("changes, code, fragment", [
    ({"eos_token_id": 99999}, 2, "config.json.eos_token_id: 99999 is outside the vocabulary [0, 2048)"),
    ({"vocab_size": 2048.0}, 2, "config.json.vocab_size: expected an integer, got 2048.0"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4, "finetuned": True}}, 2, "config.json.rope_scaling.finetuned"),
])
def test_config_json_values_are_refused_naming_the_key_not_the_tokenizer(capsys, tmp_path, changes, code, fragment):
    gen = _module("infer/generate.py")
    target = _model_copy(tmp_path, TARGET, "target", **changes)
    assert_one_line(capsys, run_cli(gen.main, ["--target", str(target), "--prompt", "to be"]), code, fragment)


def test_a_symlink_loop_is_one_line_naming_it(capsys, tmp_path):
    gen = _module("infer/generate.py")
    loop = tmp_path / "prompts.jsonl"
    os.symlink(loop, loop)
    status = run_cli(gen.main, ["--target", str(TARGET), "--prompts-file", str(loop), "--dtype", "float32"])
    assert_one_line(capsys, status, 2, f"{loop}: Too many levels of symbolic links")


def test_out_of_range_prune_target_layers_is_one_line(capsys):
    prune = _module("train/prune_drafter.py")
    status = run_cli(prune.main, [f"prune.drafter={DRAFTER}", "prune.target_layers=5", "data.train_path=t.jsonl",
                                  "data.dev_path=d.jsonl", "num_devices=1"])
    assert_one_line(capsys, status, 2, "prune.target_layers: must be in [1, 2] (the drafter", "has 2 layers), got 5")


def test_overrides_after_a_second_config_apply(capsys, tmp_path):
    train = _module("train/train_drafter.py")
    (tmp_path / "a.yaml").write_text("train:\n  steps: 7\n")
    (tmp_path / "b.yaml").write_text("train:\n  seed: 3\n")
    assert run_cli(train.main, ["--config", str(tmp_path / "a.yaml"), "train.log_every=5", "--config",
                                str(tmp_path / "b.yaml"), "train.eval_every=9", "num_devices=1", "--print-config"]) == 0
    train_cfg = json.loads(capsys.readouterr().out)["train"]
    assert (train_cfg["steps"], train_cfg["seed"], train_cfg["log_every"], train_cfg["eval_every"]) == (7, 3, 5, 9)


def test_an_output_path_under_a_file_is_one_line(capsys, tmp_path):
    regen = _module("train/regenerate_data.py")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "to be"}\n')
    (tmp_path / "file").write_text("")
    status = run_cli(regen.main, ["--target", str(TARGET), "--prompts", str(tmp_path / "prompts.jsonl"),
                                  "--out", str(tmp_path / "file" / "out.jsonl"), "--no-progress", "dtype=float32"])
    assert_one_line(capsys, status, 2, f"{tmp_path / 'file' / 'out.jsonl'}: {tmp_path / 'file'} is a file where a directory is needed")
