"""Bad-input fuzz: 500 seeded random mutations of valid training records, config.json fields, prompt
files and safetensors files.  Every outcome is a success with the output an independent oracle
expects, or one of the project's own errors (:class:`D3DError`) — never another exception.
Fixed counts, no model is built: a few seconds."""
import importlib.util
import json
import random
import types

import numpy as np
import pytest

from d3d_jax.config import DataConfig, ModelConfig
from d3d_jax.errors import D3DError, DataError
from d3d_jax.io import hf
from d3d_jax.io import safetensors_io as st
from d3d_jax.training import data as D
from d3d_jax.training import regenerate as rg

from cli_util import ROOT

SEED = 12
COUNTS = {"records": 200, "config": 150, "prompts": 100, "safetensors": 50}  # 500 in all
VOCAB = 64
JUNK = [None, True, False, 0, -1, 3, 63, 64, 1.5, 2.0, float("inf"), "", "a", "7", "\u00ff", 2 ** 31, 2 ** 40,
        2 ** 70, -2 ** 70, [], [1, "a"], [[1]], {}, {"a": 1}, [True], [0.5], list(range(5))]


def mutate_value(rng: random.Random, value):
    """A junk value, or (for a list) the list with one element replaced, added or removed."""
    if isinstance(value, list) and value and rng.random() < 0.6:
        value = list(value)
        op = rng.randrange(3)
        i = rng.randrange(len(value))
        if op == 0:
            value[i] = rng.choice(JUNK)
        elif op == 1:
            value.insert(i, rng.choice(JUNK))
        else:
            del value[i]
        return value
    return rng.choice(JUNK)


def mutate_object(rng: random.Random, obj: dict, keys) -> dict:
    obj = json.loads(json.dumps(obj))
    for _ in range(rng.randint(1, 2)):
        key = rng.choice(list(keys) + list(obj))
        if key in obj and rng.random() < 0.25:
            del obj[key]
        else:
            obj[key] = mutate_value(rng, obj.get(key))
    return obj


def mutate_bytes(rng: random.Random, raw: bytes) -> bytes:
    """A flipped, inserted (0xFF) or truncated byte; never a newline (one record stays one line)."""
    op, i = rng.randrange(3), rng.randrange(len(raw) + 1)
    if op == 0 and i < len(raw):
        return raw[:i] + bytes([rng.choice([b for b in range(256) if b not in (10, 13)])]) + raw[i + 1:]
    if op == 1:
        return raw[:i] + b"\xff" + raw[i:]
    return raw[:i]


def mutated_lines(rng, base: list[dict], keys, n: int) -> list[bytes]:
    out = []
    for _ in range(n):
        obj = rng.choice(base)
        raw = json.dumps(mutate_object(rng, obj, keys) if rng.random() < 0.7 else obj).encode()
        out.append(mutate_bytes(rng, raw) if rng.random() < 0.3 else raw)
    return out


def parse(raw: bytes):
    """The oracle's own reading of a line: the object, or None if it is not UTF-8 JSON."""
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None


# ----------------------------------------------------------------------------------------------
def expected_record(raw: bytes, clean: int):
    """("kept", tokens, response_start) | ("invalid",) | ("empty",), decided independently."""
    obj = parse(raw)
    ids_ok = lambda v: isinstance(v, list) and all(type(t) is int and 0 <= t < VOCAB for t in v)  # noqa: E731
    if not isinstance(obj, dict) or not ids_ok(obj.get("response_token_ids", "missing")):
        return ("invalid",)
    prompt = obj.get("prompt_token_ids")
    if not ids_ok(prompt):  # None too: without a tokenizer messages cannot be rendered
        return ("invalid",)
    response = obj["response_token_ids"]
    if not response or len(prompt) >= clean:
        return ("empty",)
    return ("kept", (prompt + response)[:clean], len(prompt))


