"""The one HTTP server behind every HTTP port of RLEP: /metrics of every service and eval's REST API.

Threaded, one request per connection, and every connection bounded: at most `max_connections` at once (more get
503 at once), a request head of at most `max_head_bytes` (else 431) that must arrive within `head_timeout_s` (else
the connection is dropped), a body of at most `max_body_bytes` (else 413) that must arrive within `body_timeout_s`
of its head (a Content-Length larger than the body sent is dropped then, not waited for), and `write_timeout_s` to
write the reply. So a slow, half-sent or idle connection holds one thread for seconds and never blocks a probe.
Serves any WSGI app; an ASGI app (FastAPI) through `a2wsgi`.
"""

from __future__ import annotations

import io
import json
import logging
import socket
import ssl
import threading
import time
from socketserver import ThreadingMixIn
from wsgiref.simple_server import ServerHandler, WSGIRequestHandler, WSGIServer

from rlep.common.auth import DUPLICATE

log = logging.getLogger(__name__)

# A scraper or probe sends its ~300-byte request at once; Prometheus gives up on a scrape after
# 10 s by default, so a client that has not sent its head after 5 s is not one we want to wait for.
HEAD_TIMEOUT_S = 5.0
# A REST body (eval: at most 1 MiB) on a cluster network takes well under a second.
BODY_TIMEOUT_S = 10.0
# Writing the response (tens of KB) to a client that stopped reading must not hold a thread forever.
WRITE_TIMEOUT_S = 10.0
# Scrapers, probes and a few API clients need a handful of connections; the cap bounds threads under a flood.
MAX_CONNECTIONS = 32
# Request line plus headers; a scrape sends a few hundred bytes.
MAX_HEAD_BYTES = 16 * 1024
# Repeated headers as they came (wsgiref joins them with commas; the auth rule must see each one).
AUTH_KEY = "rlep.authorization"


class _RequestTooLarge(Exception):
    pass


class _DeadlineReader(io.RawIOBase):
    """Socket input that fails once `deadline` (monotonic) passes or more than `limit` bytes arrive; `rearm` sets
    new ones (the body's, once the head is in).

    A per-read socket timeout alone lets a client trickle one byte every few seconds forever.
    """

    def __init__(self, sock: socket.socket, deadline: float, limit: int):
        self._sock, self._deadline, self._left = sock, deadline, limit

    def rearm(self, deadline: float, limit: int) -> None:
        self._deadline, self._left = deadline, limit

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("request not received in time")
        self._sock.settimeout(remaining)
        n = self._sock.recv_into(buffer)
        self._left -= n
        if self._left < 0:
            raise _RequestTooLarge
        return n


class _SocketWriter(io.RawIOBase):
    def __init__(self, sock: socket.socket):
        self._sock = sock

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self._sock.sendall(data)
        return len(data)


