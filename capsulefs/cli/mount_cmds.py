"""Commands for the FUSE mount: mount, umount.

``capsulefs mount MOUNTPOINT`` runs the daemon in the foreground (the
default; ``--systemd`` adds sd_notify readiness), or with ``--background``
forks it off and returns once the mount is up (what the
``mount.fuse.capsulefs`` helper and ``/etc/fstab`` need). ``--listen HOST:PORT``
makes it answer peers' moves too (docs/move.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from capsulefs.cli import UsageError
from capsulefs.cli.common import state_dir
from capsulefs.core.errors import CapsuleError

if TYPE_CHECKING:
    from capsulefs.core.fleet.config import FleetConfig

log = logging.getLogger(__name__)

#: Mount options (-o) the daemon acts on; the rest belong to mount(8) or systemd.
FUSE_OPTIONS = frozenset({"allow_other"})
#: How long ``umount`` waits for the daemon to let go of the mount point.
UMOUNT_WAIT = 10.0
#: Seconds `capsulefs umount` gives the daemon it asked to stop (its agents'
#: grace period, and a margin) before it unmounts from outside.
STOP_WAIT = 30.0
#: Seconds it waits for the mount to name its daemon (a child process asks).
ASK_WAIT = 3.0


def _unescape(field: str) -> str:
    """A path as /proc/self/mounts writes it: space, tab, newline and
    backslash as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def _mount_table() -> Iterator[tuple[str, str, list[str]]]:
    """(mount point, file system type, options) of every line of
    /proc/self/mounts, in order (a mount on top of another comes later)."""
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 4:
                yield _unescape(parts[1]), parts[2], parts[3].split(",")


def fuse_mounts() -> dict[str, str]:
    """mount point -> file system type, for every FUSE mount of this host."""
    return {mnt: fstype for mnt, fstype, _opts in _mount_table() if fstype.startswith("fuse")}


def _configure_logging(args: argparse.Namespace) -> None:
    level = logging.WARNING - 10 * min(args.verbose, 2)
    if args.debug:
        level = logging.DEBUG
    fmt = "%(levelname)s %(name)s: %(message)s" if args.systemd else \
        "%(asctime)s capsulefs[%(process)d] %(levelname)s %(name)s: %(message)s"
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler: logging.Handler
    if args.log_file:
        handler = logging.FileHandler(args.log_file)
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(fmt))
    root.addHandler(handler)
    root.setLevel(min(level, logging.INFO))
    handler.setLevel(min(level, logging.INFO))


def _interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.1 <= value <= 86400:  # (nan too)
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds from 0.1 to 86400")
    return value


def _run_daemon(args: argparse.Namespace, on_ready: Callable[[bool], None] | None = None) -> int:
    """Run the daemon until it unmounts; ``on_ready`` is told once whether
    the mount came up."""
    from capsulefs.daemon.daemon import holding_state

    # One daemon per state directory, for its whole life: a second would run
    # every agent a second time on this host.
    with holding_state(state_dir(args), doing=f"mounting it on {args.mountpoint}"):
        if args.directory is not None:  # (under the state's lock: a mount refused as second changes nothing)
            from capsulefs.core.fleet import config

            config.save(state_dir(args), args.fleet_config)
        return _serve(args, on_ready)


def _serve(args: argparse.Namespace, on_ready: Callable[[bool], None] | None) -> int:
    import trio

    from capsulefs.daemon.root import MountConfig, compose
    from capsulefs.peer.book import parse_address

    opts = [o for o in (args.o or "").split(",") if o]
    ignored = [o for o in opts if o not in FUSE_OPTIONS]
    if ignored:
        log.info("ignoring mount options %s (for mount(8) or systemd)", ",".join(ignored))
    daemon = compose(MountConfig(
        state_dir=state_dir(args),
        mountpoint=args.mountpoint,
        allow_other=args.allow_other or "allow_other" in opts,
        run_agents=not args.no_run,
        listen=parse_address(args.listen, listen=True) if args.listen else None,
        metrics_file=args.metrics_file,
        metrics_interval=args.metrics_interval,
        fleet=args.fleet_config,
        advertise=args.advertise,
    )).daemon

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            up = await nursery.start(daemon.serve)
            if on_ready is not None:
                on_ready(bool(up))

    trio.run(main)
    return 0


