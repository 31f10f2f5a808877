"""The README and docs/ stay true to the code, without running the commands (``test_readme.py``
runs the marked ones).

Every page of the README and of ``docs/``, ``docs/results/`` included, is checked for flags: each
flag a command passes to one of this repository's programs, in a command block or a backticked
command, exists in that program's argparse parser (taken from the program itself: what its
``--help`` offers); each backticked ``--flag`` of the text exists in the parser of a program named
beside it (its paragraph, its section or the page's opening; any program where none is named).
Outside ``docs/results/`` (history), each Python block compiles and its imports resolve. A flag
table marked ``<!-- flags: PROGRAM -->`` gives each flag's default as the code has it, and the
modes the docs name are the code's.  ``docs/configuration.md`` is what its generator writes, every
relative link and anchor resolves, no page outside ``docs/results/`` carries a commit hash or a
date, and no file of the repository (code, tests, configs, docs) an issue number.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import importlib
import importlib.util
import os
import re
import shlex
import sys
from pathlib import Path

import pytest

from test_readme import bash_commands, code_blocks

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
RESULTS = DOCS / "results"
README_MAX_LINES = 300

# programs whose flags the docs name; `infer/bench.py` also by subcommand
PROGRAMS = ("infer/generate.py", "infer/serve.py", "infer/bench.py", "train/train_drafter.py",
            "train/prune_drafter.py", "train/regenerate_data.py", "train/pipeline.py",
            "train/launch_local.py", "train/synthetic_data.py")
SCRIPT = re.compile(r"(?:\./)?((?:infer|train)/\w+\.py)")
# flags of other tools that the prose names in backticks
FOREIGN_FLAGS = {"--dist", "--worker", "--zone", "--command"}
# the config class each program reads (a flag whose dest is a dotted key sets a field; so does key=value)
CONFIGS = {"infer/generate.py": "GenerateConfig", "infer/serve.py": "ServeConfig", "infer/bench.py eval": "EvalConfig",
           "train/train_drafter.py": "TrainRunConfig", "train/prune_drafter.py": "PruneRunConfig",
           "train/regenerate_data.py": "RegenerateConfig", "train/pipeline.py": "PipelineConfig"}
FILE_NAME = re.compile(r"\.(py|json|jsonl|yaml|safetensors|md|png|txt)$")
OVERRIDE = re.compile(r"([a-z_]+(?:\.[a-z_0-9]+)+)=")


def pages(results: bool = False) -> list[Path]:
    """The README and the docs pages, ``docs/results/`` only when asked."""
    out = [REPO / "README.md"] + sorted(DOCS.rglob("*.md"))
    return [p for p in out if results or RESULTS not in p.parents]


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


# --------------------------------------------------------------------------------------------
# the programs' own parsers
# --------------------------------------------------------------------------------------------
class _Captured(Exception):
    pass


def _load_script(script: str):
    spec = importlib.util.spec_from_file_location(f"_docs_{Path(script).stem}", REPO / script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@functools.cache
def program_parser(script: str) -> argparse.ArgumentParser:
    """The parser ``script``'s ``main`` builds: ``main([])`` runs until it parses, and the parse
    call hands its parser back instead (``parse_known_args`` is left alone: ``infer/bench.py``
    pre-parses with it)."""
    methods = ("parse_args", "parse_intermixed_args", "parse_known_intermixed_args")
    saved = {m: getattr(argparse.ArgumentParser, m) for m in methods}
    env = dict(os.environ)

    def grab(self, *args, **kwargs):
        raise _Captured(self)

    try:
        for m in methods:
            setattr(argparse.ArgumentParser, m, grab)
        module = _load_script(script)
        try:
            module.main([])
        except _Captured as captured:
            return captured.args[0]
    finally:
        for m, f in saved.items():
            setattr(argparse.ArgumentParser, m, f)
        os.environ.clear()
        os.environ.update(env)  # some programs set XLA_FLAGS on import
    raise AssertionError(f"{script}: main([]) never parsed its arguments")


@functools.cache
def bench_commands() -> dict[str, str]:
    return {name: module for name, (module, _) in _load_script("infer/bench.py").COMMANDS.items()}


@functools.cache
def bench_parser(command: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    importlib.import_module(bench_commands()[command]).add_arguments(p)
    return p


def options(parser: argparse.ArgumentParser) -> set[str]:
    """The flags ``--help`` lists (a flag whose help is suppressed is not offered), and
    ``--debug``, which run_cli takes everywhere."""
    return {s for a in parser._actions if a.help is not argparse.SUPPRESS for s in a.option_strings} | {"--debug"}


@functools.cache
def every_flag() -> frozenset[str]:
    out = set()
    for script in PROGRAMS:
        out |= options(program_parser(script))
    for command in bench_commands():
        out |= options(bench_parser(command))
    return frozenset(out)


# --------------------------------------------------------------------------------------------
# commands in the docs
# --------------------------------------------------------------------------------------------
def _tokens(cmd: str) -> list[str]:
    try:
        toks = shlex.split(cmd, comments=True)
    except ValueError:
        toks = cmd.split()
    out = []
    for t in toks:  # a quoted command line (ssh --command "...") is walked too
        out += _tokens(t) if " " in t and SCRIPT.search(t) else [t]
    return out


def _flag_name(token: str) -> str | None:
    m = re.fullmatch(r"\[?(--[a-z][a-z0-9-]*)(=.*)?\]?", token)
    return m.group(1) if m else None


def invocations(cmd: str, with_args: bool = False) -> list[tuple]:
    """``(program, bench subcommand, flags for the program, flags for the subcommand)`` of every
    run of one of this repository's programs in a shell command (``with_args``: and its words)."""
    toks, out = _tokens(cmd), []
    for i, tok in enumerate(toks):
        m = SCRIPT.fullmatch(tok)
        if not m:
            continue
        args = []
        for t in toks[i + 1:]:
            if t in ("&&", "||", ";", "|", "--") or SCRIPT.fullmatch(t):
                break
            args.append(t)
        sub, split = None, len(args)
        if m.group(1) == "infer/bench.py":
            split = next((k for k, a in enumerate(args) if a in bench_commands()), len(args))
            sub = args[split] if split < len(args) else None
        flags = [f for f in map(_flag_name, args[:split]) if f]
        sub_flags = [f for f in map(_flag_name, args[split + 1:]) if f]
        out.append((m.group(1), sub, flags, sub_flags) + ((args,) if with_args else ()))
    return out