class _Handler(WSGIRequestHandler):
    """One request per connection, read under the server's deadline and size limit."""

    error_content_type = "text/plain"
    error_message_format = "%(code)d %(message)s: %(explain)s\n"
    server: _Server

    def setup(self) -> None:
        self.connection = self.request
        self.connection.settimeout(self.server.head_timeout_s)
        deadline = time.monotonic() + self.server.head_timeout_s
        if self.server.ssl_context is not None:
            # Handshake here, on this connection's thread, so a slow client never stalls the accept loop.
            self.connection = self.server.ssl_context.wrap_socket(self.connection, server_side=True)
        self.reader = _DeadlineReader(self.connection, deadline, self.server.max_head_bytes)
        self.rfile = io.BufferedReader(self.reader)
        self.wfile = _SocketWriter(self.connection)

    reader: _DeadlineReader

    def handle(self) -> None:
        try:
            self.raw_requestline = self.rfile.readline(self.server.max_head_bytes + 1)
            if not self.raw_requestline or not self.parse_request():
                return  # client went away, or parse_request already answered 400/414/431
        except _RequestTooLarge:
            self.request_version, self.command, self.requestline = "HTTP/1.0", "", ""
            self.send_error(431, None, f"request head over the limit of {self.server.max_head_bytes} bytes")
            return
        if (refusal := self._body_refusal()) is not None:
            self.send_error(*refusal)
            return
        length = int(self.headers.get("Content-Length") or 0)
        # The body, if any, under its own deadline and its announced size: a shorter one fails at the deadline.
        self.reader.rearm(time.monotonic() + self.server.body_timeout_s, length)
        self.connection.settimeout(self.server.body_timeout_s)
        handler = ServerHandler(self.rfile, self.wfile, self.get_stderr(), self.get_environ(), multithread=True)
        handler.request_handler = self
        handler.run(self.server.get_app())

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Plain text by default; `{"detail": ...}` for a JSON API (its clients parse every answer as JSON)."""
        if not self.server.json_errors:
            super().send_error(code, message, explain)
            return
        body = json.dumps({"detail": explain or message or self.responses.get(code, ("",))[0]}).encode()
        self.send_response(code, message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Connection", "close")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD" and code >= 200 and code not in (204, 304):
            self.wfile.write(body)

    def _body_refusal(self) -> tuple[int, str, str] | None:
        length = self.headers.get("Content-Length")
        if "Transfer-Encoding" in self.headers:
            return 411, "Length Required", "send the body with a Content-Length"
        if length is not None and (not length.isdigit() or int(length) > self.server.max_body_bytes):
            return 413, "Content Too Large", f"request body over {self.server.max_body_bytes} bytes (or a bad length)"
        return None

    def get_environ(self) -> dict:
        environ = super().get_environ()
        environ[AUTH_KEY] = self.headers.get_all("Authorization") or []
        return environ

    def finish(self) -> None:
        super().finish()
        if self.connection is not self.request:
            self.connection.close()  # the TLS wrapper owns the file descriptor now

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib signature
        pass


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    block_on_close = False
    # socketserver's listen backlog is 5: a burst of connections (16 readers at once) overflows it, the kernel
    # drops the SYNs past it and their clients, a health probe among them, retry 1 s later.
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], ssl_context: ssl.SSLContext | None, limits: dict):
        self.ssl_context = ssl_context
        self.head_timeout_s, self.body_timeout_s = limits["head_timeout_s"], limits["body_timeout_s"]
        self.max_head_bytes, self.max_body_bytes = limits["max_head_bytes"], limits["max_body_bytes"]
        self.max_connections = limits["max_connections"]
        self.json_errors = limits["json_errors"]
        self._slots = threading.BoundedSemaphore(self.max_connections)
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, _Handler)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse(self, request: socket.socket) -> None:
        """Answers 503 without blocking the accept loop (plaintext only: TLS would need a handshake)."""
        try:
            if self.ssl_context is None:
                request.setblocking(False)
                request.send(
                    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n"
                    + f"over the limit of {self.max_connections} concurrent connections; retry\n".encode()
                )
        except OSError:
            pass
        self.shutdown_request(request)

    def handle_error(self, request, client_address) -> None:
        # Timeouts, resets and failed TLS handshakes are the client's business; never a traceback on stderr.
        log.debug("HTTP connection from %s failed", client_address, exc_info=True)


def one_authorization_header(app):
    """A WSGI app that refuses (401, JSON) a request with more than one `Authorization` header before `app` sees it.

    For an app behind a WSGI bridge (eval's FastAPI through a2wsgi): wsgiref joins repeated headers into one value,
    so the app alone would see one (wrong) token where the auth rule (rlep_common/auth.py) refuses two headers.
    """

    def guarded(environ, start_response):
        if len(environ.get(AUTH_KEY, ())) > 1:
            body = json.dumps({"detail": DUPLICATE}).encode()
            headers = [("Content-Type", "application/json"), ("WWW-Authenticate", "Bearer")]
            start_response("401 Unauthorized", [*headers, ("Content-Length", str(len(body)))])
            return [body]
        return app(environ, start_response)

    return guarded


class BoundedHttpServer:
    """Serves the WSGI `app` on `http(s)://host:port` from a background thread until `stop()`."""

    def __init__(
        self,
        app,
        host: str,
        port: int,
        ssl_context: ssl.SSLContext | None = None,
        *,
        name: str = "http",
        max_body_bytes: int = 0,
        head_timeout_s: float = HEAD_TIMEOUT_S,
        body_timeout_s: float = BODY_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
        max_head_bytes: int = MAX_HEAD_BYTES,
        json_errors: bool = False,
    ):
        limits = {
            "json_errors": json_errors,
            "head_timeout_s": head_timeout_s,
            "body_timeout_s": body_timeout_s,
            "max_connections": max_connections,
            "max_head_bytes": max_head_bytes,
            "max_body_bytes": max_body_bytes,
        }
        self._server = _Server((host, port), ssl_context, limits)
        self._server.set_app(app)
        self.port = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, name=name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the accept loop still runs (a health check's question)."""
        return self._thread.is_alive()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
