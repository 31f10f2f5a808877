"""Signals, connections, health and start-up order of the server (d3d_jax/serving/server.py,
the scheduler's drain): on SIGTERM/SIGINT every stream ends with a final chunk carrying a
``finish_reason`` and ``[DONE]`` and a waiting client gets its response; half-sent requests are
closed; /health fails while the decoder cannot step; a busy port is found before the models load.  Over ``serve_fake.FakeDecoder`` (nothing
compiles); the signal cases run a real server process."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from serve_fake import TOKENIZER, FakeServer

ROOT = Path(__file__).resolve().parent.parent
LONG = {"model": "toy", "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tokenizer():
    from d3d_jax.io.hf import load_tokenizer

    return load_tokenizer(TOKENIZER)[0]


def _stream(host, port, out: dict) -> None:
    """A raw SSE reader: every ``data:`` payload, in order."""
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(dict(LONG, stream=True)),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    out["status"], out["data"] = r.status, []
    for line in r:
        line = line.decode().strip()
        if line.startswith("data: "):
            out["data"].append(line[6:])


def _plain(host, port, out: dict) -> None:
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(LONG), {"Content-Type": "application/json"})
    r = conn.getresponse()
    out["status"], out["body"] = r.status, json.loads(r.read())


def _check_ended(streamed: dict, plain: dict) -> None:
    assert streamed["status"] == 200 and streamed["data"][-1] == "[DONE]", streamed["data"][-3:]
    last = json.loads(streamed["data"][-2])
    assert last["choices"][0]["finish_reason"] == "abort", last
    assert 0 < len(streamed["data"]) - 1 < LONG["max_tokens"], "the stream ran to its end: no abort"
    assert plain["status"] == 200 and plain["body"]["choices"][0]["finish_reason"] == "abort", plain
    assert plain["body"]["usage"]["completion_tokens"] < LONG["max_tokens"]


def test_a_shutdown_ends_every_request_with_a_finish_reason(tokenizer):
    """uvicorn's exit handler (what SIGTERM calls) drains the scheduler first."""
    s = FakeServer(tokenizer, mode="sync", step_delay_s=0.05)
    try:
        streamed, plain = {}, {}
        threads = [threading.Thread(target=f, args=(s.http.host, s.http.port, o)) for f, o in
                   ((_stream, streamed), (_plain, plain))]
        for t in threads:
            t.start()
        t_end = time.monotonic() + 20
        while len(streamed.get("data", [])) < 3 or s.svc.scheduler.num_active < 2:
            assert time.monotonic() < t_end, "the requests did not start"
            time.sleep(0.02)
        s.http.server.handle_exit(signal.SIGTERM, None)  # was: streams cut at the grace's end
        for t in threads:
            t.join(10)
        _check_ended(streamed, plain)
        with pytest.raises(Exception):  # refused after the drain (503, or the listener is closed)
            s.svc.scheduler.submit(object(), lambda ev: None)
        s.http.thread.join(10)
        assert not s.http.thread.is_alive()
    finally:
        s.close()


SERVE = r"""
import socket, sys
from serve_fake import EOS, TOKENIZER, FakeConfig, FakeDecoder, Request
from d3d_jax.cli import run_cli
from d3d_jax.io.hf import load_tokenizer
from d3d_jax.serving.app import create_app
from d3d_jax.serving.server import bind, make_service, uvicorn_server

def main(argv):
    tok = load_tokenizer(TOKENIZER)[0]
    dec = FakeDecoder(FakeConfig(mode="sync", num_slots=4), step_delay_s=0.05)
    svc = make_service(dec, tok, (EOS,), model_name="toy", mode="sync", request_cls=Request)
    svc.scheduler.start()
    sock = bind("127.0.0.1", 0)
    sock.listen(128)
    print("READY", sock.getsockname()[1], flush=True)
    try:
        uvicorn_server(create_app(svc), "warning").run(sockets=[sock])
    finally:
        svc.scheduler.stop()

sys.exit(run_cli(main))
"""


