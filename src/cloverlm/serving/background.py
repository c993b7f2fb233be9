"""Serving an app from a thread on a loopback port: the tests and the bench's load test (`cloverlm.bench.serving`)."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI

from cloverlm.errors import CloverError


@contextmanager
def background_server(app: FastAPI, host: str = "127.0.0.1"):
    """Serve `app` from a thread on a free port of `host` (tests, the load bench); yields the base URL."""
    sock = socket.socket()
    sock.bind((host, 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise CloverError("the server did not start")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join()
        sock.close()