SHELL = ("bash", "sh", "shell", "console")


def doc_commands() -> list[tuple[str, int, str]]:
    """``(page, line, command)`` of every shell command in the README and docs, results included."""
    out = []
    for page in pages(results=True):
        for lang, body, line in code_blocks(page.read_text(encoding="utf-8")):
            if lang in SHELL:
                out += [(rel(page), line, c) for c in bash_commands(body)]
    return out


def test_commands_sit_in_blocks_that_are_checked():
    """A command in a ``text`` block would be neither run nor checked."""
    bad = [f"{rel(page)}:{line}: a {lang} block runs {SCRIPT.search(body).group(1)}: make it bash"
           for page in pages() for lang, body, line in code_blocks(page.read_text(encoding="utf-8"))
           if lang not in SHELL + ("python",) and SCRIPT.search(body)]
    assert not bad, "\n".join(bad)


def test_the_walker_finds_programs_and_their_flags():
    cmd = ('gcloud x --command "cd d && D3D_DISTRIBUTED=1 .venv/bin/python train/train_drafter.py --config a.yaml '
           'k=v" && python infer/bench.py --cpu-threads 1 serve --concurrency 1,4 [--mixed 4] && '
           'python train/launch_local.py -n 2 -- train/train_drafter.py --print-config')
    assert invocations(cmd)[0] == ("train/train_drafter.py", None, ["--config"], [])
    assert invocations(cmd, with_args=True)[0][4] == ["--config", "a.yaml", "k=v"]
    assert has_key(config_class("infer/serve.py"), "decoder.num_slots")
    assert not has_key(config_class("infer/serve.py"), "decoder.num_slot")
    assert invocations(cmd) == [("train/train_drafter.py", None, ["--config"], []),
                                ("infer/bench.py", "serve", ["--cpu-threads"], ["--concurrency", "--mixed"]),
                                ("train/launch_local.py", None, [], []),
                                ("train/train_drafter.py", None, ["--print-config"], [])]
    assert "--num-slots" in options(program_parser("infer/serve.py"))
    assert "--print-config" in options(program_parser("train/train_drafter.py"))
    assert "--small" in options(bench_parser("compile"))


