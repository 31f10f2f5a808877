"""The commands of the README and of docs/ that are marked to run, run as written.

A fenced ``bash`` or ``python`` block whose previous line is ``<!-- run -->`` is run: every
command of it, from the repository root, in order (the README first, then the docs pages), on the
shipped artifacts (what a fresh clone has after ``make demo``); a ``python infer/serve.py`` command
starts the server in the background for the ``curl`` and ``openai`` commands after it. The
checkout's ``git status`` is the same afterwards. Every other block is checked without running it
(``tests/test_docs.py``: its flags exist in the programs' parsers, its imports resolve); results
pages (``docs/results/``) are history and neither run nor checked. A marked block may not need
anything from outside the repository (:func:`skip_reason`).
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
RUN_MARK = "<!-- run -->"
TIMEOUT_S = 900

EXTERNAL = re.compile(r"""(^|[\s="'(])/(models|data)/|perfectblend|(^|\s)regenerated\.jsonl|runs/d3d-8b"""
                      r"|gcloud |srun ")


def code_blocks(text: str, marked: bool = False) -> list[tuple]:
    """``(language, body, first line number)`` of every fenced block, with ``marked`` also whether
    the line before its fence (blank lines skipped) is ``<!-- run -->``."""
    out, lang, body, start, last = [], None, [], 0, ""
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            if lang is None:
                lang, body, start, run = line[3:].strip() or "text", [], n + 1, last == RUN_MARK
            else:
                out.append((lang, "\n".join(body), start) + ((run,) if marked else ()))
                lang, last = None, ""
        elif lang is not None:
            body.append(line)
        elif line.strip():
            last = line.strip()
    return out


def bash_commands(body: str) -> list[str]:
    """Commands of a bash block: continuation lines and quoted newlines joined, comment-only
    lines dropped."""
    cmds, cur = [], ""
    for line in body.splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        cur += line
        try:
            shlex.split(cur, comments=True)
        except ValueError:  # an open quote: the command goes on on the next line
            cur += "\n"
            continue
        cmds.append(cur.strip())
        cur = ""
    return cmds


def skip_reason(lang: str, cmd: str) -> str | None:
    if EXTERNAL.search(cmd):
        return "needs a model, dataset or cluster from outside the repository"
    if lang == "bash" and re.search(r"(^|\s)\.\.\.($|\s|\")", cmd):
        return "arguments elided (...)"
    if lang == "bash" and (cmd.startswith("make ") or "pip install" in cmd):
        return "set-up that make demo / make test run themselves"
    if lang == "bash" and cmd.startswith("D3D_DISTRIBUTED=1"):
        return "one process of a multi-host launch"
    return None


def doc_pages() -> list[Path]:
    """The README, then every docs page but the results (history, not run)."""
    return [README] + [p for p in sorted(DOCS.rglob("*.md")) if DOCS / "results" not in p.parents]


def readme_commands(pages: list[Path] | None = None) -> list[tuple[str, str, str, int, str | None]]:
    """``(page, language, command, line, skip reason)`` of every command of the marked blocks."""
    out = []
    for page in doc_pages() if pages is None else pages:
        name = str(page.relative_to(REPO))
        for lang, body, line, run in code_blocks(page.read_text(encoding="utf-8"), marked=True):
            if not run:
                continue
            if lang == "bash":
                out += [(name, "bash", c, line, skip_reason("bash", c)) for c in bash_commands(body)]
            elif lang == "python":
                out.append((name, "python", body, line, skip_reason("python", body)))
            else:
                raise AssertionError(f"{name}:{line}: a marked block must be bash or python, not {lang}")
    return out


def _env() -> dict:
    """A user's shell: the venv's python first on PATH, none of the test session's JAX flags but
    its code generation choices (conftest: LLVM at -O0 and the older fusion emitters, compile
    time; what the commands print is not checked)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["XLA_FLAGS"] = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                                if f.startswith(("--xla_backend_optimization_level",
                                                 "--xla_cpu_use_fusion_emitters")))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _git_status() -> str | None:
    """``git status`` of what a command can leave behind: files other than Python and Markdown
    sources (which people edit in the same checkout while this long test runs)."""
    if not (REPO / ".git").exists() or shutil.which("git") is None:
        return None
    out = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout
    return "\n".join(line for line in out.splitlines() if not line.rstrip("/").endswith((".py", ".md")))


def test_marked_blocks_run_the_tour():
    cmds = readme_commands()
    unrunnable = [f"{page}:{line} ({reason}): {cmd[:60]}" for page, _, cmd, line, reason in cmds if reason]
    assert not unrunnable, "marked blocks that cannot run here:\n" + "\n".join(unrunnable)
    readme = [c for c in cmds if c[0] == "README.md"]
    assert len(readme) >= 8, [c[2][:60] for c in readme]
    joined = "\n".join(c[2] for c in readme)
    for needed in ("load_model(", "generate(", "infer/generate.py", "infer/serve.py", "curl ", "OpenAI(",
                   "train/train_drafter.py", "train/prune_drafter.py", "infer/bench.py compile"):
        assert needed in joined, needed
    assert any(c[0].startswith("docs/") for c in cmds)
    # the rules skip what they name, and only that
    assert skip_reason("bash", "python infer/bench.py eval --target /models/Qwen3-8B") is not None
    assert skip_reason("bash", "python infer/generate.py --target artifacts/demo/models/target") is None
    assert bash_commands("a \\\n  b\n# c\nd  # e\ne '{\n}'") == ["a    b", "d  # e", "e '{\n}'"]


def test_only_marked_blocks_run(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("x\n\n```bash\necho no\n```\n\n<!-- run -->\n\n```bash\necho yes\n```\n```python\nprint(1)\n```\n")
    blocks = code_blocks(page.read_text(), marked=True)
    assert [(b[1], b[3]) for b in blocks] == [("echo no", False), ("echo yes", True), ("print(1)", False)]


@pytest.mark.slow
def test_readme_commands_run_as_written():
    before = _git_status()
    env, server, log = _env(), None, []
    try:
        for page, lang, cmd, line, reason in readme_commands():
            where = f"{page}:{line}"
            if reason is not None:
                log.append(f"{where} skipped ({reason}): {cmd[:70]}")
                continue
            if lang == "bash" and cmd.startswith("python infer/serve.py"):
                t0 = time.time()
                server = _start_server(cmd, env, where)
                log.append(f"{where} READY in {time.time() - t0:.0f}s: {cmd[:70]}")
                continue
            if server is not None and not _talks_to_server(cmd):
                # the server's background warm-up would compile on beside the later commands
                _stop(server)
                server = None
            argv = ["bash", "-c", cmd] if lang == "bash" else [sys.executable, "-c", cmd]
            t0 = time.time()
            r = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
            tail = (r.stdout + r.stderr)[-3000:]
            assert r.returncode == 0, f"{where}: exit {r.returncode}: {cmd}\n{tail}"
            if _talks_to_server(cmd):
                assert r.stdout.strip(), f"{where}: no output from the server: {cmd}"
            log.append(f"{where} ok in {time.time() - t0:.0f}s: {cmd[:70]}")
    finally:
        if server is not None:
            _stop(server)
        print("\n".join(log))
    assert _git_status() == before, "a documented command changed the checkout"


def _talks_to_server(cmd: str) -> bool:
    return "curl " in cmd or "OpenAI(" in cmd


def _stop(server: subprocess.Popen) -> None:
    server.terminate()
    server.wait(timeout=60)


def _start_server(cmd: str, env: dict, where: str) -> subprocess.Popen:
    """The documented server command, in the background until it prints READY."""
    proc = subprocess.Popen(["bash", "-c", f"exec {cmd}"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline, seen = time.time() + 600, []
    while time.time() < deadline:
        out = proc.stdout.readline()
        if not out and proc.poll() is not None:
            break
        seen.append(out)
        if out.startswith("READY"):
            return proc
    proc.kill()
    raise AssertionError(f"{where}: the server never printed READY:\n{''.join(seen)[-3000:]}")
