"""moto_server on loopback: a real S3 endpoint (HTTP, multipart uploads, copies) in a process of
its own, for the benchmarks and the tests. Needs `pip install 'moto[server]'`."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

from app.parallel.plans import free_port
from app.runtime.errors import UserError

START_TIMEOUT_S = 30.0  # moto imports boto and flask: seconds on a busy machine
STOP_TIMEOUT_S = 10.0


def wait_for_port(port: int, timeout: float = START_TIMEOUT_S,
                  process: subprocess.Popen | None = None) -> None:
    """Until something listens on 127.0.0.1:`port`; with `process`, fails at once when that
    process has ended (a server that cannot start says so without the whole wait)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the process for port {port} ended with exit code "
                               f"{process.returncode} before it listened")
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on port {port} after {timeout} s")


class MotoServer:
    """`moto_server` in its own process on http://127.0.0.1:PORT, stopped by stop()."""

    def __init__(self):
        self.port = free_port()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for_port(self.port, process=self.process)
        except RuntimeError as error:
            self.stop()
            raise UserError(f"moto_server did not start ({error}); it needs "
                            "pip install 'moto[server]'") from None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def storage_options(self) -> dict:
        """s3fs's options for this server: moto takes any credentials, and these keep the
        machine's own (environment, ~/.aws) out of the requests."""
        return {"endpoint_url": self.endpoint, "key": "loopback", "secret": "loopback",
                "client_kwargs": {"region_name": "us-east-1"}}

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=STOP_TIMEOUT_S)
