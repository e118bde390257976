"""`capsulefs fleet check-blobs`: the conformance check of a blob tier.

It passes on the real SeaweedFS the tests run, and refuses tiers that get
conditional writes wrong. Those are a tiny S3 stand-in written here (trio
and h11, path-style PUT/GET/HEAD/DELETE, no signatures): the seam the issue
names. The stand-in in its conforming mode passes the same check, so the
check is known to judge the behaviour, not the stand-in.
"""

from __future__ import annotations

import enum
import hashlib
import os
import secrets
import subprocess
import sys
from functools import partial
from pathlib import Path

import h11
import pytest
import trio

from capsulefs.core.fleet.s3_wire import parse_tier_url
from capsulefs.core.fleet.sigv4 import Credentials
from capsulefs.fleet.blobcheck import IF_MATCH, RACING, READ_AFTER_WRITE, SEQUENTIAL, check_blob_tier
from capsulefs.fleet.s3 import open_s3
from cli_kit import REPO, run_cli
from fleet_kit import WeedServer

DEADLINE = 120  # seconds: bounds a hang, never paces a test
RACE_WINDOW = 2.0  # how long the racy stand-in holds a create open for a second writer



class Mode(enum.Enum):
    CONFORMING = "conforming"
    IGNORES_CONDITIONS = "ignores conditions"  # as s3rver, and SeaweedFS before its fix for issue 8800
    RACY = "checks, then writes"  # If-None-Match honoured one at a time, not atomically
    STALE_READS = "stale reads"  # reads may return an older version