def test_the_parsers_read_are_what_help_prints():
    """The parser taken from a program offers the flags its ``--help`` prints, no more: here for
    ``infer/bench.py programs``, whose ``--warm-up`` and ``--compare-with`` the docs name."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    printed = subprocess.run([sys.executable, "infer/bench.py", "programs", "--help"], cwd=REPO, env=env,
                             capture_output=True, text=True, check=True).stdout
    offered = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", printed))
    assert offered == {f for f in options(bench_parser("programs")) if f.startswith("--")} - {"--debug"}
    assert {"--warm-up", "--compare-with"} <= offered


def test_every_flag_a_documented_command_passes_exists():
    commands = doc_commands()
    assert len(commands) >= 30
    bad, seen = [], 0
    for page, line, cmd in commands:
        for program, sub, flags, sub_flags in invocations(cmd):
            seen += 1
            known = options(program_parser(program))
            bad += [f"{page}:{line}: {program} has no {f}" for f in flags if f not in known]
            if program == "infer/bench.py":
                if sub is None:
                    bad.append(f"{page}:{line}: infer/bench.py without a subcommand: {cmd[:80]}")
                    continue
                known = options(bench_parser(sub))
                bad += [f"{page}:{line}: infer/bench.py {sub} has no {f}" for f in sub_flags if f not in known]
    assert seen >= 25
    assert not bad, "\n".join(bad)


def config_class(program: str):
    import d3d_jax.config as config

    return getattr(config, CONFIGS[program]) if program in CONFIGS else None


def has_key(cls, key: str) -> bool:
    """Whether the dotted ``key`` names a field of config class ``cls`` (through its sections)."""
    for part in key.split("."):
        if not dataclasses.is_dataclass(cls):
            return False
        field = next((f for f in dataclasses.fields(cls) if f.name == part), None)
        if field is None:
            return False
        cls = field.default_factory if field.default is dataclasses.MISSING else None
        if cls is not None and not dataclasses.is_dataclass(cls):
            cls = None
    return True


def test_every_config_key_a_documented_command_sets_exists():
    bad, seen = [], 0
    for page, line, cmd in doc_commands():
        for program, sub, _, _, args in invocations(cmd, with_args=True):
            cls = config_class(f"{program} {sub}" if sub else program)
            for arg in args:
                m = OVERRIDE.match(arg)
                if m and cls is not None:
                    seen += 1
                    if not has_key(cls, m.group(1)):
                        bad.append(f"{page}:{line}: {program} {cls.__name__} has no {m.group(1)}")
    assert seen >= 10
    assert not bad, "\n".join(bad)


@functools.cache
def section_fields() -> dict[str, set]:
    """``{section name: its field names}`` over every command's config."""
    out: dict[str, set] = {}
    for program in CONFIGS:
        for f in dataclasses.fields(config_class(program)):
            if f.default is dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory):
                out.setdefault(f.name, set()).update(g.name for g in dataclasses.fields(f.default_factory))
    return out


def test_every_config_key_named_in_the_text_exists():
    """A backticked ``section.field`` (``train.remat_policy``, ``decoder.num_slots=4``) in the text
    names a field of that section."""
    bad, seen = [], 0
    for page in pages():
        for span in re.findall(r"`([a-z_]+\.[a-z_0-9.]+)(?:=[^`]*)?`", _prose(page.read_text(encoding="utf-8"))):
            section, _, rest = span.partition(".")
            if section not in section_fields() or FILE_NAME.search(span):  # model.safetensors is a file
                continue
            seen += 1
            if rest.split(".")[0] not in section_fields()[section]:
                bad.append(f"{rel(page)}: `{span}`: no config section {section} has {rest}")
    assert seen >= 20
    assert not bad, "\n".join(sorted(set(bad)))


