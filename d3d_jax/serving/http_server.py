"""uvicorn around the app: the listening socket bound before the models load, an HTTP protocol
whose malformed-request 400 is OpenAI's error JSON and that closes a connection whose request
head never arrives, a server that drains the scheduler on SIGTERM/SIGINT and then ends as the
signal would, and :class:`ServerThread` (the same on a free localhost port in this process, for
tests and benchmarks).
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import threading
import time

from d3d_jax.serving import protocol as P

HEADER_TIMEOUT_S = 30.0  # a connection whose request line and headers are not in by then is closed
SHUTDOWN_GRACE_S = 5.0  # after SIGTERM/SIGINT: the aborted requests' last chunks go out in this


def _http_protocol():
    """uvicorn's h11 protocol whose malformed-request 400 (a bad Content-Length, ...) is OpenAI's
    error JSON rather than uvicorn's text/plain."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class JsonErrors(H11Protocol):
        """Also closes a connection that has not sent a whole request head within
        ``HEADER_TIMEOUT_S`` (uvicorn has no such timeout: half-sent requests stayed open).

        A client that half-closes its socket (``shutdown(SHUT_WR)``) after a whole request gets
        no answer, as from uvicorn itself, nginx (499) and Go's net/http: TCP delivers the same
        FIN for a half-close and a close, so keeping the connection open for the response would
        also keep every disconnected non-streaming request decoding to its last token, its slot
        held, where today the FIN cancels it at once."""

        _head_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_head_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head_timer()  # the next request's head, on a kept-alive connection

        def connection_lost(self, exc) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def _arm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._head_timeout)

        def _head_timeout(self) -> None:
            waiting = self.cycle is None or self.cycle.response_complete  # no request running
            if waiting and not self.transport.is_closing():
                self.transport.close()

        def send_400_response(self, msg: str) -> None:
            body = json.dumps(P.error_body(f"malformed HTTP request: {msg}")).encode()
            headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                       (b"content-length", str(len(body)).encode())]
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                          h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

    return JsonErrors


def uvicorn_config(app, log_level: str, grace_s: float):
    import uvicorn

    return uvicorn.Config(app, log_level=log_level, access_log=False, timeout_graceful_shutdown=grace_s,
                          http=_http_protocol())


def uvicorn_server(app, log_level: str, grace_s: float = SHUTDOWN_GRACE_S):
    """uvicorn's server, whose SIGTERM/SIGINT first drains the scheduler (every request ends now
    with finish_reason "abort": streams get their last chunk and ``[DONE]``, waiting clients their
    response) and then shuts down gracefully, rather than cutting streams at the grace's end."""
    import uvicorn

    class Draining(uvicorn.Server):
        caught: tuple = ()  # the signals that stopped a server run on the main thread

        def handle_exit(self, sig, frame) -> None:
            svc = getattr(app.state, "service", None)
            if svc is not None:
                svc.scheduler.drain()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn's own re-raises a caught signal into the handler the process inherited: one
            # started with SIGINT ignored (a background job of a script) drained and exited 0
            if threading.current_thread() is not threading.main_thread():
                yield  # signals reach only the main thread: this server is stopped by its owner
                return
            inherited = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in inherited.items():
                    signal.signal(sig, handler)
            self.caught = tuple(self._captured_signals)

        def run(self, sockets=None) -> None:
            super().run(sockets=sockets)
            exit_as_signalled(self.caught)

    return Draining(uvicorn_config(app, log_level, grace_s))


def exit_as_signalled(caught) -> None:
    """End as a process stopped by the last of ``caught`` does, whatever handlers it inherited:
    SIGINT raises KeyboardInterrupt (exit 130 from :func:`~d3d_jax.cli.run_cli`), SIGTERM ends
    the process by SIGTERM (-15 / 143)."""
    if not caught:
        return
    if caught[-1] == signal.SIGINT:
        raise KeyboardInterrupt
    signal.signal(caught[-1], signal.SIG_DFL)
    signal.raise_signal(caught[-1])


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the models load: a busy port is one line at once,
    not after minutes of loading and compiling.  The caller listens once it is about to serve."""
    from d3d_jax.errors import UsageError

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise UsageError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
    return sock


class ServerThread:
    """uvicorn serving ``app`` on ``host`` (a free port by default) in a background thread."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.server = uvicorn_server(app, log_level, 2)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="d3d-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> "ServerThread":
        self.thread.start()
        t_end = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > t_end:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        self.sock.close()
