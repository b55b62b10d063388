"""A loopback HTTP server for a test, served from a thread for as long as a block runs."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def serving(server: http.server.ThreadingHTTPServer, name: str) -> Iterator[str]:
    """Serve ``server`` (bound to 127.0.0.1) in a daemon thread; yields its base URL, and shuts
    it down and closes it when the block ends."""
    thread = threading.Thread(target=server.serve_forever, name=name, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