def _prose(text: str) -> str:
    """The page without its fenced blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


# a backticked span, or a program named in plain text (``generate.py`` too), with the word after it
MENTION = re.compile(r"`([^`\n]+)`|(?<![\w/.])(?:\./)?((?:infer/|train/)?\w+\.py)(?: +([a-z][\w-]*))?")
LIST_ITEM = re.compile(r"\s*(?:[-*]|\d+\.) ")


def known_flags(program: str, sub: str | None) -> set[str]:
    """What ``program [sub] --help`` offers (``infer/bench.py``: its own flags and the subcommand's)."""
    out = options(program_parser(program))
    return out | options(bench_parser(sub)) if sub else out


def _named(script: str, word: str | None = None) -> tuple[str, str | None] | None:
    """``(program, bench subcommand)`` for a script name (``serve.py`` is ``infer/serve.py``)."""
    program = next((p for p in PROGRAMS if p == script or p.endswith("/" + script)), None)
    if program is None:
        return None
    return program, (word if program == "infer/bench.py" and word in bench_commands() else None)


def prose_flags(text: str) -> list[tuple]:
    """``(line, flag, span, programs)`` for every flag the prose of a page names.  A flag inside a
    backticked command belongs to that command (``programs`` holds just it); a backticked flag on
    its own belongs to one of the programs its paragraph, list item or table row names (a
    ``<!-- flags: PROGRAM -->`` table: that program), that its section named before it, or that
    the page's opening (before its first ``##``) names, command blocks included; where none is
    named, ``programs`` is empty: any program's flag."""
    out, unit, section, pending, opening = [], [], [], [], None
    block = None  # the language of the fenced block the line is in

    def close():
        programs = tuple(dict.fromkeys(unit + section))
        out.extend((line, flag, span, programs) for line, flag, span in pending)
        section.extend(p for p in unit if p not in section)
        pending.clear()
        unit.clear()

    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            close()
            if block in SHELL:
                section.extend((p, sub) for c in bash_commands("\n".join(body)) for p, sub, *_ in invocations(c))
            block, body = (line[3:].strip() or "text", []) if block is None else (None, [])
            continue
        if block is not None:
            body.append(line)
            continue
        if not line.strip() or line.startswith(("#", "|")) or LIST_ITEM.match(line):
            close()
            if line.startswith("##"):
                opening = list(section) if opening is None else opening
                section[:] = opening
        marker = re.fullmatch(r"<!-- flags: (.+?)( complete)? -->", line.strip())
        if marker:
            table = _named(*marker.group(1).split())
        if line.startswith("|") and marker is None and table:
            unit.append(table)
        elif not line.startswith("|"):
            table = None if not marker else table
        for m in MENTION.finditer(line):
            span, script, word = m.groups()
            if script:
                unit += [p for p in [_named(script, word)] if p]
            elif SCRIPT.search(span):
                for program, sub, flags, sub_flags in invocations(span):
                    unit.append((program, sub))
                    out.extend((n, f, span, ((program, sub),)) for f in flags + sub_flags)
            elif _named(*span.split()[:2]):  # `serve.py`, `bench.py eval`
                unit.append(_named(*span.split()[:2]))
            elif span.startswith("--"):
                pending += [(n, name, span) for part in span.split()[0].split("/") if (name := _flag_name(part))]
        if line.startswith("|"):
            close()
    close()
    return out


def test_prose_flags_belong_to_the_program_named_beside_them():
    text = ("# A\n\nNo program\n\n## A\n\n`infer/bench.py programs --modes a --warm-up`; also `--out`.\n\n"
            "`--slots` alone, later in the section.\n\n## B\n\n`--num-slots` of no program named here.\n\n"
            "```bash\npython infer/generate.py --x\n```\n\n- `--top-k` on serve.py\n- `--seed`\n\n"
            "<!-- flags: infer/serve.py -->\n| flag | default |\n|---|---|\n| `--port` | `8000` |\n")
    bench, generate, serve = ("infer/bench.py", "programs"), ("infer/generate.py", None), ("infer/serve.py", None)
    assert prose_flags(text) == [(7, "--modes", "infer/bench.py programs --modes a --warm-up", (bench,)),
                                 (7, "--warm-up", "infer/bench.py programs --modes a --warm-up", (bench,)),
                                 (7, "--out", "--out", (bench,)),
                                 (9, "--slots", "--slots", (bench,)),
                                 (13, "--num-slots", "--num-slots", ()),
                                 (19, "--top-k", "--top-k", (serve, generate)),
                                 (20, "--seed", "--seed", (generate, serve)),
                                 (25, "--port", "--port", (serve, generate))]
    # the page's opening names a program: every section reads its flags as that program's
    assert prose_flags("# P\n\n`serve.py` serves.\n\n## S\n\n`--port`\n") == [(7, "--port", "--port", (serve,))]


def test_every_flag_named_in_the_text_is_one_its_program_offers():
    """Every page, ``docs/results/`` too: a flag the prose names is in the ``--help`` of the
    program it is named with (or of some program, where the text names none)."""
    bad, seen = [], 0
    for page in pages(results=True):
        for line, flag, span, programs in prose_flags(page.read_text(encoding="utf-8")):
            seen += 1
            if flag in FOREIGN_FLAGS:
                continue
            known = set().union(*(known_flags(*p) for p in programs)) if programs else every_flag()
            if flag not in known:
                where = " or ".join(" ".join(filter(None, p)) for p in programs) or "no program"
                bad.append(f"{rel(page)}:{line}: `{span}`: {where} has no {flag}")
    assert seen >= 150
    assert not bad, "\n".join(bad)


def test_python_blocks_compile_and_their_imports_resolve():
    bad, seen = [], 0
    for page in pages():
        for lang, body, line in code_blocks(page.read_text(encoding="utf-8")):
            if lang != "python":
                continue
            seen += 1
            tree = ast.parse(body)  # a syntax error fails here, naming the line
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module:
                    module = importlib.import_module(node.module)
                    bad += [f"{rel(page)}:{line}: {node.module} has no {a.name}" for a in node.names
                            if not hasattr(module, a.name)]
                elif isinstance(node, ast.Import):
                    for a in node.names:
                        importlib.import_module(a.name)
    assert seen >= 4
    assert not bad, "\n".join(bad)


# --------------------------------------------------------------------------------------------
# flag tables: defaults as the code has them; modes
# --------------------------------------------------------------------------------------------
def flag_tables() -> list[tuple[str, int, str, bool, list[list[str]]]]:
    """``(page, line, program, complete, rows)`` of every table marked ``<!-- flags: PROGRAM -->``
    (``complete``: the table names every flag of the program)."""
    out = []
    for page in pages():
        lines = page.read_text(encoding="utf-8").splitlines()
        for n, text in enumerate(lines):
            m = re.fullmatch(r"<!-- flags: (.+?)( complete)? -->", text.strip())
            if not m:
                continue
            rows = []
            for row in lines[n + 3:]:  # after the header and its rule
                if not row.startswith("|"):
                    break
                rows.append([c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]])
            out.append((rel(page), n + 1, m.group(1), bool(m.group(2)), rows))
    return out


