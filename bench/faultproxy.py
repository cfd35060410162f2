"""A loopback HTTP proxy that injects faults between an S3 client and a real S3 server.

Every request is forwarded to the upstream server (moto in the tests); at ``rate`` one of the
``faults`` replaces the normal answer:

- ``error``: a 500 ``InternalError`` without forwarding (the request never took effect);
- ``lost``: forwarded (it took effect), then a 500 instead of the answer (an ambiguous failure:
  a retried create-only write finds its own object);
- ``reset``: forwarded; the headers and half of the body, then a TCP reset;
- ``stall``: forwarded; the headers and half of the body, then silence for ``stall_s`` seconds;
- ``nolength``: forwarded; the answer without ``Content-Length`` and with half of the body, then
  the connection closes (a short body nobody announced).

An answer without a fault goes out whole, or with ``piece_bytes`` in pieces of that many bytes
and ``piece_pause_s`` between them: a body that arrives a little at a time, as from a server
slower than its client.

``counts`` tells how many of each were injected (tests check that faults really happened).
Used as ``with FaultProxy(upstream, rate=0.05) as proxy: ... proxy.url``.
"""

from __future__ import annotations

import collections
import http.client
import random
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

FAULTS = ("error", "lost", "reset", "stall", "nolength")
_ERROR_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
    b"<Message>injected fault</Message></Error>"
)


