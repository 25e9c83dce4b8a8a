"""Real S3 parts for the tests: moto_server (an S3-compatible HTTP server) on loopback, and a
small HTTP proxy in front of it that adds latency and fails requests on purpose."""

from __future__ import annotations

import asyncio
import json
import random
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import boto3
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # also the proxy's own script
from app.parallel.plans import free_port  # noqa: E402

# Dummy credentials for the standard AWS chain; tests assert they never reach run outputs.
ACCESS_KEY = "AKIAIMAGENETDPTEST01"
SECRET_KEY = "imagenet-dp-test-secret-must-never-be-logged"
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
    """`moto_server` (a real S3 endpoint: HTTP, multipart uploads, copies) in its own process
    on http://127.0.0.1:PORT, stopped by stop(); with the tests' client and uploads. Needs
    `pip install 'moto[server]'`."""

    def __init__(self):
        self.port = free_port()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for_port(self.port, process=self.process)
        except RuntimeError as error:
            self.stop()
            raise RuntimeError(f"moto_server did not start ({error}); it needs "
                               "pip install 'moto[server]'") from None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=STOP_TIMEOUT_S)

    def client(self):
        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY)

    def upload(self, folder: Path, bucket: str, prefix: str, only: list[str] | None = None,
               acl: str = "private") -> str:
        """`folder`'s files (or the `only` ones, relative to it) to s3://bucket/prefix;
        acl="public-read" lets anonymous clients read them."""
        client = self.client()
        client.create_bucket(Bucket=bucket, ACL=acl)
        paths = [folder / p for p in only] if only else sorted(folder.rglob("*"))
        for path in paths:
            if path.is_file():
                client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder)}",
                                   ExtraArgs={"ACL": acl})
        return f"s3://{bucket}/{prefix}"


COUNTS_PATH = "/__proxy_counts__"
FORBID_PATH = "/__proxy_forbid_writes__/"  # + "on" or "off": writes answered 403 from now on
MISSING = "missing:"  # on the proxy's command line: a key answered 404
HOLD = "hold:"  # on the proxy's command line: writes of a key held (never answered)
REFUSE = "refuse:"  # on the proxy's command line: writes of a key answered 403
HOLD_AFTER = "hold-after:"  # on the proxy's command line: holding starts after this key's write
FORBID = "forbid-writes"  # on the proxy's command line: writes answered 403 from the start
WRITES = ("PUT", "POST", "DELETE")


class FaultyProxy:
    """An HTTP proxy on loopback, in its own process (so it takes no CPU time from the process
    under test): every request waits `latency_s`; a `fail_fraction` of them is answered
    503 SlowDown, a `drop_fraction` gets its connection closed without an answer, keys
    containing one of `always_fail` always get a 503, and reads of keys containing one of
    `missing` a 404 NoSuchKey (listings still name them: an object deleted after it was
    listed). It counts requests, requests in flight, the requests to `always_fail` and
    `missing` keys, and who signed them (access key ids, or unsigned).
    `forbid_writes` (and forbid_writes_now(), at any time) answers every write 403
    AccessDenied: a bucket whose policy refuses us; writes of keys containing one of `hold`
    are held unanswered (counted in `held`): an upload that is in progress for as long as the
    test likes (their paths listed in `held_paths`), from the start or, with `hold_after`,
    once a write of a key containing it has been answered; writes of keys containing one of
    `refuse` are always answered 403.
    With `remember`, a GET of an object it has fetched before is answered from memory: an S3
    that keeps up (moto_server spends ~2.6 ms of CPU on each request), for benchmarks of the
    client alone."""

    def __init__(self, upstream: str, latency_s: float = 0.0, fail_fraction: float = 0.0,
                 drop_fraction: float = 0.0, always_fail: tuple[str, ...] = (), seed: int = 0,
                 remember: bool = False, missing: tuple[str, ...] = (),
                 forbid_writes: bool = False, hold: tuple[str, ...] = (),
                 refuse: tuple[str, ...] = (), hold_after: str = ""):
        self.port = free_port()
        self.process = subprocess.Popen(
            [sys.executable, __file__, str(self.port), upstream, str(latency_s),
             str(fail_fraction), str(drop_fraction), str(seed), str(int(remember)),
             *always_fail, *(MISSING + key for key in missing), *(HOLD + key for key in hold),
             *(REFUSE + key for key in refuse),
             *((HOLD_AFTER + hold_after,) if hold_after else ()),
             *((FORBID,) if forbid_writes else ())])
        wait_for_port(self.port)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def counts(self) -> dict[str, int]:
        with urllib.request.urlopen(self.endpoint + COUNTS_PATH, timeout=10) as answer:
            return json.loads(answer.read())

    def forbid_writes_now(self, forbid: bool = True) -> None:
        url = self.endpoint + FORBID_PATH + ("on" if forbid else "off")
        with urllib.request.urlopen(url, timeout=10) as answer:
            answer.read()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


