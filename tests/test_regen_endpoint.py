"""Regeneration through an OpenAI-compatible server: the records the local path writes, a server
that fails or restarts mid-run loses nothing, and every id is written once."""
import json
import random
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from d3d_jax.training import regen_endpoint as ep
from d3d_jax.training import regenerate as rg

ROOT = Path(__file__).resolve().parent.parent
WORDS = "to be or not that is the question whether tis nobler in mind".split()


def _prompts(path, n, seed=0):
    r = random.Random(seed)
    lines = [json.dumps({"id": f"p{i}", "prompt": " ".join(r.choice(WORDS) for _ in range(r.randint(2, 9)))})
             for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _answer(messages):
    """The fake server's reply: ids any test can recompute from the prompt text."""
    text = messages[-1]["content"]
    return [len(w) for w in text.split()] + [7], [ord(c) % 50 for c in text]


class _Fake(BaseHTTPRequestHandler):
    """/v1/models, /v1/chat/completions (no prompt ids, as ours), /tokenize; fails on request."""

    plan: list = []  # per chat request, in order: "ok", 503, "drop", 400
    seen: list = []

    def log_message(self, *a):
        pass

    def _send(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send(200, {"data": [{"id": "fake-target"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize":
            return self._send(200, {"tokens": _answer(body["messages"])[1]})
        what = self.plan.pop(0) if self.plan else "ok"
        self.seen.append((body["seed"], what))
        _Fake.last = (self.headers.get("Authorization"), body)
        if what == "drop":
            self.connection.shutdown(socket.SHUT_RDWR)  # a server killed mid-answer
            return
        if what != "ok":
            return self._send(what, {"error": {"message": f"refused ({what})"}})
        ids = _answer(body["messages"])[0]
        self._send(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": "x"},
                                      "finish_reason": "stop", "token_ids": ids}]})


def _serve(port=0):
    server = ThreadingHTTPServer(("127.0.0.1", port), _Fake)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_failures_and_a_restart_lose_nothing_and_write_each_id_once(tmp_path):
    prompts = _prompts(tmp_path / "p.jsonl", 12)
    server = _serve()
    port = server.server_address[1]
    _Fake.plan, _Fake.seen = ["ok", 503, "drop", "ok", 502, 400], []
    endpoint = ep.Endpoint(f"http://127.0.0.1:{port}/v1", concurrency=3, request_timeout_s=5, retry_s=30)
    settings = rg.GenerationSettings(max_new_tokens=8, seed=5)
    down = threading.Event()

    def sleep(s):  # the server goes away for a while once, then comes back on its port
        if not down.is_set():
            down.set()
            server.shutdown()
            server.server_close()
            time.sleep(0.5)
            restarted.append(_serve(port))
        time.sleep(min(s, 0.05))

    restarted = []
    out = tmp_path / "out.jsonl"
    summary = ep.regenerate_via_endpoint(endpoint, prompts, out, settings=settings, progress=False,
                                         max_skipped_fraction=0.2, client=ep.Client(endpoint, sleep=sleep))
    records = [json.loads(x) for x in out.read_text().splitlines()]
    by_id = {p.id: p for p in rg.read_prompts(prompts)[0]}
    # one prompt refused (400): listed, not written; every other id exactly once, with the server's ids
    assert len(summary.skipped) == 1 and "HTTP 400" in summary.skipped[0][1]
    refused = summary.skipped[0][1].split("'")[1]
    assert sorted(r["id"] for r in records) == sorted(set(by_id) - {refused})
    for r in records:
        want, prompt_ids = _answer(by_id[r["id"]].messages)
        assert r["response_token_ids"] == want and r["prompt_token_ids"] == prompt_ids
        assert r["generation"]["seed"] == 5 and r["target"]["model"] == "fake-target"
    assert {s for s, _ in _Fake.seen} >= {rg.record_seed(5, i) for i in by_id}  # each row its own seed
    # a rerun asks only for the refused prompt
    _Fake.plan, _Fake.seen = [], []
    again = ep.regenerate_via_endpoint(endpoint, prompts, out, settings=settings, progress=False)
    assert again.already_done == 11 and again.written == 1 and len(_Fake.seen) == 1
    for s in restarted:
        s.shutdown()
        s.server_close()


def test_a_server_that_never_comes_back_stops_the_run_in_one_line(tmp_path):
    prompts = _prompts(tmp_path / "p.jsonl", 3)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = ep.Endpoint(f"http://127.0.0.1:{port}/v1", model="m", concurrency=2, retry_s=0.3)
    with pytest.raises(ep.EndpointError, match=r"no answer for 0s \(last: URLError"):
        ep.regenerate_via_endpoint(endpoint, prompts, tmp_path / "o.jsonl", settings=rg.GenerationSettings(),
                                   progress=False)
    assert (tmp_path / "o.jsonl").read_text() == ""


@pytest.mark.slow
def test_our_server_greedy_equals_the_local_path_and_a_killed_server_loses_nothing(tmp_path):
    """``infer/serve.py`` (demo target, plain): SIGKILLed after the first records and started again
    on its port; every prompt's record still equals the local path's greedy one."""
    from d3d_jax.bench.serve import ServerProcess
    from d3d_jax.io.checkpoint import load_model
    from d3d_jax.io.hf import open_tokenizer

    demo = ROOT / "artifacts" / "demo"
    prompts = _prompts(tmp_path / "p.jsonl", 8, seed=1)
    # 32 new tokens, not 64 (half the rounds, on the server and in the local reference): 6 of
    # the 8 records are still to come when the server is killed
    settings = rg.GenerationSettings.greedy(max_new_tokens=32, seed=1)
    tokenizer = open_tokenizer(str(demo / "tokenizer"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["--target", str(demo / "models" / "target"), "--tokenizer", str(demo / "tokenizer"), "--dtype",
            "float32", "--mode", "plain", "--num-slots", "2", "--max-model-len", "128", "--warmup-max-prompt", "16",
            "--port", str(port), "decoder.row_buckets=[2]"]  # one window width: a lone row runs padded
    # 128 tokens hold a prompt (17-30) and its answer: four prefill programs compiled at start-up,
    # not five (each 2-5 s of the cold start's 24)
    servers = [ServerProcess(argv, timeout_s=900)]
    out = tmp_path / "remote.jsonl"
    endpoint = ep.Endpoint(servers[0].url + "/v1", concurrency=2, retry_s=900)
    result = {}
    run = threading.Thread(target=lambda: result.update(s=ep.regenerate_via_endpoint(
        endpoint, prompts, out, settings=settings, tokenizer=tokenizer, progress=False)))
    try:
        run.start()
        while not out.exists() or len(out.read_text().splitlines()) < 2:
            time.sleep(0.1)
        servers[0].proc.kill()  # mid-run: requests are in flight
        servers[0].proc.wait()
        servers.append(ServerProcess(argv, timeout_s=900))
        run.join(900)
    finally:
        for s in servers:
            s.stop()
    assert result["s"].complete
    target = load_model(str(demo / "models" / "target"), dtype="float32")
    rg.regenerate(target, tokenizer, prompts, tmp_path / "local.jsonl", settings=settings, progress=False,
                  process_index=0, process_count=1)
    local = {r["id"]: r for r in map(json.loads, (tmp_path / "local.jsonl").read_text().splitlines())}
    remote = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["id"] for r in remote) == sorted(local)  # each id once
    for r in remote:
        want = local[r["id"]]
        assert r["response_token_ids"] == want["response_token_ids"], r["id"]
        assert r["prompt_token_ids"] == want["prompt_token_ids"] and r["finish_reason"] == want["finish_reason"]


def test_the_command_line_sends_its_flags_to_the_server(tmp_path, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("regenerate_data", ROOT / "train" / "regenerate_data.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    server = _serve()
    _Fake.plan, _Fake.seen = [], []
    prompts = _prompts(tmp_path / "p.jsonl", 4)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    try:
        assert cli.main(["--endpoint", f"http://127.0.0.1:{server.server_address[1]}/v1", "--concurrency", "2",
                         "--model", "served", "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl"),
                         "--seed", "4", "--no-progress", "--enable-thinking", "top_k=0"]) == 0
    finally:
        server.shutdown()
        server.server_close()
    records = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(r["target"]["model"] == "served" for r in records)
    assert records[0]["generation"] == {"temperature": 0.7, "top_p": 0.8, "top_k": 0, "max_new_tokens": 512,
                                        "seed": 4}
    assert records[0]["template"]["enable_thinking"] is True
    assert sorted(s for s, _ in _Fake.seen) == sorted(rg.record_seed(4, f"p{i}") for i in range(4))
    auth, body = _Fake.last
    assert auth == "Bearer sk-test" and body["model"] == "served" and body["top_k"] == -1
    assert body["chat_template_kwargs"] == {"enable_thinking": True} and body["return_token_ids"] is True
