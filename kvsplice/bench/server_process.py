"""A real `kvsplice serve` in a subprocess, for the serving benchmarks (and anything else that
must talk to the server the way a client would)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serve(flags: list[str], startup_s: float = 300.0) -> Iterator[str]:
    """Start `kvsplice serve <flags>` on a free port, wait until /health answers, yield its base
    URL, and stop it on exit. Raises if the server exits or does not answer within `startup_s`."""
    port = free_port()
    command = [sys.executable, "-m", "kvsplice.cli", "serve", "--port", str(port), "--log-level", "warning"]
    process = subprocess.Popen([*command, *flags])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while not _healthy(url):
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with {process.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start in {startup_s:.0f} s")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