def serve_proxy(port: int, upstream: str, latency_s: float, fail_fraction: float,
                drop_fraction: float, seed: int, always_fail: list[str], remember: bool = False,
                missing: tuple[str, ...] = (), forbid_writes: bool = False,
                hold: tuple[str, ...] = (), refuse: tuple[str, ...] = (),
                hold_after: str = "") -> None:
    chance = random.Random(seed)
    remembered: dict[str, tuple[bytes, dict]] = {}  # path -> (body, headers) of whole GETs
    counts = {"requests": 0, "failed": 0, "dropped": 0, "in_flight": 0, "most_in_flight": 0,
              "always_failed": 0, "missing": 0, "unsigned": 0, "signed_by": {}, "held": 0,
              "forbidden": 0, "held_paths": []}
    forbidding = [forbid_writes]
    holding = [not hold_after]

    async def handle(request: web.Request) -> web.StreamResponse:
        if request.path == COUNTS_PATH:
            return web.json_response(counts)
        if request.path.startswith(FORBID_PATH):
            forbidding[0] = request.path.endswith("/on")
            return web.json_response({"forbid_writes": forbidding[0]})
        counts["requests"] += 1
        signer = re.search(r"Credential=([A-Z0-9]+)/", request.headers.get("Authorization", ""))
        if signer:
            counts["signed_by"][signer[1]] = counts["signed_by"].get(signer[1], 0) + 1
        else:
            counts["unsigned"] += 1
        counts["in_flight"] += 1
        counts["most_in_flight"] = max(counts["most_in_flight"], counts["in_flight"])
        try:
            return await answer(request)
        finally:
            counts["in_flight"] -= 1

    async def answer(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if latency_s:
            await asyncio.sleep(latency_s)
        roll = chance.random()
        if request.method in WRITES and holding[0] and any(key in request.path for key in hold):
            counts["held"] += 1
            counts["held_paths"].append(request.path)
            await asyncio.sleep(3600)  # the client gives up, or is killed, first
        if request.method in WRITES and hold_after and hold_after in request.path:
            holding[0] = True  # from the next write on (this one is answered)
        if request.method in WRITES and (forbidding[0] or any(k in request.path for k in refuse)):
            counts["forbidden"] += 1
            return web.Response(status=403, content_type="application/xml", text=(
                "<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"))
        if request.method in ("GET", "HEAD") and any(key in request.path for key in missing):
            counts["missing"] += 1
            return web.Response(status=404, content_type="application/xml", text=(
                "<Error><Code>NoSuchKey</Code><Message>The specified key does not exist."
                "</Message></Error>"))
        doomed = any(key in request.path for key in always_fail)
        counts["always_failed"] += doomed
        if doomed or roll < fail_fraction:
            counts["failed"] += 1
            return web.Response(status=503, content_type="application/xml", text=(
                "<Error><Code>SlowDown</Code><Message>Please reduce your request rate."
                "</Message></Error>"))
        if roll < fail_fraction + drop_fraction:
            counts["dropped"] += 1
            request.transport.close()  # the client sees the connection reset
            return web.Response(status=500)
        whole_get = request.method == "GET" and "Range" not in request.headers
        if remember and whole_get and request.path_qs in remembered:
            payload, keep = remembered[request.path_qs]
            return web.Response(status=200, body=payload, headers=keep)
        headers = {k: v for k, v in request.headers.items() if k.lower() != "host"}
        async with app["session"].request(request.method, upstream + request.path_qs,
                                          headers=headers, data=body) as upstream_answer:
            payload = await upstream_answer.read()
            # aiohttp sets Content-Length from the body, except for HEAD, whose answer has no
            # body but must still say how large the object is.
            dropped = ("transfer-encoding", "connection") + (
                () if request.method == "HEAD" else ("content-length",))
            keep = {k: v for k, v in upstream_answer.headers.items() if k.lower() not in dropped}
            if remember and whole_get and upstream_answer.status == 200:
                remembered[request.path_qs] = (payload, keep)
            return web.Response(status=upstream_answer.status, body=payload or None,
                                headers=keep)

    async def open_session(app: web.Application) -> None:
        app["session"] = aiohttp.ClientSession(auto_decompress=False)
        yield
        await app["session"].close()

    app = web.Application(client_max_size=2**30)
    app.cleanup_ctx.append(open_session)
    app.router.add_route("*", "/{tail:.*}", handle)
    # held requests would otherwise keep a stopping proxy waiting for its 60 s default
    web.run_app(app, host="127.0.0.1", port=port, print=None, handle_signals=True,
                shutdown_timeout=0.5)


if __name__ == "__main__":
    port, upstream, latency, fail, drop, seed, remember, *keys = sys.argv[1:]
    serve_proxy(int(port), upstream, float(latency), float(fail), float(drop), int(seed),
                [key for key in keys
                 if not key.startswith((MISSING, HOLD, REFUSE, FORBID, HOLD_AFTER))],
                remember == "1", [key[len(MISSING):] for key in keys if key.startswith(MISSING)],
                FORBID in keys, tuple(key[len(HOLD):] for key in keys if key.startswith(HOLD)),
                tuple(key[len(REFUSE):] for key in keys if key.startswith(REFUSE)),
                next((key[len(HOLD_AFTER):] for key in keys if key.startswith(HOLD_AFTER)), ""))