def _fleet_config(args: argparse.Namespace) -> FleetConfig | None:
    """``--directory`` (checked here; saved in the state dir for later
    commands by the daemon, once it holds the state: :func:`_run_daemon`),
    else the saved one, else None: peer-to-peer. FleetConfigError: one line."""
    from capsulefs.core.fleet import config

    from capsulefs.fleet.credentials import tier_credentials

    if args.directory is None:
        for flag, value in (("--directory-prefix", args.directory_prefix), ("--blobs", args.blobs)):
            if value is not None:
                raise config.FleetConfigError(f"{flag} needs --directory")
        saved = config.load(state_dir(args))
        if saved is not None and saved.blobs is not None:
            tier_credentials(state_dir(args))  # (said here, before a fork: one line on the terminal)
        return saved
    cfg = config.make(args.directory, args.directory_prefix, args.blobs)
    if cfg.blobs is not None:
        tier_credentials(state_dir(args))  # (before the daemon saves it: nothing written for a mount that cannot run)
    return cfg


def _advertised(args: argparse.Namespace) -> str | None:
    """The address published in the directory for other hosts (fleet mode
    with --listen): --advertise, else --listen's, which must then be one
    another host can reach. UsageError: one line."""
    from capsulefs.peer.book import parse_address

    if args.advertise is not None and (args.fleet_config is None or not args.listen):
        raise UsageError("--advertise needs the fleet mode (--directory) and --listen")
    if args.fleet_config is None or not args.listen:
        return None
    given = args.advertise if args.advertise is not None else args.listen
    host, port = parse_address(given, listen=True)
    if host in ("0.0.0.0", "::", "*") or port == 0:
        flag = "--advertise" if args.advertise is not None else "--listen"
        raise UsageError(f"{flag} {given}: other hosts cannot reach this host there (a wildcard host or port 0); "
                         f"give --advertise HOST:PORT, the address they reach --listen at")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def cmd_mount(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.mountpoint):
        print(f"capsulefs: error: mount point {args.mountpoint} is not a directory", file=sys.stderr)
        return 1
    if os.path.abspath(args.mountpoint) in fuse_mounts():
        print(f"capsulefs: error: {args.mountpoint} is already mounted", file=sys.stderr)
        return 1
    if args.metrics_file:
        from capsulefs.daemon.metrics_file import check_metrics_file

        why = check_metrics_file(args.metrics_file)
        if why is not None:
            print(f"capsulefs: error: {why}", file=sys.stderr)
            return 1
    args.fleet_config = _fleet_config(args)
    args.advertise = _advertised(args)
    if args.background:
        return _background(args)
    _configure_logging(args)
    return _run_daemon(args)


#: Where ``mount --background`` logs without ``--log-file`` (under the state
#: directory, as contrib/mount.fuse.capsulefs does): a daemon with no
#: terminal must leave its reasons somewhere a person can find them.
BACKGROUND_LOG = os.path.join("mount", "daemon.log")
#: The first byte the background daemon writes to its parent: mounted, or
#: failed (then one line of why follows).
_MOUNTED, _FAILED = b"1", b"0"


def _failure_line(exc: BaseException) -> str:
    """Why the daemon could not mount, in one line: the message of a domain
    or OS error (the first one of an exception group), else the exception's
    type and message."""
    exc = _leaf(exc)
    if isinstance(exc, CapsuleError):
        text = str(exc)
    elif isinstance(exc, OSError):
        text = f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")
    else:
        text = f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())[:1000] or type(exc).__name__