def _parser_for(program: str) -> argparse.ArgumentParser:
    if program.startswith("infer/bench.py "):
        return bench_parser(program.split()[1])
    return program_parser(program)


def code_default(program: str, flag: str):
    """``(value, derived)``: the flag's default, from the config dataclass when the flag sets a
    field; ``derived`` when the code computes it (None, or a default factory)."""
    action = _parser_for(program)._option_string_actions[flag]
    if action.default is not argparse.SUPPRESS or "." not in action.dest:
        return action.default, action.default is None
    import d3d_jax.config as config

    cls = getattr(config, CONFIGS[program])
    *sections, name = action.dest.split(".")
    for section in sections:
        cls = next(f for f in dataclasses.fields(cls) if f.name == section).default_factory
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    if field.default is dataclasses.MISSING:
        return None, True  # a default factory: computed
    return field.default, field.default is None


def _same(doc: str, value) -> bool:
    try:
        literal = ast.literal_eval(doc)
    except (ValueError, SyntaxError):
        return doc == str(value)
    return literal == value and type(literal) in (type(value), int) if value is not None else literal is None


def test_flag_tables_give_the_codes_defaults():
    tables = flag_tables()
    assert {t[2] for t in tables} >= {"infer/serve.py", "infer/generate.py"}
    bad = []
    for page, line, program, complete, rows in tables:
        known = options(_parser_for(program))
        named = set()
        for cells in rows:
            flags = re.findall(r"`(--[a-z][a-z0-9-]*)`", cells[0])
            assert flags, f"{page}:{line}: a row without a flag: {cells}"
            named.update(flags)
            missing = [f for f in flags if f not in known]
            if missing:
                bad.append(f"{page}:{line}: {program} has no {missing}")
                continue
            parts = [p.strip() for p in cells[1].split(" / ")]
            parts = parts if len(parts) == len(flags) else [cells[1].strip()] * len(flags)
            for flag, doc in zip(flags, parts):
                value, derived = code_default(program, flag)
                literal = re.fullmatch(r"`([^`]*)`", doc)
                if doc in ("off", "on"):
                    ok = value is (doc == "on")
                elif literal:
                    ok = _same(literal.group(1), value)
                else:  # words: the code derives the default
                    ok = derived
                if not ok:
                    bad.append(f"{page}: {program} {flag}: the docs say {doc!r}, the code's default is {value!r}")
        if complete:
            every = {f for f in known if f.startswith("--")} - {"--help", "--config", "--debug"}
            bad += [f"{page}:{line}: {program}'s {f} is not in the table" for f in sorted(every - named)]
    assert not bad, "\n".join(bad)


