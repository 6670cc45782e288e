"""Running the server: `kvsplice serve` (in the foreground), or in a background thread of this process
(tests, notebooks, benchmarks)."""

from __future__ import annotations

import socket
import sys
import threading
import time

import uvicorn

from kvsplice.config import EngineConfig
from kvsplice.engine.engine import Engine
from kvsplice.server.app import build_app
from kvsplice.server.config import ServerConfig


def serve(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    """Load the model, then serve until interrupted."""
    engine = Engine(engine_config)
    print(f"kvsplice: {engine_config.describe_threads()}", file=sys.stderr, flush=True)
    app = build_app(engine, server_config)
    uvicorn.run(app, host=server_config.host, port=server_config.port, log_level=server_config.log_level)


class ServerThread:
    """A server in a background thread of this process, on `port` (0: a free one; config.host and
    config.port are not used); `stop()` shuts it down."""

    def __init__(
        self, engine: Engine, config: ServerConfig | None = None, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self.app = build_app(engine, config or ServerConfig())
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.port = self._socket.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, name="kvsplice-http", daemon=True
        )

    def start(self, timeout_s: float = 60.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self._server.started:
            raise RuntimeError("the server did not start")
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join()
        self._socket.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