def _background(args: argparse.Namespace) -> int:
    """Fork the daemon off; return 0 once it has mounted, 1 (after one line
    on stderr saying why, and naming the daemon's log) if it failed."""
    if not args.log_file:
        args.log_file = os.path.join(state_dir(args), BACKGROUND_LOG)
    args.log_file = os.path.abspath(args.log_file)
    try:  # (here, while a terminal can still be told)
        os.makedirs(os.path.dirname(args.log_file), exist_ok=True)
        with open(args.log_file, "ab"):
            pass
    except OSError as exc:
        raise CapsuleError(f"cannot write the daemon's log {args.log_file}: {exc.strerror or exc}") from None
    r, w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(w)
        with os.fdopen(r, "rb") as f:
            answer = f.read(4096)
        if answer[:1] == _MOUNTED:
            return 0
        why = answer[1:].decode(errors="replace").strip() or "the daemon exited before mounting"
        print(f"capsulefs: error: cannot mount {args.mountpoint}: {why} (the daemon's log: {args.log_file})",
              file=sys.stderr)
        return 1
    # The daemon: a new session, no terminal, logging to its file.
    os.close(r)
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    told = False

    def tell(up: bool) -> None:
        nonlocal told
        told = True
        try:
            os.write(w, _MOUNTED if up else _FAILED + b"the mount ended while starting")
        finally:
            os.close(w)

    code = 1
    try:
        _configure_logging(args)
        code = _run_daemon(args, on_ready=tell)
    except BaseException as exc:  # the parent prints the reason
        if isinstance(_leaf(exc), (CapsuleError, OSError)):
            log.error("the daemon failed: %s", _failure_line(exc))
        else:
            log.exception("the daemon failed")
        if not told:
            try:
                os.write(w, _FAILED + _failure_line(exc).encode(errors="replace"))
            except OSError:
                pass  # (the parent is gone)
    finally:
        os._exit(code)


def _leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def cmd_umount(args: argparse.Namespace) -> int:
    mnt = os.path.abspath(args.mountpoint)
    mounts = fuse_mounts()
    if mnt not in mounts:
        print(f"capsulefs: error: {args.mountpoint} is not a FUSE mount", file=sys.stderr)
        return 1
    if mounts[mnt] != "fuse.capsulefs" and not args.force:
        print(f"capsulefs: error: {args.mountpoint} is a {mounts[mnt]} mount, not capsulefs (use --force)", file=sys.stderr)
        return 1
    if mounts[mnt] == "fuse.capsulefs":
        # Ask the daemon to stop: it stops the agents while they still have
        # their mount, then unmounts. Pulling the mount away first would cut
        # an agent off in the middle of its step.
        pidfd = _daemon_pid(mnt)
        if pidfd is not None and _ask_to_stop(pidfd, mnt):
            return 0
    fusermount = shutil.which("fusermount3") or shutil.which("fusermount")
    if os.geteuid() == 0 or fusermount is None:
        argv = ["umount", "-i", mnt]  # -i: not contrib/umount.fuse.capsulefs, which called us
    else:
        argv = [fusermount, "-u", mnt]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"capsulefs: error: {' '.join(argv)}: {proc.stderr.strip() or proc.returncode}", file=sys.stderr)
        return 1
    deadline = time.monotonic() + UMOUNT_WAIT
    while mnt in fuse_mounts() and time.monotonic() < deadline:
        time.sleep(0.05)
    return 0


def _mount_owner(mnt: str) -> int | None:
    """The uid the FUSE mount on ``mnt`` belongs to (its ``user_id``
    option), or None. The last line for the path: the mount on top."""
    owner = None
    for path, _fstype, opts in _mount_table():
        if path == mnt:
            ids = [o for o in opts if o.startswith("user_id=")]
            owner = int(ids[0][len("user_id="):]) if ids else None
    return owner


#: Reads the root's PID_XATTR in a child process: one that hangs on a stuck
#: daemon is killed, where a thread would keep the mount busy (and the
#: fallback unmount with it).
_ASK = "import os, sys; sys.stdout.write(os.getxattr(sys.argv[1], sys.argv[2]).decode())"


