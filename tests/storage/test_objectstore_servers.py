"""The object-store test infrastructure itself: moto's S3 server and fake-gcs-server on 127.0.0.1, reached by
s3fs and gcsfs directly and through the fault-injecting :class:`~tests.objectstores.FaultProxy`.

What these tests pin down about the clients (s3fs 2026.9 / aiobotocore, gcsfs 2026.10 / aiohttp) matters to
the library's own retry tests:

* aiohttp itself resends an *idempotent* request (GET, HEAD, PUT, DELETE) once when the server drops the
  connection, whatever the client's retry settings: a dropped GET costs two requests.
* s3fs's own retry loop (``S3FileSystem.retries``, default 5) is separate from botocore's and nests in
  ``cat_file``; ``S3Server.filesystem(retries=1)`` makes it a single attempt.
* gcsfs retries 6 times with 1-16 s back-off and cannot be configured per instance;
  ``gcsfs_retries_disabled()`` turns that off.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import os
import socket
import socketserver
import threading
import time
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest

from tests.objectstores import (
    FAULT_DROP,
    S3_KEY,
    S3_REGION,
    S3_SECRET,
    FaultProxy,
    GcsServer,
    RequestRecord,
    S3Server,
    gcsfs_retries_disabled,
    start_gcs_server,
)

pytestmark = [pytest.mark.dist, pytest.mark.timeout(60)]

Server = S3Server | GcsServer
MakeProxy = Callable[..., FaultProxy]


def _fs(server: Server, endpoint_url: str | None = None) -> Any:
    """A filesystem for ``server`` (or a proxy in front of it) whose client makes one attempt per request,
    except gcsfs, whose retries only :func:`gcsfs_retries_disabled` can switch off."""
    if isinstance(server, S3Server):
        return server.filesystem(endpoint_url, retries=1)
    return server.filesystem(endpoint_url)


def _host_port(url: str) -> tuple[str, int]:
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


# --- both servers, both clients, directly and through the proxy ---------------------------------------


@pytest.mark.parametrize("via_proxy", [False, True], ids=["direct", "proxy"])
def test_put_get_range_list_delete(object_store: Server, fault_proxy: MakeProxy, via_proxy: bool) -> None:
    proxy = fault_proxy(object_store) if via_proxy else None
    fs = _fs(object_store, proxy.url if proxy else None)
    bucket = object_store.new_bucket()
    small = b"second object"
    big = os.urandom(3 * 1024 * 1024 + 17)  # several proxy blocks

    fs.pipe_file(f"{bucket}/dir/a.bin", big)
    fs.pipe_file(f"{bucket}/dir/b.bin", small)
    fs.pipe_file(f"{bucket}/top.bin", b"top")

    assert fs.cat_file(f"{bucket}/dir/a.bin") == big
    assert fs.cat_file(f"{bucket}/dir/a.bin", start=1_000_000, end=1_000_010) == big[1_000_000:1_000_010]
    assert fs.cat_file(f"{bucket}/dir/b.bin", start=7) == b"object"
    assert fs.info(f"{bucket}/dir/a.bin")["size"] == len(big)
    assert sorted(fs.ls(f"{bucket}/dir", detail=False)) == [f"{bucket}/dir/a.bin", f"{bucket}/dir/b.bin"]
    assert sorted(fs.find(bucket)) == [f"{bucket}/dir/a.bin", f"{bucket}/dir/b.bin", f"{bucket}/top.bin"]

    fs.rm(f"{bucket}/dir/a.bin")
    assert not fs.exists(f"{bucket}/dir/a.bin")
    assert fs.ls(f"{bucket}/dir", detail=False) == [f"{bucket}/dir/b.bin"]
    with pytest.raises(FileNotFoundError):
        fs.cat_file(f"{bucket}/dir/a.bin")

    if proxy is not None:
        assert proxy.count() > 0
        assert proxy.count(faulted=True) == 0
        assert all(r.status is not None and r.status < 500 for r in proxy.records)


def test_new_bucket_names_are_unique_and_buckets_empty(object_store: Server) -> None:
    fs = _fs(object_store)
    buckets = {object_store.new_bucket() for _ in range(3)}
    assert len(buckets) == 3
    for bucket in buckets:
        assert fs.ls(bucket, detail=False) == []


# --- create-only puts ---------------------------------------------------------------------------------


def test_s3_create_only_put_fails_on_an_existing_object(s3_server: S3Server, fault_proxy: MakeProxy) -> None:
    import botocore.exceptions

    proxy = fault_proxy(s3_server)
    for endpoint in (s3_server.endpoint_url, proxy.url):
        bucket = s3_server.new_bucket()
        client = s3_server.boto3_client(endpoint)
        client.put_object(Bucket=bucket, Key="k", Body=b"first", IfNoneMatch="*")
        with pytest.raises(botocore.exceptions.ClientError) as boto_error:
            client.put_object(Bucket=bucket, Key="k", Body=b"second", IfNoneMatch="*")
        assert boto_error.value.response["Error"]["Code"] == "PreconditionFailed"
        assert boto_error.value.response["Error"]["Condition"] == "If-None-Match"
        assert boto_error.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412

        fs = s3_server.filesystem(endpoint, retries=1)
        with pytest.raises(FileExistsError):
            fs.call_s3("put_object", Bucket=bucket, Key="k", Body=b"third", IfNoneMatch="*")
        with pytest.raises(FileExistsError):
            fs.pipe_file(f"{bucket}/k", b"fourth", mode="create")
        with pytest.raises(FileExistsError), fs.open(f"{bucket}/k", "xb") as f:
            f.write(b"fifth")
        assert fs.cat_file(f"{bucket}/k") == b"first"

        fs.pipe_file(f"{bucket}/new", b"fresh", mode="create")
        assert fs.cat_file(f"{bucket}/new") == b"fresh"
    assert proxy.count("PUT", "/" + bucket + "/k") == 5
    assert [r.status for r in proxy.records if r.method == "PUT" and r.path.endswith("/k")] == [200] + [412] * 4


def test_gcs_create_only_put_fails_on_an_existing_object(gcs_server: GcsServer, fault_proxy: MakeProxy) -> None:
    proxy = fault_proxy(gcs_server)
    for endpoint in (gcs_server.endpoint_url, proxy.url):
        bucket = gcs_server.new_bucket()
        fs = gcs_server.filesystem(endpoint)
        fs.pipe_file(f"{bucket}/k", b"first", mode="create")
        with pytest.raises(FileExistsError):
            fs.pipe_file(f"{bucket}/k", b"second", mode="create")
        assert fs.cat_file(f"{bucket}/k") == b"first"
        fs.pipe_file(f"{bucket}/k", b"overwritten")  # mode="overwrite" (the default) still overwrites
        assert fs.cat_file(f"{bucket}/k") == b"overwritten"

    uploads = [r for r in proxy.records if r.path == f"/upload/storage/v1/b/{bucket}/o"]
    assert [r.status for r in uploads] == [200, 412, 200]
    query = urllib.parse.parse_qs(uploads[1].query)
    assert query["uploadType"] == ["multipart"]
    assert query["ifGenerationMatch"] == ["0"]


def test_fake_gcs_server_checks_if_generation_match_on_multipart_uploads_only(gcs_server: GcsServer) -> None:
    """fake-gcs-server refuses ``ifGenerationMatch=0`` on an existing object only in a *multipart* upload
    (gcsfs ``pipe_file``/``put_file(..., mode="create")`` below ``chunksize``, 50 MiB by default). It ignores
    it in resumable uploads (``open(path, "xb")``, or ``pipe_file`` at or above ``chunksize``) and media
    uploads; real GCS refuses them all. Tests of create-only writes against this emulator must therefore use
    a multipart upload. If this test fails, the emulator has caught up."""
    fs = gcs_server.filesystem()
    bucket = gcs_server.new_bucket()
    fs.pipe_file(f"{bucket}/k", b"first")

    big = os.urandom(300 * 1024)
    fs.pipe_file(f"{bucket}/k", big, mode="create", chunksize=256 * 1024)  # resumable: not refused here
    assert fs.cat_file(f"{bucket}/k") == big
    with fs.open(f"{bucket}/k", "xb") as f:  # resumable: not refused here
        f.write(b"xb")
    assert fs.cat_file(f"{bucket}/k") == b"xb"


@pytest.mark.parametrize("store", ["s3", "gcs"])
def test_create_only_put_whose_answer_is_lost_reports_file_exists(
    store: str, request: pytest.FixtureRequest, fault_proxy: MakeProxy
) -> None:
    """A create-only put that reaches the store but whose answer is lost is resent by the client (aiohttp for
    an S3 PUT, gcsfs's retry for a GCS POST) and then fails with FileExistsError: the object is the caller's
    own. Commit logic must not take that FileExistsError as "someone else won"."""
    server: Server = request.getfixturevalue(f"{store}_server")
    proxy = fault_proxy(server)
    bucket = server.new_bucket()
    proxy.fail_next(1, "drop_after", contains="/commit" if store == "s3" else "/upload/")
    with pytest.raises(FileExistsError):
        _fs(server, proxy.url).pipe_file(f"{bucket}/commit", b"mine", mode="create")
    assert [(r.fault, r.status) for r in proxy.records] == [("drop_after", None), (None, 412)]
    assert _fs(server).cat_file(f"{bucket}/commit") == b"mine"


# --- proxy: counters, forwarding ----------------------------------------------------------------------


def test_proxy_counts_requests_by_method_path_and_range(object_store: Server, fault_proxy: MakeProxy) -> None:
    proxy = fault_proxy(object_store)
    fs = _fs(object_store, proxy.url)
    bucket = object_store.new_bucket()
    key = "dir/x y.bin"  # a space: recorded paths are percent-decoded
    path = object_store.object_path(bucket, key)
    fs.pipe_file(f"{bucket}/{key}", b"0123456789")
    proxy.reset()
    assert proxy.count() == 0
    assert proxy.records == []

    assert fs.cat_file(f"{bucket}/{key}") == b"0123456789"
    assert fs.cat_file(f"{bucket}/{key}", start=2, end=5) == b"234"
    assert fs.cat_file(f"{bucket}/{key}", start=5, end=8) == b"567"

    assert proxy.count("GET", path, ranged=False) == 1
    assert proxy.count("GET", path, ranged=True) == 2
    assert proxy.count("GET", path) == 3
    assert proxy.count("GET", contains="x y.bin") == 3
    assert proxy.counts()[("GET", path, True)] == 2
    assert proxy.counts()[("GET", path, False)] == 1
    ranges = [r.range for r in proxy.records if r.method == "GET" and r.path == path and r.ranged]
    assert ranges == ["bytes=2-4", "bytes=5-7"]
    assert proxy.count(faulted=True) == 0

    proxy.reset()
    assert proxy.count() == 0


def test_gcs_resumable_upload_goes_through_the_proxy(gcs_server: GcsServer, fault_proxy: MakeProxy) -> None:
    """fake-gcs-server's resumable session URL (``Location``) names the server; the proxy rewrites it, so the
    chunks go through the proxy too."""
    proxy = fault_proxy(gcs_server)
    fs = gcs_server.filesystem(proxy.url)
    bucket = gcs_server.new_bucket()
    data = os.urandom(600 * 1024)
    fs.pipe_file(f"{bucket}/big.bin", data, chunksize=256 * 1024)
    assert gcs_server.filesystem().cat_file(f"{bucket}/big.bin") == data

    uploads = [r for r in proxy.records if r.path == f"/upload/storage/v1/b/{bucket}/o"]
    assert "uploadType=resumable" in uploads[0].query
    assert sum("upload_id=" in r.query for r in uploads) == 3  # 256 KiB + 256 KiB + 88 KiB


def _auth(server: Server, method: str, proxy: FaultProxy, target: str) -> dict[str, str]:
    """SigV4 headers for a raw S3 request (moto refuses anonymous access to a private bucket); none for GCS."""
    if not isinstance(server, S3Server):
        return {}
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    aws_request = AWSRequest(method, proxy.url + target, headers={"x-amz-content-sha256": "UNSIGNED-PAYLOAD"})
    S3SigV4Auth(Credentials(S3_KEY, S3_SECRET), "s3", S3_REGION).add_auth(aws_request)
    return dict(aws_request.headers.items())


@pytest.mark.parametrize("store", ["s3", "gcs"])
def test_proxy_forwards_chunked_request_bodies_on_a_keep_alive_connection(
    store: str, request: pytest.FixtureRequest, fault_proxy: MakeProxy
) -> None:
    server: Server = request.getfixturevalue(f"{store}_server")
    proxy = fault_proxy(server)
    bucket = server.new_bucket()
    parts = [b"hello ", b"chunked ", os.urandom(100_000), b" world"]
    if store == "s3":
        method, target = "PUT", f"/{bucket}/chunked.bin"
    else:
        method, target = "POST", f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name=chunked.bin"

    get_target = server.object_path(bucket, "chunked.bin") + ("?alt=media" if store == "gcs" else "")

    conn = http.client.HTTPConnection(*_host_port(proxy.url), timeout=10)
    try:
        conn.request(
            method, target, body=iter(parts), encode_chunked=True, headers=_auth(server, method, proxy, target)
        )
        response = conn.getresponse()
        response.read()
        assert response.status == 200
        first_socket = conn.sock
        conn.request("GET", get_target, headers=_auth(server, "GET", proxy, get_target))
        response = conn.getresponse()
        assert response.read() == b"".join(parts)
        assert conn.sock is first_socket  # the same client connection served both
    finally:
        conn.close()
    assert _fs(server).cat_file(f"{bucket}/chunked.bin") == b"".join(parts)


class _ChunkedUpstream(BaseHTTPRequestHandler):
    """An upstream that answers GET with a chunked body and HEAD with a Content-Length and no body."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Location", f"http://{self.headers['Host']}/elsewhere")
        self.end_headers()
        for part in (b"abc", b"defgh", b""):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))

    def do_HEAD(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "1234")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_proxy_relays_chunked_answers_and_head_without_breaking_the_connection() -> None:
    upstream = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _ChunkedUpstream)
    upstream.daemon_threads = True
    thread = threading.Thread(target=upstream.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        host, port = upstream.server_address[:2]
        with FaultProxy(f"http://{host}:{port}") as proxy:
            conn = http.client.HTTPConnection(*_host_port(proxy.url), timeout=10)
            try:
                for _ in range(2):
                    conn.request("GET", "/thing")
                    response = conn.getresponse()
                    assert response.read() == b"abcdefgh"
                    conn.request("HEAD", "/thing")
                    response = conn.getresponse()
                    assert response.getheader("Content-Length") == "1234"
                    assert response.read() == b""
            finally:
                conn.close()
            assert [(r.method, r.status) for r in proxy.records] == [("GET", 200), ("HEAD", 200)] * 2
    finally:
        upstream.shutdown()
        upstream.server_close()
        thread.join(5)


# --- proxy: faults ------------------------------------------------------------------------------------


@pytest.mark.parametrize("store", ["s3", "gcs"])
def test_fault_rate_one_fails_every_request_quickly(
    store: str, request: pytest.FixtureRequest, fault_proxy: MakeProxy
) -> None:
    server: Server = request.getfixturevalue(f"{store}_server")
    bucket = server.new_bucket()
    _fs(server).pipe_file(f"{bucket}/obj", b"payload")
    proxy = fault_proxy(server, fault_rate=1.0, seed=7)
    n = 30
    seen: list[str] = []
    started = time.monotonic()
    conn = http.client.HTTPConnection(*_host_port(proxy.url), timeout=10)
    try:
        for i in range(n):
            method, target = ("GET", server.object_path(bucket, "obj")) if i % 2 else ("PUT", f"/{bucket}/new{i}")
            try:
                conn.request(method, target, body=b"data" if method == "PUT" else None)
                response = conn.getresponse()
                body = response.read()
            except (ConnectionError, http.client.HTTPException):
                conn.close()
                seen.append(FAULT_DROP)
                continue
            assert response.status in (503, 429)
            if store == "s3":
                assert (b"<Code>SlowDown</Code>" in body) == (response.status == 503)
                assert response.getheader("Content-Type") == "application/xml"
            else:
                assert f'"code": {response.status}'.encode() in body
            seen.append(str(response.status))
    finally:
        conn.close()
    assert time.monotonic() - started < 10
    assert set(seen) == {"503", "429", FAULT_DROP}
    assert proxy.count() == n
    assert proxy.count(faulted=True) == n
    assert [r.fault for r in proxy.records] == seen
    # nothing reached the store
    assert _fs(server).find(bucket) == [f"{bucket}/obj"]


@pytest.mark.parametrize("kind", ["503", "429", "drop", "truncate"])
def test_s3fs_with_minimal_retries_sees_each_fault(s3_server: S3Server, fault_proxy: MakeProxy, kind: str) -> None:
    import aiohttp
    import botocore.exceptions

    bucket = s3_server.new_bucket()
    s3_server.filesystem().pipe_file(f"{bucket}/obj", b"0123456789")
    proxy = fault_proxy(s3_server, fault_rate=1.0, fault_mix={kind: 1})
    fs = s3_server.filesystem(proxy.url, retries=1)
    started = time.monotonic()
    with pytest.raises(Exception) as caught:
        fs.cat_file(f"{bucket}/obj", start=0, end=10)
    assert time.monotonic() - started < 5
    error = caught.value
    if kind == "503":  # SlowDown -> OSError(EBUSY) from a botocore ClientError
        assert type(error) is OSError and error.errno == errno.EBUSY
        assert isinstance(error.__cause__, botocore.exceptions.ClientError)
    elif kind == "429":  # a code s3fs does not know -> OSError(EIO)
        assert type(error) is OSError and error.errno == errno.EIO
        assert isinstance(error.__cause__, botocore.exceptions.ClientError)
    elif kind == "drop":
        assert isinstance(error, botocore.exceptions.ConnectionClosedError)
    else:
        assert isinstance(error, aiohttp.ClientPayloadError)
    # aiohttp resends an idempotent request once on a dropped connection, even with every retry off
    assert proxy.count("GET") == (2 if kind == "drop" else 1)


@pytest.mark.parametrize("kind", ["503", "429", "drop", "truncate"])
def test_gcsfs_with_retries_disabled_sees_each_fault(gcs_server: GcsServer, fault_proxy: MakeProxy, kind: str) -> None:
    import aiohttp
    import gcsfs.retry

    bucket = gcs_server.new_bucket()
    gcs_server.filesystem().pipe_file(f"{bucket}/obj", b"0123456789")
    proxy = fault_proxy(gcs_server, fault_rate=1.0, fault_mix={kind: 1})
    fs = gcs_server.filesystem(proxy.url)
    started = time.monotonic()
    with gcsfs_retries_disabled(), pytest.raises(Exception) as caught:
        fs.cat_file(f"{bucket}/obj", start=0, end=10)
    assert time.monotonic() - started < 5
    error = caught.value
    if kind in ("503", "429"):
        assert isinstance(error, gcsfs.retry.HttpError) and error.code == int(kind)
    elif kind == "drop":
        assert isinstance(error, aiohttp.ServerDisconnectedError)
    else:
        assert isinstance(error, aiohttp.ClientPayloadError)
    assert proxy.count("GET") == (2 if kind == "drop" else 1)


def _expected_outcomes(records: list[RequestRecord], operations: int) -> list[bool]:
    """Replay the proxy's log of single-request reads: a read fails if its request got a 503/429, or if it
    was dropped and aiohttp's one resend failed too."""
    outcomes = []
    it = iter(records)
    for _ in range(operations):
        first = next(it)
        if first.fault == FAULT_DROP:
            second = next(it)
            outcomes.append(second.fault is None)
        else:
            outcomes.append(first.fault is None)
    assert next(it, None) is None
    return outcomes


@pytest.mark.parametrize("store", ["s3", "gcs"])
def test_fault_rate_one_fifth_reaches_a_client_with_minimal_retries(
    store: str, request: pytest.FixtureRequest, fault_proxy: MakeProxy
) -> None:
    server: Server = request.getfixturevalue(f"{store}_server")
    bucket = server.new_bucket()
    _fs(server).pipe_file(f"{bucket}/obj", b"0123456789")
    proxy = fault_proxy(server, fault_rate=0.2, seed=2024)
    fs = _fs(server, proxy.url)
    outcomes = []
    with gcsfs_retries_disabled() if store == "gcs" else contextlib.nullcontext():
        for _ in range(60):
            try:
                assert fs.cat_file(f"{bucket}/obj", start=3, end=6) == b"345"
                outcomes.append(True)
            except Exception:
                outcomes.append(False)
    records = proxy.records
    assert all(r.method == "GET" and r.ranged for r in records)
    assert outcomes == _expected_outcomes(records, len(outcomes))
    assert 0 < outcomes.count(False) < len(outcomes) // 2
    assert {r.fault for r in records} == {None, "503", "429", FAULT_DROP}


def test_fail_next_and_fault_filter_pick_the_requests(s3_server: S3Server, fault_proxy: MakeProxy) -> None:
    bucket = s3_server.new_bucket()
    fs_direct = s3_server.filesystem()
    fs_direct.pipe_file(f"{bucket}/a", b"a")
    fs_direct.pipe_file(f"{bucket}/b", b"b")
    proxy = fault_proxy(s3_server, fault_rate=1.0, fault_filter=lambda r: r.path.endswith("/b"))
    fs = s3_server.filesystem(proxy.url, retries=1)
    assert fs.cat_file(f"{bucket}/a", start=0, end=1) == b"a"  # not eligible
    with pytest.raises(Exception):  # noqa: B017 - 503, 429 or a dropped connection
        fs.cat_file(f"{bucket}/b", start=0, end=1)

    proxy.set_faults(rate=0.0)
    proxy.fail_next(2, "503", method="GET", contains="/a")
    for _ in range(2):
        with pytest.raises(OSError, match="reduce your request rate"):
            fs.cat_file(f"{bucket}/a", start=0, end=1)
    assert fs.cat_file(f"{bucket}/a", start=0, end=1) == b"a"
    assert [r.fault for r in proxy.records if r.path.endswith("/a")] == [None, "503", "503", None]


# --- life cycle ---------------------------------------------------------------------------------------


def test_proxy_stop_closes_idle_keep_alive_connections_and_is_idempotent(s3_server: S3Server) -> None:
    proxy = FaultProxy(s3_server.endpoint_url).start()
    host, port = _host_port(proxy.url)
    conn = http.client.HTTPConnection(host, port, timeout=10)
    conn.request("GET", "/")
    response = conn.getresponse()
    response.read()
    assert response.status == 200
    assert conn.sock is not None
    conn.sock.settimeout(10)

    started = time.monotonic()
    proxy.stop()
    assert time.monotonic() - started < 3
    assert conn.sock.recv(1) == b""  # the proxy closed the idle connection
    conn.close()
    with pytest.raises(ConnectionRefusedError), socket.create_connection((host, port), timeout=2):
        pass
    proxy.stop()
    with pytest.raises(RuntimeError):
        _ = proxy.url


def test_gcs_server_stop_ends_the_binary() -> None:
    server = start_gcs_server()
    process = server.process
    assert process is not None and process.poll() is None
    host, port = _host_port(server.endpoint_url)
    server.stop()
    assert process.poll() is not None
    assert server.process is None
    with pytest.raises(ConnectionRefusedError), socket.create_connection((host, port), timeout=2):
        pass
    server.stop()  # idempotent
