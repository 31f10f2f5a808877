"""Run a command line of the project as a user would (a subprocess) and check how it ended."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_script(script: str, *args, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TF_CPP_MIN_LOG_LEVEL": "3"}
    return subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


def assert_one_line_error(out: subprocess.CompletedProcess, code: int, *fragments: str) -> str:
    """Exit status ``code``, exactly one stderr line (``error: …``) containing every fragment, no traceback."""
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert out.returncode == code, (out.returncode, out.stderr[-3000:])
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]
