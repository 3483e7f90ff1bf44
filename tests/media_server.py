"""A local HTTP server that plays the remote image host of URL-source tests (threaded `http.server` on 127.0.0.1).

Paths: `/cat.png` (a PNG), `/big` (more bytes than any test cap, Content-Length given), `/big-chunked` (the same
without a length), `/slow` (headers, then one byte every 0.1 s), `/gzip` (a gzip-encoded PNG), `/missing` (404),
`/redirect?to=URL` (302 to URL), `/loop` (redirects to itself). Every request is recorded (path and Host header),
so a test can assert that a refused URL never reached it.
"""

from __future__ import annotations

import gzip
import io
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import numpy as np
from PIL import Image

BIG_BYTES = 3 * 1024 * 1024
"""Size of `/big`: past the 2 MiB `--max-upload-bytes` the URL tests run with."""


def png_bytes(width: int = 48, height: int = 32, seed: int = 0) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")).save(buffer, "PNG")
    return buffer.getvalue()


@dataclass
class MediaServer:
    """The running server: its base URL and what it was asked for."""

    port: int
    image: bytes
    requests: list[tuple[str, str]] = field(default_factory=list)
    """(path, Host header) of every request, in order."""

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


def _handler(server: MediaServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet
            pass

        def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            if "Content-Length" not in (headers or {}) and "Transfer-Encoding" not in (headers or {}):
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if body:
                self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            server.requests.append((self.path, self.headers.get("Host", "")))
            parsed = urlparse(self.path)
            if parsed.path == "/cat.png":
                self._send(200, server.image, {"Content-Type": "image/png"})
            elif parsed.path == "/big":
                self._send(200, b"\0" * BIG_BYTES, {"Content-Type": "image/png"})
            elif parsed.path == "/big-chunked":
                self._chunked(b"\0" * BIG_BYTES)
            elif parsed.path == "/slow":
                self._drip()
            elif parsed.path == "/gzip":
                self._send(200, gzip.compress(server.image), {"Content-Type": "image/png", "Content-Encoding": "gzip"})
            elif parsed.path == "/redirect":
                self._send(302, headers={"Location": parse_qs(parsed.query)["to"][0]})
            elif parsed.path == "/loop":
                self._send(302, headers={"Location": "/loop"})
            else:
                self._send(404, b"not here")

        def _chunked(self, body: bytes) -> None:
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for start in range(0, len(body), 65536):
                piece = body[start : start + 65536]
                try:
                    self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                except OSError:
                    return  # the client stopped reading: what the cap test wants
            self.wfile.write(b"0\r\n\r\n")

        def _drip(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "100000")
            self.end_headers()
            for _ in range(600):  # at most a minute; the client gives up long before
                try:
                    self.wfile.write(b"\0")
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.1)

    return Handler


@contextmanager
def media_server(image: bytes | None = None) -> Iterator[MediaServer]:
    """Serve on a free 127.0.0.1 port for the duration of the block."""
    state = MediaServer(port=0, image=image or png_bytes())
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    httpd.daemon_threads = True
    state.port = httpd.server_address[1]
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()
