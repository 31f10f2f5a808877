"""Test set-up that must happen before JAX starts: 8 simulated CPU devices, offline HF, and one
persistent XLA compilation cache for the whole session."""
import os
import shutil
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# LLVM at -O0 for the test programs: the tiny models' runs are dominated by XLA's compiles, and
# test_decoder.py took 71 s against 101 s at the default level (user time 89 against 145 s).  It
# changes code generation only (XLA's HLO passes, fusion and fast-math settings are the same); a
# user's own XLA_FLAGS choosing a level win.  Servers and CLIs the tests start inherit it; the
# README test runs its commands in a user's shell, without it.
_FLAGS = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in _FLAGS:
    _FLAGS += " --xla_backend_optimization_level=0"
# XLA:CPU's older fusion code generator, for the same reason: a tiny auto decoder's warm-up took
# 20 s of CPU against 45 s with the MLIR fusion emitters (the programs' HLO is the same; only how
# each fusion becomes machine code differs).  A user's own choice wins here too.
if "xla_cpu_use_fusion_emitters" not in _FLAGS:
    _FLAGS += " --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = (_FLAGS + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One compilation cache for the session: this process, the pytest-xdist workers (they inherit
# this environment from the controller, which imports conftest first) and every CLI the tests
# start (JAX reads JAX_* variables at import).  The tiny test models compile the same programs
# again and again (each CLI run, each fresh jit of a rebuilt module); a hit loads the executable
# instead of running XLA.  Minimum compile time 0: on CPU most programs compile in under 1 s.
# Servers started by tests keep theirs in the same directory, out of the user's cache directory.
_OWN_CACHE = "D3D_COMPILE_CACHE" not in os.environ
os.environ.setdefault("D3D_COMPILE_CACHE", tempfile.mkdtemp(prefix="d3d-xla-cache-"))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ["D3D_COMPILE_CACHE"])
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_unconfigure(config):
    # the process that made the cache directory (the controller under xdist) removes it
    if _OWN_CACHE:
        shutil.rmtree(os.environ["D3D_COMPILE_CACHE"], ignore_errors=True)


# Files that take minutes, longest first (each file alone: user + sys of pytest and what it
# started, 2026-12-06 18:12-18:45 UTC, load average 3-4.7; docs/results/tests.md).  Under
# pytest-xdist (``make test``: --dist loadfile, one file per worker at a time) they start first, so
# the two workers end together on the short files instead of one running a long file alone at the
# end; the order inside a file, and of every other file, is kept.
LONG_FILES = ("test_serve_e2e.py", "test_readme.py", "test_programs.py", "test_compile.py", "test_loop.py",
              "test_auto.py", "test_regenerate.py", "test_async.py", "test_paged_decoding.py",
              "test_serve_openai.py", "test_engine.py", "test_decoder.py", "test_pipeline.py", "test_simulate.py",
              "test_pruning.py", "test_attention.py", "test_grammar.py", "test_regen_endpoint.py",
              "test_eval_cli.py", "test_train_checkpoints.py", "test_device_split.py", "test_generate_cli.py",
              "test_bench_gpu.py", "test_multiprocess.py", "test_auto_gate.py", "test_qwen3.py",
              "test_cli_errors.py", "test_demo.py", "test_paged_kv.py", "test_benchmarks.py", "test_hf_io.py",
              "test_config_json.py", "test_branches.py", "test_serve_shutdown.py", "test_records.py")


def pytest_configure(config):
    # pytest-xdist orders --dist loadfile's files by their number of tests unless told not to,
    # which put the README's file (three tests, one of them minutes long) near the end while the
    # other worker sat idle
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
