"""Issue 12 case 7: every command line ends a config error or a missing path with ONE line on
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
     "regenerate.top_p: must be in (0, 1], got 1.5"),
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
