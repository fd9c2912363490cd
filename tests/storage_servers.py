"""Real storage servers for tests, each a separate process on a free loopback port, and a
thin HTTP proxy that sits in front of one to inject the faults a real service produces.

- ``start_moto``: S3 by moto's server mode (``python -m moto.server``).
- ``start_gcs_emulator``: GCS by the ``gcp-storage-emulator`` package, in memory.
- ``FaultProxy``: forwards every request to its upstream unless a rule answers it first
  (throttling, 403s, damaged or cut-off bodies), and records what it saw, so a test can
  tell how many requests (retries) an operation made. ``gcs_create_only`` makes it enforce
  ``ifGenerationMatch=0``, which the GCS emulator ignores.

Clients reach the servers through their SDKs' standard chains: ``s3_env`` and ``gcs_env``
are the only settings a process needs (``AWS_ENDPOINT_URL_S3`` and credentials;
``STORAGE_EMULATOR_HOST``). Only the standard library is used here.
"""

from __future__ import annotations

import contextlib
import email.parser
import http.client
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, urlsplit

HOST = "127.0.0.1"
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
    }
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


# A server must not outlive a killed test run: the child asks Linux for SIGTERM when its
# parent dies (prctl PR_SET_PDEATHSIG, kept across exec), then becomes the server. Done in
# a fresh interpreter rather than a preexec_fn, which is unsafe in a threaded parent.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
    "os.execv(sys.argv[1], sys.argv[1:])\n"
)


class ServerProcess:
    """One server process on a free loopback port, ready when it answers HTTP."""

    def __init__(self, name: str, argv: Callable[[int], list[str]], log_dir: Path) -> None:
        self.name = name
        self._argv = argv
        self.log_path = log_dir / f"{name}.log"
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerProcess:
        for _ in range(3):  # another process may take the free port before we bind it
            self.port = free_port()
            with self.log_path.open("ab") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, "-c", _DIE_WITH_PARENT, *self._argv(self.port)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            if self._wait_ready(timeout):
                return self
            self.stop()
        raise RuntimeError(f"{self.name} did not start:\n{self.log()[-4000:]}")

    def _wait_ready(self, timeout: float) -> bool:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                _request("GET", self.url, "/")  # any HTTP answer will do
            except OSError:
                time.sleep(0.05)
            else:
                return True
        return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def start_moto(log_dir: Path) -> ServerProcess:
    """moto's S3 server (no credentials checked unless ``enable_moto_auth`` is called)."""

    def argv(port: int) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)]

    return ServerProcess("moto", argv, log_dir).start()


def start_gcs_emulator(log_dir: Path) -> ServerProcess:
    def argv(port: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "gcp_storage_emulator",
            "start",
            "--host",
            HOST,
            "--port",
            str(port),
            "--in-memory",
        ]

    return ServerProcess("gcs-emulator", argv, log_dir).start()


def _request(
    method: str, endpoint: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> int:
    """One plain HTTP request; returns the status (test servers need no signing here)."""
    parts = urlsplit(endpoint)
    conn = http.client.HTTPConnection(parts.hostname or HOST, parts.port or 80, timeout=10)
    try:
        conn.request(method, path, body=body or None, headers=headers or {})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def _expect(status: int, what: str) -> None:
    if status >= 300:
        raise RuntimeError(f"{what}: HTTP {status}")


def create_s3_bucket(endpoint: str, name: str) -> None:
    """A bucket on moto, made without the SDK (moto does not check this request)."""
    _expect(_request("PUT", endpoint, f"/{name}"), f"create bucket {name}")


def enable_moto_auth(endpoint: str) -> None:
    """From now on this moto server checks credentials (it knows none: all are wrong)."""
    _expect(_request("POST", endpoint, "/moto-api/reset-auth", b"0"), "enable moto auth")


def create_gcs_bucket(endpoint: str, name: str) -> None:
    status = _request(
        "POST",
        endpoint,
        "/storage/v1/b?project=test",
        json.dumps({"name": name}).encode(),
        {"Content-Type": "application/json"},
    )
    _expect(status, f"create bucket {name}")


def unique_bucket_name() -> str:
    return f"b-{uuid.uuid4().hex[:20]}"


def s3_env(endpoint: str) -> dict[str, str]:
    """All a process needs to reach ``endpoint`` through boto3's standard chain."""
    return {
        "AWS_ENDPOINT_URL_S3": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        # Nothing from the developer's own AWS setup may leak in.
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true",
    }


S3_UNSET = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_REGION")


def gcs_env(endpoint: str) -> dict[str, str]:
    """All a process needs to reach the emulator through google-cloud-storage's chain."""
    return {"STORAGE_EMULATOR_HOST": endpoint, "GOOGLE_CLOUD_PROJECT": "test"}


@dataclass(frozen=True)
class Bucket:
    """A fresh bucket on a test server, and how to reach it."""

    url: str
    """``s3://name/prefix`` or ``gs://name/prefix``: what ``--backup`` takes."""
    name: str
    endpoint: str
    env: dict[str, str]
    """The environment that makes the SDK reach ``endpoint`` (already set in-process)."""


# --- the fault-injecting proxy --------------------------------------------------------------


@dataclass
class Request:
    method: str
    path: str
    """Path and query, as sent."""
    headers: list[tuple[str, str]]
    body: bytes
    status: int = 0
    """The status the proxy answered (0 until it has)."""
    reply_bytes: int = 0
    """The body bytes the proxy answered with (what the bucket's egress would be)."""

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)

    @property
    def query(self) -> dict[str, list[str]]:
        return parse_qs(urlsplit(self.path).query)