class StandIn:
    """A tiny S3 stand-in whose ways with conditional writes are chosen."""

    def __init__(self, mode: Mode) -> None:
        self.mode = mode
        self.objects: dict[bytes, tuple[bytes, bytes]] = {}  # path -> (body, ETag)
        self.first: dict[bytes, tuple[bytes, bytes]] = {}
        self.creating: dict[bytes, int] = {}
        self.arrivals = trio.Condition()

    async def serve(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                event = await self._next(conn, stream)
                if not isinstance(event, h11.Request):
                    return
                body = b""
                while isinstance(chunk := await self._next(conn, stream), h11.Data):
                    body += chunk.data
                status, headers, payload = await self.answer(event.method, event.target, dict(event.headers), body)
                headers = [*headers, (b"content-length", str(len(payload)).encode())]
                out = conn.send(h11.Response(status_code=status, headers=headers))
                if event.method != b"HEAD":
                    out += conn.send(h11.Data(data=payload)) if payload else b""
                out += conn.send(h11.EndOfMessage())
                await stream.send_all(out)
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.RemoteProtocolError):
            return
        finally:
            await stream.aclose()

    async def _next(self, conn: h11.Connection, stream: trio.SocketStream) -> object:
        while (event := conn.next_event()) is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
        return event

    async def answer(self, method: bytes, path: bytes, headers: dict[bytes, bytes],
                     body: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        if method == b"PUT":
            return await self.put(path, headers, body)
        stored = (self.first if self.mode is Mode.STALE_READS else self.objects).get(path)
        if method == b"DELETE":
            self.objects.pop(path, None)
            self.first.pop(path, None)
            return 204, [], b""
        if stored is None:
            return 404, [], b"<Error><Code>NoSuchKey</Code><Message>no such key</Message></Error>"
        return 200, [(b"etag", stored[1])], stored[0]

    async def put(self, path: bytes, headers: dict[bytes, bytes],
                  body: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        refused = 412, [], b"<Error><Code>PreconditionFailed</Code><Message>At least one</Message></Error>"
        honours = self.mode is not Mode.IGNORES_CONDITIONS
        if honours and headers.get(b"if-none-match") == b"*":
            if path in self.objects:
                return refused
            if self.mode is Mode.RACY:
                await self._wait_for_a_rival(path)
        if honours and b"if-match" in headers and self.objects.get(path, (b"", b""))[1] != headers[b"if-match"]:
            return refused
        etag = b'"' + hashlib.md5(body).hexdigest().encode() + b'"'
        self.objects[path] = (body, etag)
        self.first.setdefault(path, (body, etag))
        return 200, [(b"etag", etag)], b""

    async def _wait_for_a_rival(self, path: bytes) -> None:
        """Between its check and its write, hold a create until a second
        create of the same key has passed the check too (or a while)."""
        async with self.arrivals:
            self.creating[path] = self.creating.get(path, 0) + 1
            self.arrivals.notify_all()
            with trio.move_on_after(RACE_WINDOW):
                while self.creating[path] < 2:
                    await self.arrivals.wait()


async def serve_stand_in(nursery: trio.Nursery, mode: Mode) -> str:
    """Start a stand-in; the tier URL of its bucket."""
    listeners = await nursery.start(partial(trio.serve_tcp, StandIn(mode).serve, 0, host="127.0.0.1"))
    return f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}/bucket"


FAILS = {
    Mode.CONFORMING: [],
    Mode.IGNORES_CONDITIONS: [SEQUENTIAL, RACING, IF_MATCH],
    Mode.RACY: [RACING],
    Mode.STALE_READS: [READ_AFTER_WRITE],
}


@pytest.mark.parametrize("mode", list(Mode), ids=[m.name.lower() for m in Mode])
async def test_each_property_fails_on_the_tier_that_breaks_it(mode: Mode) -> None:
    with trio.fail_after(DEADLINE):
        async with trio.open_nursery() as nursery:
            url = await serve_stand_in(nursery, mode)
            async with open_s3(parse_tier_url(url), Credentials("AKID", "secret")) as s3:
                report = await check_blob_tier(s3)
            nursery.cancel_scope.cancel()
    assert report.failed == FAILS[mode], report.lines()
    assert report.ok is (mode is Mode.CONFORMING)


def _env(weed: WeedServer | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    if weed is not None:
        env.update(AWS_ACCESS_KEY_ID=weed.access_key, AWS_SECRET_ACCESS_KEY=weed.secret_key)
    return env


async def test_the_command_refuses_a_tier_that_ignores_conditional_writes(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with trio.open_nursery() as nursery:
            url = await serve_stand_in(nursery, Mode.IGNORES_CONDITIONS)
            env = {**_env(None), "AWS_ACCESS_KEY_ID": "AKID", "AWS_SECRET_ACCESS_KEY": "secret"}
            proc = await trio.run_process(
                [sys.executable, "-m", "capsulefs", "--state", str(tmp_path / "state"), "fleet", "check-blobs", url],
                capture_stdout=True, capture_stderr=True, check=False, env=env, cwd=REPO)
            nursery.cancel_scope.cancel()
    out, err = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 1, out + err
    assert "does NOT conform" in out and "FAIL  sequential If-None-Match: the second write was accepted" in out
    assert err.strip().splitlines() == [
        "capsulefs: error: the blob tier fails: sequential If-None-Match, racing If-None-Match, "
        "If-Match with a stale ETag"]


def _make_bucket(weed: WeedServer, bucket: str) -> None:
    async def make() -> None:
        async with open_s3(parse_tier_url(weed.tier_url(bucket)), Credentials(weed.access_key, weed.secret_key)) as s3:
            await s3.create_bucket()

    trio.run(make)


def _keys(weed: WeedServer, bucket: str) -> list[str]:
    async def keys() -> list[str]:
        async with open_s3(parse_tier_url(weed.tier_url(bucket)), Credentials(weed.access_key, weed.secret_key)) as s3:
            return [o.key async for o in s3.list("")]

    return trio.run(keys)


def test_seaweedfs_passes_and_the_check_leaves_nothing(weed_server: WeedServer, state_dir: Path) -> None:
    bucket = "check-" + secrets.token_hex(4)
    _make_bucket(weed_server, bucket)
    proc = run_cli("fleet", "check-blobs", weed_server.tier_url(bucket, "eu/fleet"), state=state_dir,
                   env=_env(weed_server))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"blob tier {weed_server.endpoint}/{bucket}/eu/fleet/: conforms"
    assert [line.split(":")[0].strip() for line in lines[1:]] == [
        "ok    sequential If-None-Match", "ok    racing If-None-Match", "ok    If-Match with a stale ETag",
        "ok    read-after-write"]
    assert "1 of 8 writers won, 7 were refused (412)" in proc.stdout
    assert proc.stderr == ""
    assert _keys(weed_server, bucket) == []


def test_credentials_from_the_host_keychain(weed_server: WeedServer, state_dir: Path) -> None:
    bucket = "check-" + secrets.token_hex(4)
    _make_bucket(weed_server, bucket)
    env = _env(None)
    url = weed_server.tier_url(bucket)
    proc = run_cli("fleet", "check-blobs", url, state=state_dir, env=env)
    assert proc.returncode == 1 and "no credentials for the blob tier" in proc.stderr
    for name, value in [("AWS_ACCESS_KEY_ID", weed_server.access_key),
                        ("AWS_SECRET_ACCESS_KEY", weed_server.secret_key)]:
        run_cli("secret", "set", name, state=state_dir, env=env, input=value, check=True)
    proc = run_cli("fleet", "check-blobs", url, state=state_dir, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(("args", "needs_weed", "match"), [
    (["http://key:pw@127.0.0.1:1/bucket"], False, "carries no credentials"),
    (["s3://bucket"], False, "http://HOST"),
    (["--writers", "1", "http://127.0.0.1:1/bucket"], False, "--writers is 2 to 64"),
    (["WEED/no-such-bucket"], True, "no such bucket"),
    (["http://127.0.0.1:1/bucket"], False, "cannot connect"),
])
def test_errors_are_one_line(args: list[str], needs_weed: bool, match: str, request: pytest.FixtureRequest,
                             state_dir: Path) -> None:
    env = _env(None)
    env.update(AWS_ACCESS_KEY_ID="AKID", AWS_SECRET_ACCESS_KEY="secret")
    if needs_weed:
        weed: WeedServer = request.getfixturevalue("weed_server")
        env = _env(weed)
        args = [a.replace("WEED", weed.endpoint) for a in args]
    proc = run_cli("fleet", "check-blobs", *args, state=state_dir, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and match in proc.stderr, proc.stderr


def test_the_cli_does_not_load_httpx_for_other_commands() -> None:
    code = ("import sys, capsulefs.cli as c; c.build_parser(); "
            "print(sorted(m for m in ('httpx', 'capsulefs.fleet.s3') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert proc.stdout.strip() == "[]"
