"""The daemon sets readahead on its mount's bdi: finding the device, and on a real mount."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from capsulefs.core.store.host_store import HostStore
from capsulefs.daemon.readahead import READ_AHEAD_KB, mount_device
from helpers import make_agent, wait_until
from mount_kit import mounted, needs_fuse

MOUNTINFO = (
    "22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
    "40 22 0:40 / /var/tmp/a\\040b/mnt rw,nosuid,nodev,relatime shared:20 - fuse.capsulefs capsulefs rw\n"
    "41 22 0:41 / /mnt rw shared:21 - fuse.capsulefs capsulefs rw\n"
    "42 41 0:42 / /mnt rw shared:22 - fuse.capsulefs capsulefs rw\n"
)


def test_mount_device_unescapes_the_path() -> None:
    assert mount_device(MOUNTINFO, "/var/tmp/a b/mnt") == "0:40"
    assert mount_device(MOUNTINFO, "/var/tmp/a\\040b/mnt") is None


def test_mount_device_takes_the_mount_on_top() -> None:
    assert mount_device(MOUNTINFO, "/mnt") == "0:42"
    assert mount_device(MOUNTINFO, "/elsewhere") is None


@pytest.mark.fuse
@needs_fuse
def test_a_real_mount_gets_the_readahead(store: HostStore, state_dir: Path, tmp_path: Path) -> None:
    make_agent(store, "alice")
    mnt = tmp_path / "mnt"
    with mounted(state_dir, mnt):
        st = os.stat(mnt)
        bdi = Path(f"/sys/class/bdi/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/read_ahead_kb")
        # the daemon sets it once the kernel has its INIT answer
        wait_until(lambda: int(bdi.read_text()) == READ_AHEAD_KB, f"the mount's readahead of {READ_AHEAD_KB} KiB")