def test_fuzz_training_records(tmp_path):
    rng = random.Random(SEED)
    base = D.synthetic_records(8, vocab_size=VOCAB, prompt_len=3, response_len=12, seed=SEED)
    lines = [raw for raw in mutated_lines(rng, base, ("prompt_token_ids", "response_token_ids", "messages"),
                                          COUNTS["records"]) if raw.strip()]
    path = tmp_path / "records.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    cfg = DataConfig(packed_length=16 + 1 * 4, num_anchors=1, block_size=4, max_skipped_fraction=1.0)
    want = [expected_record(raw, cfg.clean_length) for raw in lines]
    examples, stats = D.load_examples(path, None, cfg, vocab_size=VOCAB)
    kept = [(n, w) for n, w in enumerate(want, 1) if w[0] == "kept"]
    assert stats.lines == len(lines) and stats.invalid == sum(w[0] == "invalid" for w in want)
    assert stats.empty_response == sum(w[0] == "empty" for w in want) and stats.kept == len(kept)
    for ex, (n, (_, tokens, start)) in zip(examples, kept):
        assert ex.line == n and ex.tokens.tolist() == tokens and ex.response_start == start
    assert 0.01 < stats.invalid / stats.lines < 0.9  # the mutations do hit both outcomes
    with pytest.raises(DataError, match="are invalid, more than data.max_skipped_fraction=0.01"):
        D.load_examples(path, None, DataConfig(packed_length=20, num_anchors=1, block_size=4), vocab_size=VOCAB)


# ----------------------------------------------------------------------------------------------
INT_KEYS = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
            "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
            "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim",
            "max_position_embeddings": "max_position_embeddings"}


def test_fuzz_config_json(tmp_path):
    rng = random.Random(SEED + 1)
    good = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, eos_token_id=[1, 2], mask_token_id=95, block_size=4).to_hf_dict()
    keys = list(good) + ["rope_scaling", "use_sliding_window", "attention_bias"]
    outcomes = {"ok": 0, "error": 0}
    for raw in mutated_lines(rng, [good], keys, COUNTS["config"]):
        (tmp_path / "config.json").write_bytes(raw)
        try:
            cfg = hf.load_config(tmp_path)
        except D3DError as e:
            assert str(e).startswith(str(tmp_path)), e  # every error names the directory or file
            outcomes["error"] += 1
            continue
        outcomes["ok"] += 1
        obj = parse(raw)
        cfg.validate()
        for key, ours in INT_KEYS.items():
            if obj.get(key) is not None:
                assert getattr(cfg, ours) == int(obj[key]), (key, obj[key])
        assert not any(isinstance(obj.get(k), str) for k in INT_KEYS)  # JSON strings are not numbers
        assert not any(isinstance(obj.get(k), float) for k in INT_KEYS)  # nor is 2048.0 an integer (transformers')
        eos = obj.get("eos_token_id")
        assert cfg.eos_token_id == eos and all(0 <= t < cfg.vocab_size for t in (eos if isinstance(eos, list) else
                                                                              [eos] if eos is not None else []))
    assert min(outcomes.values()) > 10, outcomes


# ----------------------------------------------------------------------------------------------
PROMPT_BASE = [
    {"id": "m", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "to be"}]},
    {"conversations": [{"from": "human", "value": "or not"}, {"from": "gpt", "value": "old"}]},
    {"prompt": "that is", "system": "s"},
    {"id": 7, "prompt": [{"role": "user", "content": [{"type": "text", "text": "the question"}]}]},
    {"prompt_ids": [5, 6, 7]},
]


