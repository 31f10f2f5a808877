"""Size before work: every input is bounded before it is parsed, tokenized or quoted
in an error, and what still runs out ends in one line.  The YAML loader (d3d_jax/config/base.py),
run_cli (d3d_jax/cli.py) and regeneration's prompts (d3d_jax/training/regenerate.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from d3d_jax.cli import run_cli
from d3d_jax.config import TrainRunConfig
from d3d_jax.config.base import ConfigError, load_config, read_yaml

ROOT = Path(__file__).resolve().parent.parent
# ten levels of ten: 10**10 strings once expanded, a few hundred bytes on disk
BOMB = "a0: &a0 x\n" + "".join(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 11))


def test_a_yaml_alias_bomb_is_refused_quickly_without_quoting_it(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB + "train:\n  out_dir: *a10\n")
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        load_config(TrainRunConfig, [path])
    assert time.perf_counter() - t0 < 5 and "aliases" in str(e.value) and len(str(e.value)) < 300
    # one level under the limit still gets a short message naming the field (was: the value repr'd whole)
    path.write_text("base: &b [" + ", ".join(["xxxxxxxxxx"] * 1000) + "]\ntrain:\n  out_dir: *b\n")
    with pytest.raises(ConfigError) as e:
        load_config(TrainRunConfig, [path])
    assert str(e.value).startswith("base: unknown key") or "train.out_dir" in str(e.value)
    assert len(str(e.value)) < 400


def test_an_alias_bomb_in_an_override_is_refused():
    bomb = "[" + ", ".join(["&x0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"] + [
        f"&x{i} [{', '.join([f'*x{i - 1}'] * 10)}]" for i in range(1, 8)]) + "]"
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match="aliases"):
        load_config(TrainRunConfig, [], [f"train.out_dir={bomb}"])
    assert time.perf_counter() - t0 < 5  # was: 40 s walking 10**8 paths for long numbers first


def test_long_values_are_cut_short_in_errors(tmp_path):
    path = tmp_path / "long.yaml"
    path.write_text("train:\n  out_dir: [" + ", ".join(["y" * 100] * 5000) + "]\n")
    with pytest.raises(ConfigError) as e:
        load_config(TrainRunConfig, [path])
    assert "train.out_dir" in str(e.value) and len(str(e.value)) < 300


@pytest.mark.parametrize("text, words", [
    ("train:\n  steps: 3\n  steps: 4\n", "'steps' is given twice (lines 2 and 3)"),
    ("train:\n  steps: 3\noptim:\n  eps: 1.0e-8\ntrain:\n  seed: 1\n", "'train' is given twice (lines 1 and 5)"),
])
def test_duplicate_keys_and_sections_are_refused(tmp_path, text, words):
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        read_yaml(path)  # was: the last copy kept, silently
    assert words in str(e.value) and str(path) in str(e.value)


def test_merge_keys_are_not_duplicates(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("base: &b {steps: 3, seed: 1}\ntrain:\n  <<: *b\n  seed: 2\n")
    assert read_yaml(path)["train"] == {"steps": 3, "seed": 2}


def test_an_include_cycle_is_one_clear_error(tmp_path):
    me = tmp_path / "self.yaml"
    me.write_text("include: self.yaml\ntrain:\n  steps: 3\n")
    with pytest.raises(ConfigError, match=r"include: makes a cycle"):  # was: RecursionError
        read_yaml(me)
    (tmp_path / "a.yaml").write_text("include: b.yaml\n")
    (tmp_path / "b.yaml").write_text("include: a.yaml\n")
    with pytest.raises(ConfigError, match=r"a.yaml -> .*b.yaml -> .*a.yaml"):
        read_yaml(tmp_path / "a.yaml")
    (tmp_path / "e.yaml").write_text("include: 5\n")
    with pytest.raises(ConfigError, match=r"include: must be a file name or a list of them, got 5"):
        read_yaml(tmp_path / "e.yaml")  # was: TypeError
    (tmp_path / "c.yaml").write_text("include: [d.yaml, d.yaml]\n")  # the same file twice is no cycle
    (tmp_path / "d.yaml").write_text("train:\n  steps: 3\n")
    assert read_yaml(tmp_path / "c.yaml") == {"train": {"steps": 3}}


def test_non_finite_numbers_are_refused_where_declared():
    with pytest.raises(ConfigError, match="optim.learning_rate: must be finite"):
        load_config(TrainRunConfig, [], ["optim.learning_rate=.inf"])
    with pytest.raises(ConfigError, match="optim.b1: must be finite"):
        load_config(TrainRunConfig, [], ["optim.b1=.nan"])


@pytest.mark.parametrize("error, code, words", [
    (MemoryError(), 1, "out of host memory"), (RecursionError("maximum recursion depth exceeded"), 1, "nested too deeply")])
def test_run_cli_ends_memory_and_recursion_errors_in_one_line(capsys, error, code, words):
    def main(argv):
        raise error

    assert run_cli(main, []) == code
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and err.count("\n") == 1, err
    with pytest.raises(type(error)):
        run_cli(main, ["--debug"])


def test_a_huge_regeneration_prompt_is_skipped_before_it_is_tokenized(monkeypatch):
    from serve_fake import TOKENIZER

    from d3d_jax.io.chat import Prompt
    from d3d_jax.io.hf import load_tokenizer
    from d3d_jax.training import regenerate as rg

    tok = load_tokenizer(TOKENIZER)[0]
    rendered = []
    real = rg.render_prompt

    def render(tokenizer, messages, *template_kwargs):
        rendered.append(sum(len(m["content"]) for m in messages))
        return real(tokenizer, messages, *template_kwargs)

    monkeypatch.setattr(rg, "render_prompt", render)
    prompts = [Prompt("huge", [{"role": "user", "content": "word " * 2_000_000}], 1),
               Prompt("ok", [{"role": "user", "content": "Once upon a time"}], 2)]
    summary = rg.RegenerationSummary(output="o.jsonl")
    usable, ids, rejected = rg._render_all(prompts, tok, 100, len(tok), summary)
    assert [p.id for p in usable] == ["ok"] and rejected == 0
    assert max(rendered) < 1000, "the 10 MB prompt was tokenized"
    (line, why), = summary.skipped
    assert line == 1 and "characters" in why and "100 tokens" in why


def test_a_config_file_past_its_size_is_refused_unread(tmp_path, monkeypatch):
    from d3d_jax.config import yaml_files

    monkeypatch.setattr(yaml_files, "MAX_YAML_BYTES", 1000)
    path = tmp_path / "big.yaml"
    path.write_text("train:\n  out_dir: " + "x" * 2000 + "\n")
    with pytest.raises(ConfigError, match="a config file is at most 1,000"):
        read_yaml(path)


@pytest.mark.parametrize("text, words", [("[1, 2]", "top level must be an object"), ("{bad", "not valid JSON"),
                                         ("[" * 100_000 + "]" * 100_000, "not valid JSON")])
def test_a_malformed_config_json_is_one_clear_error(tmp_path, text, words):
    from d3d_jax.config.model import load_model_config

    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=words):  # was: AttributeError / JSONDecodeError tracebacks
        load_model_config(tmp_path)


LONG_INT = "9" * 5000  # Python refuses to convert past 4,300 digits, slowly before that
LONG_FLOAT = "1" + "0" * 400 + ".5"


@pytest.mark.parametrize("number", [LONG_INT, "-" + LONG_INT, LONG_FLOAT, "0x" + "f" * 200, "1" + "0" * 100])
def test_a_long_number_in_a_yaml_file_or_an_override_names_its_key(tmp_path, number):
    """Was: PyYAML's int() raised a bare ValueError traceback past 4,300 digits."""
    path = tmp_path / "run.yaml"
    path.write_text(f"train:\n  steps: {number}\n")
    with pytest.raises(ConfigError) as e:
        load_config(TrainRunConfig, [path])
    assert str(e.value).startswith(f"{path}: train.steps: a number of {len(number):,} characters; numbers are "
                                   "read up to 100")
    for override, key in ((f"train.steps={number}", "train.steps"), (f"train.steps=[1, {number}]", "train.steps[1]")):
        with pytest.raises(ConfigError) as e:
            load_config(TrainRunConfig, [], [override])
        assert str(e.value).startswith(f"{key}: a number of {len(number):,} characters"), str(e.value)