def _daemon_pid(mnt: str) -> int | None:
    """A pidfd of the daemon as the mount's root names it (``PID_XATTR``),
    or None. The answer comes from whoever serves the mount, so it is
    trusted only for a process of our pid namespace that belongs to the
    mount's owner: nobody can have another user's process signalled. The
    pidfd keeps the answer from naming a reused pid by the time we signal."""
    from capsulefs.daemon.daemon import PID_XATTR

    try:
        asked = subprocess.run([sys.executable, "-I", "-S", "-c", _ASK, mnt, PID_XATTR],
                               capture_output=True, text=True, timeout=ASK_WAIT)
        pid, ns = (int(x) for x in asked.stdout.split())
        owner = _mount_owner(mnt)
        if asked.returncode != 0 or pid <= 0 or owner is None or ns != os.stat("/proc/self/ns/pid").st_ino:
            return None
        pidfd = os.pidfd_open(pid)
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    try:
        if os.stat(f"/proc/{pid}").st_uid == owner:
            return pidfd
    except OSError:
        pass
    os.close(pidfd)
    return None


def _ask_to_stop(pidfd: int, mnt: str) -> bool:
    """SIGTERM the daemon and wait for its mount to go; False (after saying
    why) if it could not be asked or did not finish within ``STOP_WAIT``."""
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGTERM)
    except OSError:
        return False
    finally:
        os.close(pidfd)
    deadline = time.monotonic() + STOP_WAIT
    while mnt in fuse_mounts():
        if time.monotonic() >= deadline:
            print(f"capsulefs: the daemon did not unmount {mnt} within {STOP_WAIT:.0f} s; "
                  f"unmounting it from outside", file=sys.stderr)
            return False
        time.sleep(0.05)
    return True


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("mount", help="mount every agent of the host store as live capsule directories")
    p.add_argument("mountpoint")
    p.add_argument("--state", metavar="DIR", default=argparse.SUPPRESS, help="host state directory")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--foreground", action="store_true", help="run in the foreground (the default)")
    mode.add_argument("--systemd", action="store_true", help="foreground, with sd_notify readiness (Type=notify)")
    mode.add_argument("--background", action="store_true", help="fork the daemon off once mounted (fstab, mount -t)")
    p.add_argument("--allow-other", action="store_true", help="let other users see the mount (needs user_allow_other)")
    p.add_argument("-o", metavar="OPTIONS", help="mount options, comma-separated (from mount(8))")
    p.add_argument("--log-file", metavar="FILE", help="log here instead of stderr")
    p.add_argument("--debug", action="store_true", help="log every request")
    p.add_argument("--no-run", action="store_true", help="serve the files only: run no agent processes")
    p.add_argument("--metrics-file", metavar="PATH",
                   help="write the metrics (as MNT/.control/metrics) to PATH atomically, for node_exporter's "
                        "textfile collector (name it *.prom)")
    p.add_argument("--metrics-interval", metavar="SECONDS", type=_interval, default=15.0,
                   help="seconds between writes of --metrics-file (default 15)")
    p.add_argument("--listen", metavar="HOST:PORT",
                   help="answer peers' moves there (port 0: any free port, written to STATE/mount/daemon.json); "
                        "without it this host moves agents out but accepts none")
    p.add_argument("--directory", metavar="etcd://HOST:PORT[,...]",
                   help="fleet mode: the directory on etcd (saved in the state dir: later mounts and 'fleet ls' "
                        "use it); agents run only while this host's lease there lives. Default: peer-to-peer, "
                        "or the directory saved by an earlier mount")
    p.add_argument("--directory-prefix", metavar="PREFIX", help="the fleet's key prefix in etcd (default /capsulefs/)")
    p.add_argument("--advertise", metavar="HOST:PORT",
                   help="fleet mode: the address other hosts reach this host's --listen at, published in the "
                        "directory (default: the --listen address, which then must name a host and a port)")
    p.add_argument("--blobs", metavar="http[s]://HOST:PORT/BUCKET[/PREFIX]",
                   help="with --directory: the fleet's blob tier (S3); every blob stored here is put there, and a "
                        "move between hosts on it sends host to host only what it lacks. Credentials: "
                        "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY from the environment, else the host keychain")
    p.set_defaults(func=cmd_mount)

    p = sub.add_parser("umount", help="unmount a capsulefs mount (the daemon then exits)")
    p.add_argument("mountpoint")
    p.add_argument("--force", action="store_true", help="unmount even if it is not a capsulefs mount")
    p.set_defaults(func=cmd_umount)