def _generate_cli():
    spec = importlib.util.spec_from_file_location("generate_cli", ROOT / "infer" / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_fuzz_prompt_files(tmp_path):
    from d3d_jax.demo.tokenizer import train_tokenizer

    tok = hf.open_tokenizer(train_tokenizer(["to be or not to be, that is the question"] * 20, 300,
                                            tmp_path / "tok"))
    cli = _generate_cli()
    rng = random.Random(SEED + 2)
    keys = ("messages", "conversations", "prompt", "system", "id", "prompt_ids")
    lines = mutated_lines(rng, PROMPT_BASE, keys, COUNTS["prompts"])
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    # regeneration's reader: every non-blank line is a prompt or listed as malformed, never an exception
    prompts, malformed = rg.read_prompts(path)
    nonblank = [n for n, raw in enumerate(lines, 1) if raw.strip()]
    assert sorted([p.line for p in prompts] + [n for n, _ in malformed]) == nonblank
    assert len({p.id for p in prompts}) == len(prompts) and len(malformed) > 5 and len(prompts) > 5
    for p in prompts:
        assert p.messages and all(m["role"] in ("system", "user") and isinstance(m["content"], str)
                                  for m in p.messages)
    # generate's reader, one line a file: ids of the line, or a project error naming file:line
    ok = 0
    for n, raw in enumerate(lines):
        one = tmp_path / f"p{n}.jsonl"
        one.write_bytes(raw + b"\n")
        args = types.SimpleNamespace(prompt=[], prompt_ids=[], prompts_file=str(one), chat=False)
        try:
            (ids,) = cli.collect_prompts(args, tok, VOCAB * 5)
        except D3DError as e:
            assert str(e).startswith(f"{one}:1: ") or "no prompts" in str(e), e
            continue
        ok += 1
        obj = parse(raw)
        assert all(type(t) is int and 0 <= t < VOCAB * 5 for t in ids)
        if "prompt_ids" in obj:
            assert ids == obj["prompt_ids"]
        elif "messages" not in obj:
            assert ids == tok.encode(obj["prompt"], add_special_tokens=False)
    assert ok > 10


# ----------------------------------------------------------------------------------------------
def test_fuzz_safetensors(tmp_path):
    rng = random.Random(SEED + 3)
    arrays = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.arange(5, dtype=np.int64),
              "c": np.ones((2, 2, 2), np.float16)}
    st.write_file(tmp_path / "good.safetensors", arrays)
    good = (tmp_path / "good.safetensors").read_bytes()
    header_end = 8 + int.from_bytes(good[:8], "little")
    outcomes = {"ok": 0, "error": 0}
    for i in range(COUNTS["safetensors"]):
        raw = bytearray(good)
        op = rng.randrange(5)
        if op == 0:  # cut anywhere
            raw = raw[: rng.randrange(len(raw))]
        elif op == 1:  # a printable byte anywhere in the JSON header
            raw[rng.randrange(8, header_end)] = rng.randrange(32, 127)
        elif op == 2:  # a wrong header length
            raw[:8] = rng.randrange(0, 2 ** 20).to_bytes(8, "little")
        elif op == 3:  # other tensor bytes: still a valid file
            raw[rng.randrange(header_end, len(raw))] = rng.randrange(256)
        else:  # trailing bytes past the last tensor: still valid
            raw += bytes(rng.randrange(1, 9))
        path = tmp_path / f"m{i}.safetensors"
        path.write_bytes(bytes(raw))
        try:
            f = st.SafetensorsFile(path)
            got = {k: np.array(f.get(k)) for k in f.keys()}
        except D3DError as e:
            assert str(e).startswith(str(path)), e
            outcomes["error"] += 1
            continue
        outcomes["ok"] += 1
        header, start = st.read_header(path)
        for k, arr in got.items():  # what the header says, read from where it says
            info = header[k]
            assert list(arr.shape) == info["shape"] and st._NAMES[arr.dtype] == info["dtype"]
            lo, hi = info["data_offsets"]
            assert arr.tobytes() == bytes(raw[start + lo: start + hi])
    assert min(outcomes.values()) > 5, outcomes


# ----------------------------------------------------------------------------------------------
# A schema-driven fuzz of every server route (the toy decoder behind the real HTTP stack)
# ----------------------------------------------------------------------------------------------
SERVER_REQUESTS = 2000
HUGE = [2 ** 31, 2 ** 63, 2 ** 64, 10 ** 30, -10 ** 30, 10 ** 400, 1e308, -1e308, 1e-320]
TEXT_JUNK = ["\ud800", "a\udfffb", "", " ", "<|im_end|>", "\x00", "\u00ff" * 3, "x" * 5000]
DEEP = ["[" * 100_000 + "]" * 100_000, '{"a":' * 5000 + "1" + "}" * 5000, "[" * 40 + "1" + "]" * 40]


def _server_junk(rng: random.Random):
    pick = rng.randrange(4)
    if pick == 0:
        return rng.choice(HUGE)
    if pick == 1:
        return rng.choice(TEXT_JUNK)
    if pick == 2:
        return rng.choice(JUNK)
    return rng.choice([{"include_usage": True}, {"continuous_usage_stats": True, "x": 1}, {"5": 1}, {"5": 1e9},
                       {"99999": 1}, [{"role": "user", "content": "\ud800"}], [1.5, 2.0], [[1, 2], [3]],
                       ["a", "b"], [[]], [[1, "a"]], {"type": "json_object"}, "none", "auto", 20, 21, 0, 16, 17])