def test_the_docs_modes_are_the_codes():
    from d3d_jax.config.decoding import MODES, DecoderConfig

    # the behaviour the docs describe: auto with a drafter, plain without
    assert DecoderConfig().resolved(has_drafter=True).mode == "auto"
    assert DecoderConfig().resolved(has_drafter=False).mode == "plain"
    for program in ("infer/generate.py", "infer/serve.py"):
        assert tuple(program_parser(program)._option_string_actions["--mode"].choices) == MODES
    rows = [(page, cells) for page, _, _, _, rows in flag_tables() for cells in rows if "`--mode`" in cells[0]]
    assert len(rows) >= 2
    for page, cells in rows:
        assert re.findall(r"`(\w+)`", cells[2]) == list(MODES), (page, cells)
        assert "`auto`" in cells[1] and "`plain`" in cells[1] and "--drafter" in cells[1], (page, cells)
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    para = next(p for p in readme.split("\n\n") if p.startswith("`--mode` is"))
    assert re.findall(r"`(\w+)`", para.split(";")[0]) == list(MODES), para
    assert "the default is `auto` when `--drafter` is given" in " ".join(para.split()), para
    # no page lists fewer modes next to --mode
    stale = re.compile(r"plain, sync(,)? or async(?!, auto| or auto)|plain\|sync\|async(?!\|auto)")
    bad = [f"{rel(p)}: {line.strip()}" for p in pages() for line in p.read_text(encoding="utf-8").splitlines()
           if "--mode" in line and stale.search(line)]
    assert not bad, "\n".join(bad)


# --------------------------------------------------------------------------------------------
# the generated configuration page, links, and what stays out of the non-results pages
# --------------------------------------------------------------------------------------------
def test_configuration_page_is_generated_from_the_code():
    generator = _load_script("docs/generate_configuration.py")
    expected = generator.render()
    current = (DOCS / "configuration.md").read_text(encoding="utf-8")
    assert current == expected, "docs/configuration.md is stale: run python docs/generate_configuration.py"
    import d3d_jax.config as config

    for cls in (config.ServerSettings, config.DecoderConfig, config.TrainConfig):
        for field in dataclasses.fields(cls):
            assert f"| `{field.name}` |" in current, (cls.__name__, field.name)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    out, seen = set(), {}
    for line in _prose(text).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            s = slug(m.group(1))
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return out


def test_every_relative_link_and_anchor_resolves():
    bad = []
    for page in pages(results=True):
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", _prose(text)):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, frag = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{rel(page)}: {target}: no such file")
            elif frag and dest.suffix == ".md" and frag not in anchors(dest.read_text(encoding="utf-8")):
                bad.append(f"{rel(page)}: {target}: no such heading in {dest.name}")
    assert not bad, "\n".join(bad)


