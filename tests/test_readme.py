"""The README's commands run as written (issue 15).

Every command of the README's ``bash`` and ``python`` blocks that needs nothing from outside this
repository runs from its root, in the README's order, on the shipped artifacts (what a fresh clone
has after ``make demo``), and the checkout's ``git status`` is the same afterwards.  A command is
left out only for a reason named in :func:`skip_reason` (a model or dataset path outside the
repository, a cluster, elided arguments, set-up that ``make`` itself runs); the test also checks
that those reasons leave most commands in.
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
TIMEOUT_S = 900

EXTERNAL = re.compile(r"""(^|[\s="'(])/(models|data)/|perfectblend|(^|\s)regenerated\.jsonl|runs/d3d-8b"""
                      r"|gcloud |srun ")


def code_blocks(text: str) -> list[tuple[str, str, int]]:
    """``(language, body, first line number)`` of every fenced block."""
    out, lang, body, start = [], None, [], 0
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            if lang is None:
                lang, body, start = line[3:].strip() or "text", [], n + 1
            else:
                out.append((lang, "\n".join(body), start))
                lang = None
        elif lang is not None:
            body.append(line)
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


def readme_commands() -> list[tuple[str, str, int, str | None]]:
    out = []
    for lang, body, line in code_blocks(README.read_text()):
        if lang == "bash":
            out += [("bash", c, line, skip_reason("bash", c)) for c in bash_commands(body)]
        elif lang == "python":
            out.append(("python", body, line, skip_reason("python", body)))
    return out


def _env() -> dict:
    """A user's shell: the venv's python first on PATH, none of the test session's JAX flags but
    its LLVM level (conftest: -O0, compile time; what the commands print is not checked)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["XLA_FLAGS"] = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                                if f.startswith("--xla_backend_optimization_level"))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _git_status() -> str | None:
    if not (REPO / ".git").exists() or shutil.which("git") is None:
        return None
    return subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout


def test_readme_parsing_keeps_most_commands():
    cmds = readme_commands()
    runnable = [c for c in cmds if c[3] is None]
    assert len(runnable) >= 12 and len(runnable) >= len(cmds) // 2, [c[1][:60] for c in runnable]
    joined = "\n".join(c[1] for c in runnable)
    for needed in ("infer/generate.py", "infer/serve.py", "curl ", "OpenAI(", "SpecDecoder(",
                   "train/launch_local.py", "infer/bench.py"):
        assert needed in joined, needed
    # the rules skip what they name, and only that
    assert skip_reason("bash", "python infer/bench.py eval --target /models/Qwen3-8B") is not None
    assert skip_reason("bash", "python infer/generate.py --target artifacts/demo/models/target") is None
    assert bash_commands("a \\\n  b\n# c\nd  # e\ne '{\n}'") == ["a    b", "d  # e", "e '{\n}'"]


@pytest.mark.slow
def test_readme_commands_run_as_written():
    before = _git_status()
    env, server, log = _env(), None, []
    try:
        for lang, cmd, line, reason in readme_commands():
            if reason is not None:
                log.append(f"README.md:{line} skipped ({reason}): {cmd[:70]}")
                continue
            if lang == "bash" and cmd.startswith("python infer/serve.py"):
                t0 = time.time()
                server = _start_server(cmd, env, line)
                log.append(f"README.md:{line} READY in {time.time() - t0:.0f}s: {cmd[:70]}")
                continue
            if server is not None and not _talks_to_server(cmd):
                # the server's background warm-up would compile on beside the later commands
                _stop(server)
                server = None
            argv = ["bash", "-c", cmd] if lang == "bash" else [sys.executable, "-c", cmd]
            t0 = time.time()
            r = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
            tail = (r.stdout + r.stderr)[-3000:]
            assert r.returncode == 0, f"README.md:{line}: exit {r.returncode}: {cmd}\n{tail}"
            if _talks_to_server(cmd):
                assert r.stdout.strip(), f"README.md:{line}: no output from the server: {cmd}"
            log.append(f"README.md:{line} ok in {time.time() - t0:.0f}s: {cmd[:70]}")
    finally:
        if server is not None:
            _stop(server)
        print("\n".join(log))
    assert _git_status() == before, "a README command changed the checkout"


def _talks_to_server(cmd: str) -> bool:
    return "curl " in cmd or "OpenAI(" in cmd


def _stop(server: subprocess.Popen) -> None:
    server.terminate()
    server.wait(timeout=60)


def _start_server(cmd: str, env: dict, line: int) -> subprocess.Popen:
    """The README's server command, in the background until it prints READY."""
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
    raise AssertionError(f"README.md:{line}: the server never printed READY:\n{''.join(seen)[-3000:]}")