def _server_body(rng: random.Random, route: str):
    from d3d_jax.serving import protocol as P

    base = {"completion": {"model": "toy", "prompt": "To be", "max_tokens": 6, "temperature": 0},
            "chat": {"model": "toy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6},
            "tokenize": {"prompt": "To be"}, "detokenize": {"tokens": [5, 6, 7]}}[route]
    body = dict(base)
    keys = list(P.FIELDS.get(route, {})) + list(base) + ["unknown_field", "stream"]
    for _ in range(rng.randint(1, 3)):
        key = rng.choice(keys)
        body[key] = _server_junk(rng) if rng.random() < 0.8 else mutate_value(rng, body.get(key))
    if rng.random() < 0.3:
        body["stream"] = True
    return body


def _encode(rng: random.Random, body: dict) -> bytes:
    raw = json.dumps(body, ensure_ascii=True)  # lone surrogates travel as \ud800 escapes
    r = rng.random()
    if r < 0.03:
        return rng.choice(DEEP).encode()
    if r < 0.08:
        return mutate_bytes(rng, raw.encode())
    return raw.encode()


def test_fuzz_every_server_route_gets_no_5xx(tmp_path):
    import http.client
    import socket

    from serve_fake import FakeServer, TOKENIZER

    from d3d_jax.io.hf import load_tokenizer

    tok = load_tokenizer(TOKENIZER)[0]
    server = FakeServer(tok, mode="sync", num_slots=4)
    rng = random.Random(SEED + 4)
    paths = {"completion": "/v1/completions", "chat": "/v1/chat/completions", "tokenize": "/tokenize",
             "detokenize": "/detokenize"}
    gets = ["/v1/models", "/v1/models/toy", "/v1/models/%C3%BF%FF", "/health", "/metrics", "/version", "/ping",
            "/v1/nowhere", "/v1/models/toy/../x"]
    statuses = {}
    try:
        before = server.client.completions.create(model="toy", prompt="Once upon", max_tokens=12, temperature=0)
        conn = http.client.HTTPConnection(server.http.host, server.http.port, timeout=30)
        for i in range(SERVER_REQUESTS):
            r = rng.random()
            if r < 0.1:
                method, path, data = rng.choice(["GET", "HEAD"]), rng.choice(gets), None
            else:
                route = rng.choice(list(paths))
                method, path, data = "POST", paths[route], _encode(rng, _server_body(rng, route))
            try:
                conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                resp.read()
            except (http.client.HTTPException, OSError):  # the server closed a bad connection: reopen
                conn.close()
                conn = http.client.HTTPConnection(server.http.host, server.http.port, timeout=30)
                continue
            statuses[resp.status] = statuses.get(resp.status, 0) + 1
            assert resp.status < 500, (method, path, (data or b"")[:300], resp.status)
            if resp.getheader("connection") == "close":
                conn.close()
                conn = http.client.HTTPConnection(server.http.host, server.http.port, timeout=30)
        conn.close()
        # bad Content-Length values: OpenAI's error JSON, not uvicorn's text/plain
        for length in (b"abc", b"-1", b"1, 2", b"99999999999999999999"):
            with socket.create_connection((server.http.host, server.http.port), timeout=10) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: " + length + b"\r\n\r\n{}")
                reply = s.recv(65536).decode("latin-1")
            head, _, body = reply.partition("\r\n\r\n")
            assert head.split()[1] in ("400", "413"), (length, reply[:200])
            assert "application/json" in head and json.loads(body)["error"]["message"], (length, reply[:300])
        # a client that goes away in the middle of its body: no 500, nothing counted as one
        for _ in range(5):
            with socket.create_connection((server.http.host, server.http.port), timeout=10) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"model\"")
        server.wait_idle()
        after = server.client.completions.create(model="toy", prompt="Once upon", max_tokens=12, temperature=0)
        assert after.choices[0].text == before.choices[0].text
        errors = server.svc.scheduler.metrics.snapshot()["http_errors"]
        assert not any(code >= 500 for code in errors), errors
        assert sum(statuses.values()) >= 0.95 * SERVER_REQUESTS and statuses.get(200, 0) > 100, statuses
        assert statuses.get(400, 0) > 500, statuses  # the junk was refused, not served
        print("fuzz statuses", statuses)
    finally:
        server.close()