@dataclass
class Reply:
    status: int
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    cut_after: int | None = None
    """Send only this many body bytes, then drop the connection (a broken download)."""
    reset: bool = False
    """Answer nothing: reset the connection once the request was read (a reset mid-call)."""


Match = Callable[[Request], bool]
Rule = Callable[[Request, "FaultProxy"], Reply | None]
"""Runs before forwarding: a Reply answers the request; None lets it through (maybe changed)."""
ReplyRule = Callable[[Request, Reply], Reply]
"""Runs on the upstream's answer before it is sent back."""


def anything(_: Request) -> bool:
    return True


def method_is(*methods: str) -> Match:
    return lambda req: req.method in methods


class _Budget:
    """How many more matching requests a rule acts on (None: all of them)."""

    def __init__(self, times: int | None) -> None:
        self.left = times
        self.used = 0
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self.left is not None:
                if self.left <= 0:
                    return False
                self.left -= 1
            self.used += 1
            return True


def answer(
    status: int,
    body: bytes = b"",
    content_type: str = "application/xml",
    *,
    times: int | None = None,
    match: Match = anything,
) -> Rule:
    """Answer matching requests with ``status`` (the first ``times`` of them)."""
    budget = _Budget(times)

    def rule(req: Request, _: FaultProxy) -> Reply | None:
        if match(req) and budget.take():
            return Reply(status, [("Content-Type", content_type)], body)
        return None

    return rule


def s3_error(code: str, message: str) -> bytes:
    return (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
        f"<Message>{message}</Message><RequestId>proxy</RequestId></Error>"
    ).encode()


def gcs_error(status: int, reason: str, message: str) -> bytes:
    error = {"code": status, "message": message, "errors": [{"reason": reason, "message": message}]}
    return json.dumps({"error": error}).encode()


def corrupt_request(*, times: int = 1, match: Match = anything, at: float = 0.5) -> Rule:
    """Flip one byte of matching request bodies before forwarding them (at ``at`` of the
    body: pick it so it lands in the payload, not in a multipart envelope)."""
    budget = _Budget(times)

    def rule(req: Request, _: FaultProxy) -> Reply | None:
        if req.body and match(req) and budget.take():
            data = bytearray(req.body)
            data[int(len(data) * at)] ^= 0x01
            req.body = bytes(data)
        return None

    return rule