class FaultProxy:
    def __init__(
        self,
        upstream: str,
        *,
        rate: float = 0.0,
        faults: tuple[str, ...] = FAULTS,
        stall_s: float = 2.0,
        seed: int = 0,
        delay_s: float = 0.0,
        keep_alive: bool = False,
        piece_bytes: int = 0,
        piece_pause_s: float = 0.0,
    ) -> None:
        unknown = set(faults) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}")
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.rate = rate
        self.faults = faults
        self.stall_s = stall_s
        self.counts: collections.Counter[str] = collections.Counter()
        self.requests = 0
        # Every request is held this long before it is forwarded, so that requests a client sends
        # at once are seen in flight together; ``in_flight`` / ``peak_in_flight`` count them, from
        # a request's arrival until its answer starts out. Not later: a client that has its answer
        # may send its next request before this thread is scheduled again, and a count that went
        # on to the end of the send would see one request more in flight than the client had.
        self.delay_s = delay_s
        self.in_flight = 0
        self.peak_in_flight = 0
        self.connections = 0  # client connections accepted (a client that reuses them opens few)
        # Drop the upstream's "Connection: close" (moto's server closes after every answer), so
        # that ``connections`` tells how the client reuses its connections.
        self.keep_alive = keep_alive
        self.piece_bytes = piece_bytes
        self.piece_pause_s = piece_pause_s
        # Called with (method, path, lower-cased headers) for every request: tests record what was asked.
        self.on_request: Callable[[str, str, dict[str, str]], None] | None = None
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._server: socketserver.ThreadingTCPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FaultProxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                with proxy._lock:
                    proxy.connections += 1
                proxy._serve(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _pick(self) -> str | None:
        with self._lock:
            self.requests += 1
            if self.rate <= 0 or self._rng.random() >= self.rate:
                return None
            fault = self._rng.choice(self.faults)
            self.counts[fault] += 1
            return fault

    def _arrived(self) -> None:
        with self._lock:
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        if self.delay_s:
            time.sleep(self.delay_s)

    def _left(self) -> None:
        with self._lock:
            self.in_flight -= 1

    # --- one client connection -------------------------------------------------------------

    def _serve(self, client: socket.socket) -> None:
        reader = client.makefile("rb")
        upstream: http.client.HTTPConnection | None = None
        try:
            while True:
                request = _read_request(reader)
                if request is None:
                    return
                method, target, headers, body = request
                if self.on_request is not None:
                    self.on_request(method, target, {k.lower(): v for k, v in headers})
                self._arrived()
                counted = True

                def answer_starts() -> None:
                    nonlocal counted
                    if counted:
                        counted = False
                        self._left()

                try:
                    fault = self._pick()
                    is_head = method == "HEAD"
                    if fault == "error":
                        answer_starts()
                        client.sendall(_response_bytes(500, "Internal Server Error", [], _ERROR_BODY, head=is_head))
                        continue
                    if upstream is None:
                        upstream = http.client.HTTPConnection(*self.upstream, timeout=60)
                    upstream.request(method, target, body=body, headers=dict(headers))
                    resp = upstream.getresponse()
                    data = resp.read()
                    dropped = ("transfer-encoding", "connection") if self.keep_alive else ("transfer-encoding",)
                    out_headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in dropped]
                    if method != "HEAD" and not any(k.lower() == "content-length" for k, _ in out_headers):
                        out_headers.append(("Content-Length", str(len(data))))
                    if resp.will_close:
                        upstream.close()
                        upstream = None
                    if fault == "lost":
                        answer_starts()
                        client.sendall(_response_bytes(500, "Internal Server Error", [], _ERROR_BODY, head=is_head))
                        continue
                    whole = _response_bytes(resp.status, resp.reason, out_headers, data, head=is_head)
                    if fault is None:
                        answer_starts()
                        self._send_in_pieces(client, whole)
                        continue
                    if fault == "nolength":
                        kept = [(k, v) for k, v in out_headers if k.lower() not in ("content-length", "connection")]
                        kept.append(("Connection", "close"))
                        head = _response_bytes(resp.status, resp.reason, kept, b"", head=True)
                        answer_starts()
                        client.sendall(head + data[: len(data) // 2])
                        return
                    cut = len(whole) - len(data) + len(data) // 2 if data else len(whole) // 2
                    answer_starts()
                    client.sendall(whole[:cut])
                    if fault == "stall":
                        time.sleep(self.stall_s)
                        return
                    # reset: abortive close, the client sees ECONNRESET. A moment first, so that the
                    # client reads what was sent (a reset discards data the peer has not read yet).
                    time.sleep(0.2)
                    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    return
                finally:
                    answer_starts()
        except (OSError, http.client.HTTPException):
            return
        finally:
            if upstream is not None:
                upstream.close()
            try:
                reader.close()
                client.close()
            except OSError:
                pass

    def _send_in_pieces(self, client: socket.socket, data: bytes) -> None:
        step = self.piece_bytes or len(data) or 1
        for at in range(0, len(data), step):
            if at and self.piece_pause_s:
                time.sleep(self.piece_pause_s)
            client.sendall(data[at : at + step])


def _read_request(reader) -> tuple[str, str, list[tuple[str, str]], bytes] | None:
    line = reader.readline(65537)
    if not line:
        return None
    method, target, _version = line.decode("latin-1").rstrip("\r\n").split(" ", 2)
    headers: list[tuple[str, str]] = []
    while True:
        h = reader.readline(65537)
        if h in (b"\r\n", b"\n", b""):
            break
        name, _, value = h.decode("latin-1").partition(":")
        headers.append((name.strip(), value.strip()))
    length = next((int(v) for k, v in headers if k.lower() == "content-length"), 0)
    if any(k.lower() == "transfer-encoding" and "chunked" in v.lower() for k, v in headers):
        body = _read_chunked(reader)
        headers = [(k, v) for k, v in headers if k.lower() != "transfer-encoding"]
        headers.append(("Content-Length", str(len(body))))
    else:
        body = reader.read(length) if length else b""
    return method, target, headers, body


def _read_chunked(reader) -> bytes:
    out = bytearray()
    while True:
        size = int(reader.readline().split(b";")[0].strip() or b"0", 16)
        if size == 0:
            while reader.readline() not in (b"\r\n", b"\n", b""):
                pass
            return bytes(out)
        out += reader.read(size)
        reader.readline()


def _response_bytes(status: int, reason: str, headers: list[tuple[str, str]], body: bytes, head: bool = False) -> bytes:
    if not head and not any(k.lower() == "content-length" for k, _ in headers):
        headers = [*headers, ("Content-Length", str(len(body)))]
    lines = [f"HTTP/1.1 {status} {reason}"] + [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (b"" if head else body)
