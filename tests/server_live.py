"""A real `ggufpy serve` app on 127.0.0.1 for the server tests: uvicorn in a thread, a free port."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import uvicorn

START_TIMEOUT = 60.0


class LiveServer:
    """uvicorn in a thread on a socket bound to 127.0.0.1:0; `stop()` ends it."""

    def __init__(self, app):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the server on {self.url} did not answer /health within {START_TIMEOUT} s")

    def stop(self):
        self.server.should_exit = True
        self.thread.join(20)
        self.sock.close()