def test_a_hundred_character_number_is_still_read_and_range_checked():
    with pytest.raises(ConfigError, match="train.steps: must be <= "):
        load_config(TrainRunConfig, [], ["train.steps=" + "9" * 100])


def test_a_long_number_in_config_json_names_the_file_and_key(tmp_path):
    from d3d_jax.config.model import load_model_config
    from d3d_jax.io.hf import load_config as load_hf_config

    (tmp_path / "config.json").write_text('{"model_type": "qwen3", "rope_scaling": {"factor": ' + LONG_INT + "}}")
    for load in (load_model_config, load_hf_config):
        with pytest.raises(ConfigError) as e:
            load(tmp_path)
        assert str(e.value) == (f"{tmp_path / 'config.json'}: rope_scaling.factor: a number of 5,000 characters; "
                                "numbers are read up to 100 characters")


def test_a_long_number_in_a_safetensors_header_is_refused_by_name(tmp_path):
    from d3d_jax.errors import ModelFileError
    from d3d_jax.io.safetensors_io import SafetensorsFile

    blob = ('{"w": {"dtype": "F32", "shape": [' + LONG_INT + '], "data_offsets": [0, 4]}}').encode()
    (tmp_path / "x.safetensors").write_bytes(len(blob).to_bytes(8, "little") + blob + bytes(4))
    with pytest.raises(ModelFileError, match=r"x.safetensors: tensor w: shape \[a number of 5000 characters\]"):
        SafetensorsFile(tmp_path / "x.safetensors")


def test_a_long_number_in_a_benchmark_file_names_the_line_and_key(tmp_path):
    from d3d_jax.bench.evaluation.benchmarks import read_records
    from d3d_jax.errors import DataError

    (tmp_path / "b.jsonl").write_text('{"question": "q", "answer": 1}\n{"question": "q", "answer": ' + LONG_INT + "}\n")
    with pytest.raises(DataError, match=rf"^{tmp_path / 'b.jsonl'}:2: answer: a number of 5,000 characters"):
        read_records(tmp_path / "b.jsonl")
