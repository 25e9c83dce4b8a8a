"""A real HTTP file server on loopback, for the archive tests: `FileServer(folder)` serves the
folder's files in its own process (http.server, threaded), honours Range requests and logs
every request it answers, one JSON line each, so tests count requests and bytes.

Misbehaviour is asked for in the URL's query, so a catalog entry names it:
- `?cut=N`: the first N GETs of the file send half the body and close the connection (the
  Content-Length still says the whole size): a download cut in the middle;
- `?ranges=ignore`: Range headers are ignored (the whole file, 200), as some servers do.
A file that is not there is answered 404, as any server does.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit


class FileServer:
    """The server in its own process on http://127.0.0.1:PORT/, serving `folder`."""

    def __init__(self, folder: Path, log: Path):
        from s3 import free_port, wait_for_port  # noqa: PLC0415 (boto3: not in the server)
        self.folder, self.log = folder, log
        self.port = free_port()
        self.process = subprocess.Popen([sys.executable, __file__, str(folder), str(self.port),
                                         str(log)])
        wait_for_port(self.port)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    def requests(self) -> list[dict]:
        """Every request answered so far: method, path, range, status, bytes (of the body
        sent, or offered to a client that hung up)."""
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


def serve(folder: Path, port: int, log: Path) -> None:
    cuts_done: dict[str, int] = {}
    log_lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as real servers: the client reuses it

        def do_HEAD(self) -> None:  # noqa: N802 (http.server's naming)
            self.answer(body=False)

        def do_GET(self) -> None:  # noqa: N802
            self.answer(body=True)

        def answer(self, body: bool) -> None:
            parts = urlsplit(self.path)
            query = {key: values[0] for key, values in parse_qs(parts.query).items()}
            file = folder / parts.path.lstrip("/")
            if not file.is_file():
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return self.record(404, 0)
            data = file.read_bytes()
            start, end = 0, len(data)
            asked = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
            ranged = asked is not None and query.get("ranges") != "ignore"
            if ranged:
                start = int(asked[1])
                end = min(len(data), int(asked[2]) + 1) if asked[2] else len(data)
            self.send_response(206 if ranged else 200)
            if ranged:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
            if query.get("ranges") != "ignore":  # such servers rarely say so (http.server)
                self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(end - start))
            self.end_headers()
            if not body:
                return self.record(206 if ranged else 200, 0)
            with log_lock:
                cuts_done[parts.path] = cuts_done.get(parts.path, 0) + 1
                cut = cuts_done[parts.path] <= int(query.get("cut", 0))
            if cut:  # half the body, then the connection is closed under the client
                end = start + (end - start) // 2
                self.close_connection = True
            try:
                self.wfile.write(data[start:end])
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):  # the client hung up on it
                self.close_connection = True
            self.record(206 if ranged else 200, end - start)

        def record(self, status: int, sent: int) -> None:
            entry = {"method": self.command, "path": urlsplit(self.path).path,
                     "range": self.headers.get("Range"), "status": status, "bytes": sent}
            with log_lock, open(log, "a") as out:
                out.write(json.dumps(entry) + "\n")

        def log_message(self, *args) -> None:  # the request log is the JSON file
            pass

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    serve(Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
