"""Real mounts: an agent uploads a blob with ``cp`` and journals an attachment naming it."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from capsulefs.core.capsule import format as fmt
from capsulefs.core.store.host_store import HostStore
from helpers import make_agent
from mount_kit import capsulefs, check_chains, mounted, needs_fuse

pytestmark = [pytest.mark.fuse, needs_fuse]

PNG = b"\x89PNG\r\n\x1a\n" + os.urandom(300_000)  # several FUSE writes
SHA = hashlib.sha256(PNG).hexdigest()


@pytest.fixture
def mnt(store: HostStore, state_dir: Path, tmp_path: Path):
    make_agent(store, "alice")
    m = tmp_path / "mnt"
    with mounted(state_dir, m):
        yield m / "alice"
    assert not os.listdir(state_dir / "mount" / "uploads")  # nothing left of any upload


def sh(cmd: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, **env))


def test_cp_then_append_puts_the_image_in_the_next_render(mnt: Path, tmp_path: Path, store: HostStore) -> None:
    pic = tmp_path / "pic.png"
    pic.write_bytes(PNG)
    up = sh('cp "$PIC" "$AGENT/artifacts/blobs/$(sha256sum "$PIC" | cut -c1-64)"', PIC=str(pic), AGENT=str(mnt))
    assert up.returncode == 0, up.stderr
    assert SHA in os.listdir(mnt / fmt.BLOBS_DIR) and (mnt / fmt.blob_path(SHA)).read_bytes() == PNG
    assert store.read_blob(SHA) == PNG
    drafts = [{"kind": "model_switch", "provider": "anthropic", "model": "claude-x"},
              {"kind": "attachment", "blob": SHA, "media_type": "image/png", "size": len(PNG), "name": "pic.png"},
              {"kind": "user_message", "text": "what is in this picture?"}]
    with open(mnt / fmt.JOURNAL, "a") as f:
        f.write("".join(json.dumps(d) + "\n" for d in drafts))
    assert [r.kind for r in check_chains((mnt / fmt.JOURNAL).read_bytes())] == [d["kind"] for d in drafts]
    body = json.loads(capsulefs("render", str(mnt)).stdout)  # read through the mount, blob included
    (message,) = body["messages"]
    image, text = message["content"]
    assert image == {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                 "data": base64.b64encode(PNG).decode()}}
    assert text == {"type": "text", "text": "what is in this picture?"}
    assert capsulefs("verify", str(mnt)).stdout.startswith("OK:")


def test_bytes_that_do_not_match_the_name_are_refused_and_leave_nothing(mnt: Path, tmp_path: Path,
                                                                         store: HostStore) -> None:
    other = tmp_path / "other.png"
    other.write_bytes(PNG[:-1] + b"!")
    up = sh(f'cp "$SRC" "$AGENT/artifacts/blobs/{SHA}"', SRC=str(other), AGENT=str(mnt))
    assert up.returncode != 0 and "Invalid argument" in up.stderr
    assert SHA not in os.listdir(mnt / fmt.BLOBS_DIR) and not (mnt / fmt.blob_path(SHA)).exists()
    assert not store.has_blob(SHA) and not store.has_blob(hashlib.sha256(other.read_bytes()).hexdigest())
    assert SHA not in store.find("alice").manifest().blobs()
    # an attachment naming a blob the agent lacks is refused too
    draft = {"kind": "attachment", "blob": SHA, "media_type": "image/png", "size": len(PNG)}
    append = sh(f"echo '{json.dumps(draft)}' >> \"$AGENT/{fmt.JOURNAL}\"", AGENT=str(mnt))
    assert append.returncode != 0 and "Invalid argument" in append.stderr
    assert (mnt / fmt.JOURNAL).read_bytes() == b""
