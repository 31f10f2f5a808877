"""Test set-up that must happen before JAX starts: 8 simulated CPU devices, offline HF."""
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# servers started by tests keep their XLA compilation cache out of the user's cache directory
os.environ.setdefault("D3D_COMPILE_CACHE", tempfile.mkdtemp(prefix="d3d-xla-cache-"))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
