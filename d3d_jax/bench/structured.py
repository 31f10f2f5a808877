"""Structured output on the demo's server, mode by mode: ten JSON-schema requests (each output
validated; greedy, so every mode must write the same), then 1 and 8 concurrent streams with and
without the schema side by side: tokens per wall second, τ, and the host's time per constrained
round (the drafts' copy and the masks, :mod:`~d3d_jax.decoding.constrained`).

    PYTHONPATH=. python -m d3d_jax.bench.structured plain,sync,auto structured.json
"""
import concurrent.futures as cf
import json
import sys
import time

import jsonschema
import numpy as np
import openai

from d3d_jax.config import load_config
from d3d_jax.config.serve import ServeConfig
from d3d_jax.serving.app import create_app
from d3d_jax.serving.server import ServerThread, load, make_service, warmup

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "count": {"type": "integer", "minimum": 1, "maximum": 20},
                                           "name": {"type": "string", "maxLength": 16}},
          "required": ["color", "count", "name"], "additionalProperties": False}
FMT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
PROMPTS = [f"Describe the {w} in one line." for w in
           ("sword", "crown", "letter", "ship", "garden", "tower", "river", "king", "storm", "ring")]


def run(mode: str) -> dict:
    cfg = load_config(ServeConfig, ["configs/serve/demo.yaml"], [f"decoder.mode={mode}", "server.compile_cache=none"]
                      + (["models.drafter=none"] if mode == "plain" else []))
    decoder, tok, eos, target = load(cfg)
    svc = make_service(decoder, tok, eos, model_name="demo", mode=mode)
    warmup(svc, [16, 32])
    svc.scheduler.start()
    http = ServerThread(create_app(svc)).start()
    client = openai.OpenAI(base_url=http.url + "/v1", api_key="x", max_retries=0, timeout=900)
    out = {"mode": mode}

    def one(i, constrained, max_tokens=64):
        kw = dict(response_format=FMT) if constrained else {}
        r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": PROMPTS[i % 10]}],
                                           max_tokens=max_tokens, temperature=0, **kw)
        return r.choices[0].message.content, r.usage.completion_tokens, (r.model_extra.get("spec_metrics") or {})

    texts = []
    for i in range(10):
        text, _, _ = one(i, True)
        jsonschema.validate(json.loads(text), SCHEMA)
        texts.append(text)
    out["texts"] = texts
    # every constrained round's programs at every batch width first: compiles are not timed
    for streams in (1, 8):
        with cf.ThreadPoolExecutor(streams) as ex:
            list(ex.map(lambda i: one(i, True, 16), range(streams)))
    masked = getattr(decoder.strategy, "_masked_rounds", None)
    for streams in (1, 8):
        for constrained in (False, True):
            if masked is not None:
                masked.host_seconds.clear()
            t0 = time.perf_counter()
            with cf.ThreadPoolExecutor(streams) as ex:
                res = list(ex.map(lambda i: one(i, constrained), range(streams * 2)))
            wall = time.perf_counter() - t0
            toks = sum(r[1] for r in res)
            taus = [r[2].get("tau") for r in res if r[2].get("tau")]
            host = list(masked.host_seconds) if masked is not None and constrained else []
            out[f"{streams}/{'json' if constrained else 'free'}"] = dict(
                tokens_per_s=toks / wall, tau=float(np.mean(taus)) if taus else None,
                host_ms_per_round=1e3 * float(np.mean(host)) if host else None, rounds=len(host))
    http.stop()
    svc.scheduler.stop()
    return out


if __name__ == "__main__":
    results = [run(m) for m in sys.argv[1].split(",")]
    json.dump(results, open(sys.argv[2], "w"), indent=1)
    print(json.dumps(results, indent=1))
