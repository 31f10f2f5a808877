#!/usr/bin/env python
"""OpenAI-compatible streaming server around one speculative decoder (plain, sync or async).

  infer/serve.py --target PATH [--drafter PATH] --mode plain|sync|async|auto [--tokenizer DIR]
                 [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--num-slots 8] ...
  infer/serve.py --config configs/serve/demo.yaml [--port 0] [decoder.mode=async ...]

Flags and ``key=value`` overrides set fields of d3d_jax/config/serve.py's ServeConfig (a YAML
file's sections: models, decoder, server); later ones win: files, flags, overrides.

Routes: POST /v1/completions, POST /v1/chat/completions (SSE with "stream": true), GET /v1/models
and /v1/models/{id}, POST /tokenize and /detokenize, GET /version, /ping, GET|HEAD /health and
/metrics (Prometheus).  --compile-cache DIR keeps compiled programs across starts.  Prints ``READY http://HOST:PORT ...`` once it accepts
requests (``--port 0`` picks a free port).  The logic is in ``d3d_jax/serving/``.  Bad flags and
files end in one line on stderr (exit 2: flags and paths, 1: file contents); ``--debug`` shows
the traceback.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def main(argv=None):
    from d3d_jax.serving import server

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    server.add_arguments(p)
    return server.main(p.parse_intermixed_args(argv))  # key=value before or after the flags


if __name__ == "__main__":
    import sys

    from d3d_jax.cli import run_cli

    sys.exit(run_cli(main))
