"""A host's fleet configuration: which directory it is a member of, in the state dir.

Rules:
  * ``capsulefs mount --directory etcd://HOST:PORT[,...]`` saves it as
    ``STATE/fleet.json`` (one small JSON object, written atomically);
    later commands (``fleet ls``, ``fleet hosts``, a mount without
    ``--directory``) default to it. No file: peer-to-peer (the default).
  * ``--blobs http[s]://HOST[:PORT]/BUCKET[/PREFIX]`` (with ``--directory``)
    names the fleet's blob tier; it is saved beside the directory. Its
    credentials are never in the file (nor in a capsule): they come from the
    environment or the host keychain when the daemon starts.
  * The file is outside input when read: the strict loader, every field
    checked, one line naming the problem (:class:`FleetConfigError`).

Theory of operation: :func:`load` reads it (None if absent), :func:`save`
writes it; :func:`make` checks what a person typed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from capsulefs.core.capsule import format as fmt
from capsulefs.core.fleet.directory import Layout
from capsulefs.core.fleet.errors import FleetAddressError, FleetError
from capsulefs.core.fleet.etcd._ops import parse_endpoints
from capsulefs.core.fleet.s3_wire import TierURL, parse_tier_url
from capsulefs.core.fsutil import atomic_write
from capsulefs.core.store.layout import FLEET_FILE

__all__ = ["DEFAULT_PREFIX", "FleetConfig", "FleetConfigError", "config_path", "load", "make", "save"]

DEFAULT_PREFIX = "/capsulefs/"
MAX_CONFIG_BYTES = 64 * 1024


class FleetConfigError(FleetError):
    """The saved fleet configuration (or a flag for it) is not usable."""


@dataclass(frozen=True)
class FleetConfig:
    directory: str  # etcd://HOST:PORT[,...] (checked)
    prefix: str = DEFAULT_PREFIX  # the fleet's key prefix in etcd
    blobs: str | None = None  # the blob tier, http[s]://HOST[:PORT]/BUCKET[/PREFIX] (checked); None: no tier

    @property
    def layout(self) -> Layout:
        return Layout(self.prefix.encode("utf-8"))

    @property
    def tier(self) -> TierURL | None:
        return None if self.blobs is None else parse_tier_url(self.blobs)


def make(directory: str, prefix: str | None = None, blobs: str | None = None) -> FleetConfig:
    """A configuration from flags; FleetConfigError naming what is wrong."""
    prefix = DEFAULT_PREFIX if prefix is None else prefix
    try:
        parse_endpoints(directory)
    except FleetAddressError as exc:
        raise FleetConfigError(str(exc)) from None
    if not prefix.isprintable() or len(prefix) > 200:
        raise FleetConfigError(f"directory prefix {prefix[:80]!r} is not 1-200 printable characters")
    try:
        Layout(prefix.encode("utf-8"))
    except (ValueError, UnicodeEncodeError) as exc:
        raise FleetConfigError(str(exc)) from None
    if blobs is not None:
        try:
            parse_tier_url(blobs)
        except FleetAddressError as exc:
            raise FleetConfigError(str(exc)) from None
    return FleetConfig(directory=directory, prefix=prefix, blobs=blobs)


def config_path(state_dir: str) -> str:
    return os.path.join(state_dir, FLEET_FILE)


def load(state_dir: str) -> FleetConfig | None:
    """The saved configuration, None if there is none (peer-to-peer)."""
    path = config_path(state_dir)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise FleetConfigError(f"{path}: cannot be read: {exc.strerror}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise FleetConfigError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes")
    doc = fmt.load_json(data, path, error=FleetConfigError)
    if not isinstance(doc, dict) or set(doc) - {"directory", "prefix", "blobs"} \
            or not isinstance(doc.get("directory"), str) or not isinstance(doc.get("prefix", DEFAULT_PREFIX), str) \
            or not isinstance(doc.get("blobs", ""), str):
        raise FleetConfigError(f"{path}: not an object of \"directory\", \"prefix\" and \"blobs\" strings")
    try:
        return make(doc["directory"], doc.get("prefix", DEFAULT_PREFIX), doc.get("blobs"))
    except FleetConfigError as exc:
        raise FleetConfigError(f"{path}: {exc}") from None


def save(state_dir: str, cfg: FleetConfig) -> None:
    doc = {"directory": cfg.directory, "prefix": cfg.prefix}
    if cfg.blobs is not None:
        doc["blobs"] = cfg.blobs
    atomic_write(config_path(state_dir), (json.dumps(doc) + "\n").encode())