@pytest.mark.parametrize("sig, code, inherited", [
    (signal.SIGTERM, -signal.SIGTERM, signal.SIG_DFL), (signal.SIGINT, 130, signal.SIG_DFL),
    # a background job of a non-interactive shell ("make test > log &") starts with SIGINT ignored:
    # such a server drained and exited 0
    (signal.SIGINT, 130, signal.SIG_IGN), (signal.SIGTERM, -signal.SIGTERM, signal.SIG_IGN)])
def test_a_signal_ends_streams_answers_waiting_clients_and_exits_conventionally(sig, code, inherited):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]), JAX_PLATFORMS="cpu")
    # the disposition is set, not inherited from however pytest itself was started
    proc = subprocess.Popen([sys.executable, "-c", SERVE], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=ROOT, preexec_fn=lambda: signal.signal(sig, inherited))
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY"), (line, proc.stderr.read() if proc.poll() is not None else "")
        port = int(line.split()[1])
        streamed, plain = {}, {}
        threads = [threading.Thread(target=f, args=("127.0.0.1", port, o)) for f, o in
                   ((_stream, streamed), (_plain, plain))]
        for t in threads:
            t.start()
        t_end = time.monotonic() + 20
        while len(streamed.get("data", [])) < 3:
            assert time.monotonic() < t_end, "the stream did not start"
            time.sleep(0.02)
        time.sleep(0.2)  # the non-streamed request is running too
        proc.send_signal(sig)
        for t in threads:
            t.join(15)
        _check_ended(streamed, plain)
        assert proc.wait(15) == code
        err = proc.stderr.read()
        assert "Traceback" not in err and "CancelledError" not in err, err[-3000:]
    finally:
        proc.kill()


def test_a_half_sent_request_head_is_closed(tokenizer, monkeypatch):
    from d3d_jax.serving import app as app_module
    from d3d_jax.serving import http_server

    monkeypatch.setattr(http_server, "HEADER_TIMEOUT_S", 0.5)
    monkeypatch.setattr(app_module, "BODY_TIMEOUT_S", 0.5)
    s = FakeServer(tokenizer, mode="sync")
    try:
        with socket.create_connection((s.http.host, s.http.port), timeout=5) as c:
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and nothing more
            t0 = time.monotonic()
            assert c.recv(1024) == b"" and time.monotonic() - t0 < 3  # was: open forever
        with socket.create_connection((s.http.host, s.http.port), timeout=5) as c:
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"model\"")  # a body that stops
            reply = c.recv(65536).decode()
            assert reply.split()[1] == "408" and "did not arrive" in reply, reply
        assert s.client.completions.create(model="toy", prompt="hi", max_tokens=3, temperature=0).choices
    finally:
        s.close()


def test_a_busy_port_is_refused_before_the_models_load():
    import argparse

    from d3d_jax.errors import UsageError
    from d3d_jax.serving.server import add_arguments, main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = add_arguments(argparse.ArgumentParser()).parse_args(
            ["--target", "/nonexistent/model", "--port", str(port), "--compile-cache", "none"])
        with pytest.raises(UsageError, match=rf"--port {port}: cannot listen there"):  # was: the target's error,
            main(args)  # after loading; with a real target, after minutes of compiling


def test_health_fails_while_every_step_fails_and_recovers(tokenizer, monkeypatch):
    """Was: /health 200 while every batch got a 500 (a damaged program of that width)."""
    s = FakeServer(tokenizer, mode="sync")
    try:
        real = s.dec.step
        damaged = IsADirectoryError(21, "Is a directory", "/srv/cache/programs/x")
        monkeypatch.setattr(s.dec, "step", lambda: (_ for _ in ()).throw(damaged))
        status, out = s.raw("POST", "/v1/completions", dict(LONG, max_tokens=4))
        assert status == 500 and "Is a directory" in out["error"]["message"]
        assert "/srv/cache" not in out["error"]["message"], out  # the server's paths stay its own
        status, body = s.raw("GET", "/health")
        assert status == 503 and "decoder step failed" in body["status"] and "/srv" not in body["status"]
        monkeypatch.setattr(s.dec, "step", real)
        assert s.raw("POST", "/v1/completions", dict(LONG, max_tokens=4))[0] == 200
        assert s.raw("GET", "/health")[0] == 200
    finally:
        s.close()
