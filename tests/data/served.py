"""A static HTTP server on 127.0.0.1 with Range support and archive builders, shared by the
download tests."""

from __future__ import annotations

import io
import tarfile
import threading
import zipfile
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest


class RangeHandler(SimpleHTTPRequestHandler):
    """Static files with Range support; `/cut/<name>` announces the full length but stops halfway."""

    ranges: list[str] = []
    requests: list[str] = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        RangeHandler.requests.append(self.path)
        cut = self.path.startswith("/cut/")
        path = Path(self.directory) / self.path.removeprefix("/cut/" if cut else "/")
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        start = 0
        if "Range" in self.headers:
            RangeHandler.ranges.append(self.headers["Range"])
            start = int(self.headers["Range"].split("=")[1].split("-")[0])
            if start >= len(data):
                self.send_error(416)
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        body = data[start:]
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[: len(body) // 2] if cut else body)


@pytest.fixture
def server(tmp_path):
    files = tmp_path / "served"
    files.mkdir()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(RangeHandler, directory=str(files)))
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)  # shutdown() waits one poll
    thread.start()
    RangeHandler.ranges = []
    RangeHandler.requests = []
    yield files, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def tar_gz(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def make_zip(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return buf.getvalue()