HISTORY = [(re.compile(r"\bissues? #?\d+", re.I), "an issue number"),
           (re.compile(r"\b20\d\d-\d\d-\d\d\b"), "a date"),
           (re.compile(r"`(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}`"), "a commit hash")]


def test_history_stays_in_docs_results():
    bad = []
    for page in pages():
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            bad += [f"{rel(page)}:{n}: {what}: {line.strip()[:100]}" for rx, what in HISTORY if rx.search(line)]
    assert not bad, "history belongs in docs/results/:\n" + "\n".join(bad)
    assert HISTORY[2][0].search("on `9d28424`") and not HISTORY[2][0].search("`1048576`")


ISSUE_NUMBER = re.compile(r"\bissues?[ -]?#?\d+", re.I)
# where a reader of the repository would meet an issue number they cannot look up
TREE = ("d3d_jax", "tests", "train", "infer", "configs", "docs", "README.md", "Makefile", "pyproject.toml")
TEXT_FILES = re.compile(r"(\.(py|md|yaml|yml|toml|txt|cfg|sh)|Makefile)$")


@functools.cache
def repo_lines() -> tuple[tuple[str, int, str], ...]:
    """``(file, line number, line)`` of every text file a reader of the repository meets."""
    files = [p for top in TREE for p in ([REPO / top] if (REPO / top).is_file() else (REPO / top).rglob("*"))
             if p.is_file() and TEXT_FILES.search(p.name)]
    assert len(files) > 200
    return tuple((rel(p), n, line) for p in files
                 for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1))


def test_no_issue_numbers_anywhere():
    """Code, docstrings, tests, configs and every docs page (results too) say what they mean;
    a reader has no issue tracker to look a number up in."""
    bad = [f"{f}:{n}: {line.strip()[:100]}" for f, n, line in repo_lines() if ISSUE_NUMBER.search(line)]
    assert not bad, "issue numbers (say what the change means instead):\n" + "\n".join(bad)
    n = "7"
    assert all(ISSUE_NUMBER.search(x) for x in (f"(issue {n})", f"Issue {n}'s", f"issues {n}, 23", f"issue-{n}",
                                                 f"issue #{n}"))
    assert not ISSUE_NUMBER.search("issued_bytes 12") and not ISSUE_NUMBER.search("the issue's note")


# files beside the checkout that a user does not have (the specification is docs/method.md)
OUTSIDE = re.compile(r"\.\./shared\b|\bD3D_SPEC\.md\b|\bshared/research\b")


def test_nothing_points_outside_the_repository():
    bad = [f"{f}:{n}: {line.strip()[:100]}" for f, n, line in repo_lines() if OUTSIDE.search(line)]
    assert not bad, "pointers to files a user does not have:\n" + "\n".join(bad)
    assert OUTSIDE.search("see ../" + "shared/X") and not OUTSIDE.search("train.out_dir=/mnt/shared/d3d-8b")


def test_results_pages_are_dated():
    for page in sorted(RESULTS.glob("*.md")):
        assert HISTORY[1][0].search(page.read_text(encoding="utf-8")), f"{rel(page)} carries no date"


def test_readme_is_short_and_indexes_every_page():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= README_MAX_LINES
    linked = {(REPO / t.partition("#")[0]).resolve() for t in re.findall(r"\]\(([^)#\s]+)", readme)}
    unlisted = [rel(p) for p in sorted(DOCS.rglob("*.md")) if p.resolve() not in linked]
    assert not unlisted, f"pages the README's index does not link: {unlisted}"
    # a vLLM user finds, from the README alone, a real Qwen3 decoded and served with a drafter on a
    # GPU, and a drafter trained on a TPU pod slice
    cmds = [c for lang, body, _ in code_blocks(readme) if lang == "bash" for c in bash_commands(body)]
    assert any("infer/generate.py" in c and "/models/Qwen3" in c and "--drafter" in c for c in cmds)
    assert any("infer/serve.py" in c and "/models/Qwen3" in c and "--drafter" in c for c in cmds)
    assert any("tpu-vm" in c and "D3D_DISTRIBUTED=1" in c and "train/train_drafter.py" in c for c in cmds)
    assert any("'.[gpu]'" in c for c in cmds)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