def corrupt_reply(*, times: int | None = 1, match: Match = anything) -> ReplyRule:
    """Flip one byte in the middle of matching successful response bodies."""
    budget = _Budget(times)

    def rule(req: Request, reply: Reply) -> Reply:
        if reply.body and reply.status < 300 and match(req) and budget.take():
            data = bytearray(reply.body)
            data[len(data) // 2] ^= 0x01
            reply.body = bytes(data)
        return reply

    return rule


def cut_reply(keep: int, *, times: int = 1, match: Match = anything) -> ReplyRule:
    """Send only ``keep`` bytes of matching response bodies, then drop the connection."""
    budget = _Budget(times)

    def rule(req: Request, reply: Reply) -> Reply:
        if len(reply.body) > keep and reply.status < 300 and match(req) and budget.take():
            reply.cut_after = keep
        return reply

    return rule


def gcs_create_only(req: Request, proxy: FaultProxy) -> Reply | None:
    """Enforce ``ifGenerationMatch=0`` on uploads, as GCS does and the emulator does not.

    The existence check and the forwarded upload run under one lock, so create-only uploads
    through this proxy are atomic with respect to each other.
    """
    if req.method not in ("POST", "PUT") or req.query.get("ifGenerationMatch") != ["0"]:
        return None
    bucket = urlsplit(req.path).path.split("/b/", 1)[1].split("/", 1)[0]
    name = gcs_upload_name(req)
    with proxy.lock:
        probe = Request("GET", f"/storage/v1/b/{bucket}/o/{quote(name, safe='')}", [], b"")
        if proxy.forward(probe).status == 200:
            message = "At least one of the pre-conditions you specified did not hold."
            return Reply(
                412,
                [("Content-Type", "application/json")],
                gcs_error(412, "conditionNotMet", message),
            )
        return proxy.forward(req)


def gcs_upload_name(req: Request) -> str:
    """The object name an upload request creates (query, JSON body, or multipart)."""
    if "name" in req.query:
        return req.query["name"][0]
    content_type = req.header("Content-Type") or ""
    if content_type.startswith("application/json"):
        return str(json.loads(req.body)["name"])
    message = email.parser.BytesParser().parsebytes(
        f"Content-Type: {content_type}\r\n\r\n".encode() + req.body
    )
    for part in message.walk():
        if part.get_content_type() == "application/json":
            payload = part.get_payload(decode=True)
            assert isinstance(payload, bytes)
            return str(json.loads(payload)["name"])
    raise ValueError(f"no object name in upload {req.path}")


class FaultProxy:
    """An HTTP proxy in front of one storage server, with fault rules (see module doc)."""

    def __init__(
        self,
        upstream: str,
        rules: list[Rule] | None = None,
        reply_rules: list[ReplyRule] | None = None,
        *,
        host: str = HOST,
    ) -> None:
        parts = urlsplit(upstream)
        self.upstream_host = parts.hostname or HOST
        self.upstream_port = parts.port or 80
        self.rules = list(rules or [])
        self.reply_rules = list(reply_rules or [])
        self.seen: list[Request] = []
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        """The most requests the proxy was handling at once (parallel uploads show here)."""
        self._server = ThreadingHTTPServer((host, 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.02},  # stop() waits up to one interval
            name="fault-proxy",
            daemon=True,
        )

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def requests(self, method: str | None = None) -> list[Request]:
        with self.lock:
            return [r for r in self.seen if method is None or r.method == method]

    def forward(self, req: Request) -> Reply:
        conn = http.client.HTTPConnection(self.upstream_host, self.upstream_port, timeout=30)
        try:
            headers = {k: v for k, v in req.headers if k.lower() not in _HOP_BY_HOP}
            if req.body or req.method in ("POST", "PUT"):
                headers["Content-Length"] = str(len(req.body))
            conn.request(req.method, req.path, body=req.body or None, headers=headers)
            resp = conn.getresponse()
            body = resp.read()
            kept = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP_BY_HOP]
            if req.method == "HEAD":  # a HEAD answer's length describes the object
                kept.append(("Content-Length", resp.getheader("Content-Length", "0")))
            return Reply(resp.status, kept, body)
        finally:
            conn.close()

    def statuses(self) -> list[int]:
        with self.lock:
            return [r.status for r in self.seen]

    def handle(self, req: Request) -> Reply:
        with self.lock:
            self.seen.append(req)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            reply = self._answer(req)
        finally:
            with self.lock:
                self.in_flight -= 1
        req.status = reply.status
        req.reply_bytes = len(reply.body) if reply.cut_after is None else reply.cut_after
        return reply

    def _answer(self, req: Request) -> Reply:
        for rule in self.rules:
            reply = rule(req, self)
            if reply is not None:
                return reply
        reply = self.forward(req)
        for reply_rule in self.reply_rules:
            reply = reply_rule(req, reply)
        return reply


def _handler_for(proxy: FaultProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            # Headers and body go out in separate writes: without this, Nagle's algorithm
            # and the client's delayed ACK add 40 ms to every answer.
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def _serve(self) -> None:
            body = self._read_body()
            req = Request(self.command, self.path, list(self.headers.items()), body)
            reply = proxy.handle(req)
            if reply.reset:
                # SO_LINGER 0: close() sends RST, as a load balancer that drops a call does.
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
                self.close_connection = True
                return
            self.send_response(reply.status)
            for key, value in reply.headers:
                if key.lower() not in ("server", "date"):
                    self.send_header(key, value)
            if self.command != "HEAD":
                self.send_header("Content-Length", str(len(reply.body)))
            self.end_headers()
            if self.command == "HEAD":
                return
            if reply.cut_after is None:
                self.wfile.write(reply.body)
                return
            self.wfile.write(reply.body[: reply.cut_after])
            self.wfile.flush()
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)

        def _read_body(self) -> bytes:
            if (self.headers.get("Transfer-Encoding") or "").lower() == "chunked":
                pieces = []
                while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                    pieces.append(self.rfile.read(size))
                    self.rfile.readline()
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(pieces)
            length = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(length) if length else b""

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _serve

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


@contextlib.contextmanager
def fault_proxy(
    upstream: str, rules: list[Rule] | None = None, reply_rules: list[ReplyRule] | None = None
) -> Iterator[FaultProxy]:
    proxy = FaultProxy(upstream, rules, reply_rules).start()
    try:
        yield proxy
    finally:
        proxy.stop()
