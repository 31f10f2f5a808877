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


def user_env() -> dict:
    """A user's shell: none of the test session's JAX settings (its 8 host devices, its platform),
    the venv's python first on PATH.  Only the session's compile-speed flags (conftest) go through:
    they change how fast XLA compiles, not what a command computes or prints."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    if os.environ.get("D3D_TEST_XLA_FLAGS"):
        env["XLA_FLAGS"] = os.environ["D3D_TEST_XLA_FLAGS"]
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def assert_one_line_error(out: subprocess.CompletedProcess, code: int, *fragments: str) -> str:
    """Exit status ``code``, exactly one stderr line (``error: …``) containing every fragment, no traceback."""
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert out.returncode == code, (out.returncode, out.stderr[-3000:])
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]
