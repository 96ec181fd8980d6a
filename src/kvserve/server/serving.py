"""Running the app under uvicorn, hardened: bind first, header timeout, clean exits.

* `bind(host, port)` binds the listening socket before anything says "listening"; a port in use
  is a `PortInUse` whose message names the port (`kvserve serve` prints that one line, exit 2).
* `GuardedH11Protocol` closes a connection whose request line and headers have not all arrived
  within `header_timeout_s` (a slow-headers client would otherwise hold a socket forever; uvicorn
  only times out idle keep-alive connections). The body's timeout is per chunk, in gates/limits.py.
* `run(app, sock, settings)` serves until SIGTERM/SIGINT: uvicorn stops accepting, lets in-flight
  requests finish for `grace_s`, then cancels them (each releases its engine requests and writes
  the usage ledger as it ends), then the lifespan shuts the engine down. When the model cannot
  load, the server stops and `run` returns 1 (the CLI exits non-zero with the load error).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import signal
import socket
import threading

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvserve.errors import KVServeError


class PortInUse(KVServeError):
    pass


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (IPv6 when host has a colon)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose proto says TCP.
    # With Nagle on, a keep-alive connection's response waited ~40 ms for the client's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise PortInUse(f"port {port} on {host} is already in use; stop the other server or pass "
                            "--port with a free port") from None
        raise PortInUse(f"cannot listen on {host}:{port} ({e.strerror})") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def guarded_h11(header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline on each request's line and headers."""

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._between_requests():
                self._arm()          # the first byte of a request: its headers are now on the clock
            super().data_received(data)
            if not self._between_requests():
                self._disarm()       # the request line and headers are complete

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()   # arms uvicorn's keep-alive timer for the idle wait

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self._between_requests() and not self.transport.is_closing():
                self.transport.close()

    return GuardedH11Protocol


class _Server(uvicorn.Server):
    """uvicorn's server, except that a SIGTERM/SIGINT that shut it down cleanly is not raised again
    afterwards (uvicorn re-raises it, so the process would die of the signal instead of exit 0)."""

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        sigs = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def run(app, sock: socket.socket, *, header_timeout_s: float = 10.0, grace_s: float = 5.0) -> int:
    """Serve `app` on the bound `sock` until a signal; 1 when the model failed to load, else 0."""
    config = uvicorn.Config(app, log_level="warning", access_log=False, http=guarded_h11(header_timeout_s),
                            timeout_graceful_shutdown=grace_s)
    server = _Server(config)
    state = app.state.server
    failed: list[str] = []

    def on_load_failed(message: str) -> None:
        failed.append(message)
        server.should_exit = True

    state.on_load_failed = on_load_failed
    server.run(sockets=[sock])
    return 1 if failed else 0
