"""The capsulefs daemon: one process serving one mount of the host store.

Rules:
  * One mount per process: pyfuse3 keeps one session per process.
  * ``pyfuse3.main()`` runs as a task in the daemon's trio nursery, beside
    the signal watcher; every background task belongs to that nursery.
  * SIGINT and SIGTERM stop the agents first, while the mount still serves
    them (each stops at a step boundary and may journal it), then end the
    FUSE loop and unmount; a second signal unmounts at once. ``capsulefs
    umount`` asks the daemon so (SIGTERM to the pid the root's
    ``user.capsulefs.pid`` names). An unmount from outside (``fusermount3
    -u``, ``umount``) ends the loop too, and the daemon exits, but the
    agents lose their mount before they stop. While the daemon serves, no
    SIGINT or SIGTERM has its default effect: one that comes before the
    watcher runs starts the shutdown as soon as it does; one during the
    final clean-up is logged, and the clean-up finishes.
  * After an internal error the daemon never unmounts by itself: the view
    goes read-only (``LiveHost.enter_failsafe``), the error is logged and
    shown in every agent's ``.control/status``. A mount that suddenly looks
    empty makes mirror and backup tools delete data.
  * In systemd mode the daemon tells systemd ``READY=1`` once the mount is
    up (``$NOTIFY_SOCKET``, sd_notify's datagram protocol, no library) and
    ``STOPPING=1`` when it goes down.

Theory of operation: :class:`Daemon` serves a :class:`~capsulefs.core.view.host.LiveHost`
(the pure view of the store) through :class:`~capsulefs.mount.ops.Operations`
(the pyfuse3 adapter); capsulefs/daemon/root.py builds it and everything
it serves. :meth:`Daemon.serve` mounts, starts the services (the move
service, the agent runtime...) in its nursery, calls ``task_status.started()``
once the kernel has the mount, and returns when the mount is gone.

An agent's lifecycle (the hooks the move driver calls, removal) is
capsulefs/daemon/agents.py's.

While mounted the daemon keeps a runtime file, ``STATE/mount/daemon.json``
(mount point, pid, and what services add: the move port), removed at exit;
:func:`find_daemon` ignores one whose process or mount is gone.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import socket
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import pyfuse3
import trio

from capsulefs.core.errors import CapsuleError
from capsulefs.core.fsutil import atomic_write
from capsulefs.core.view.host import LiveHost
from capsulefs.mount.ops import Operations
from capsulefs.daemon.readahead import tune_read_ahead
from capsulefs.core.store.layout import WORK_DIR

log = logging.getLogger(__name__)

FSNAME = "capsulefs"
RUNTIME_FILE = "daemon.json"  # under WORK_DIR while a daemon serves: {"mountpoint", "pid", "move_port"}
LOCK_FILE = "daemon.lock"  # under WORK_DIR: flocked by the daemon for its life (see holding_state)
#: On the mount's root: "PID PIDNS" (the daemon's pid, and the inode of the
#: pid namespace it counts in), so that `capsulefs umount` can ask it to stop
#: (agents first, then the unmount) rather than pull the mount away.
PID_XATTR = "user.capsulefs.pid"
HOLDER_FILE = "holder.json"  # under WORK_DIR while someone holds LOCK_FILE: {"pid", "doing"}


def pid_note() -> str:
    """This process as ``PID_XATTR`` names it."""
    return f"{os.getpid()} {os.stat('/proc/self/ns/pid').st_ino}"


def work_dir(state_dir: str) -> str:
    """The daemon's work directory: the scratch area, snapshots and runtime file."""
    return os.path.join(state_dir, WORK_DIR)


def runtime_path(state_dir: str) -> str:
    return os.path.join(work_dir(state_dir), RUNTIME_FILE)


@contextmanager
def holding_state(state_dir: str, *, doing: str) -> Iterator[None]:
    """Hold the state directory alone: one daemon for its whole life, or a
    command that changes agents without one (offline ``rm``, ``move``,
    ``peer-serve``). A second daemon on the same state would run every agent
    twice on this host. The flock goes with the process, so a killed holder
    never blocks the next one. While it holds, a note of who and what
    (:data:`HOLDER_FILE`) lets a refused command name them."""
    os.makedirs(work_dir(state_dir), exist_ok=True)
    fd = os.open(os.path.join(work_dir(state_dir), LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    note = os.path.join(work_dir(state_dir), HOLDER_FILE)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CapsuleError(f"{_state_holder(state_dir, note)} already holds {state_dir}: {doing} refused") from None
        try:
            atomic_write(note, json.dumps({"pid": os.getpid(), "doing": doing}).encode(), mode=0o600)
        except OSError as exc:  # only a refusal's wording depends on it: a full disk must not stop us
            log.warning("could not leave a note of who holds %s (%s)", state_dir, exc)
        try:
            yield
        finally:
            try:
                os.unlink(note)  # (under the flock: nobody else wrote it meanwhile)
            except OSError:
                pass
    finally:
        os.close(fd)


def _state_holder(state_dir: str, note: str) -> str:
    """Who holds the state directory, as well as can be told: the daemon by
    its runtime file, another command by its note (if its pid still runs)."""
    running = find_daemon(state_dir)
    if running:
        return f"a daemon (pid {running['pid']}, mounted on {running['mountpoint']})"
    try:
        with open(note, "rb") as f:
            info = json.loads(f.read(4096))
        pid, what = int(info["pid"]), str(info["doing"])
        if pid <= 0:
            raise ValueError(pid)
        os.kill(pid, 0)
    except (OSError, ValueError, KeyError, TypeError, OverflowError):
        return "another capsulefs daemon or command"  # (just starting, or it left no note we can use)
    return f"capsulefs (pid {pid}, {what[:200]!r})"


def find_daemon(state_dir: str) -> dict[str, object] | None:
    """The runtime file of the daemon serving ``state_dir``, if one runs and its
    mount is up (a file left by a killed daemon is ignored)."""
    try:
        with open(runtime_path(os.path.abspath(state_dir))) as f:
            info = json.load(f)
        pid, mnt = int(info["pid"]), str(info["mountpoint"])
        os.kill(pid, 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return info if os.path.ismount(mnt) else None


def sd_notify(message: str) -> bool:
    """Send one sd_notify message; False if not run by systemd (no $NOTIFY_SOCKET)."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]  # abstract socket namespace
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        s.connect(addr)
        s.sendall(message.encode())
    return True


def mount_options(*, allow_other: bool = False, extra: tuple[str, ...] = ()) -> set[str]:
    opts = set(pyfuse3.default_options)  # default_permissions: the kernel checks modes
    opts |= {f"fsname={FSNAME}", f"subtype={FSNAME}"}
    if allow_other:
        opts.add("allow_other")
    opts.update(extra)
    return opts


async def _first(signals: AsyncIterator[int]) -> int:
    """The next signal a receiver gets."""
    async for signum in signals:
        return signum
    raise RuntimeError("the signal receiver ended")


class Service(Protocol):
    """A background service of the daemon (``serve_*(task_status=...)``,
    trio style: ``started()`` once it serves, then runs until cancelled)."""

    async def __call__(self, *, task_status: trio.TaskStatus[Any] = ...) -> None: ...


class Stopping(Protocol):
    async def on_shutdown(self) -> None:
        """Before the unmount, the mount still serving (the agent runtime
        stops its agents). Cancelled by a second signal: stop at once."""


class RuntimeInfo(Protocol):
    def runtime_info(self) -> Mapping[str, object]:
        """What the runtime file says besides mount point and pid (the move port)."""
        ...


class KernelEntries:
    """Tells the kernel that a name at the mount's root appeared or vanished
    (an agent moved in, retired, removed), once the kernel serves the mount
    (before, nothing is cached: at startup, recovery activates before INIT)."""

    def __init__(self, ops: Operations) -> None:
        self.ops = ops
        self._up = False

    def serving(self) -> None:
        self._up = True

    def changed(self, name: str) -> None:
        if self._up:
            self.ops.kernel.invalidate_entry(pyfuse3.ROOT_INODE, os.fsencode(name))


class Daemon:
    """Mounts one view, serves it until unmounted or signalled (see the module's rules)."""

    def __init__(
        self,
        state_dir: str,
        mountpoint: str,
        *,
        view: LiveHost,
        ops: Operations,
        entries: KernelEntries,
        services: Sequence[Service] = (),
        stopping: Sequence[Stopping] = (),
        runtime_info: Sequence[RuntimeInfo] = (),
        allow_other: bool = False,
        options: tuple[str, ...] = (),
        notify: Callable[[str], bool] = sd_notify,
    ) -> None:
        self.state_dir = os.path.abspath(state_dir)
        self.mountpoint = os.path.abspath(mountpoint)
        self.live = view
        self.ops = ops
        self.entries = entries
        #: ``serve_*(task_status=...)`` callables started in the daemon's
        #: nursery once the mount is up, before READY=1, in this order, and
        #: cancelled when the mount goes away.
        self.services = tuple(services)
        #: Told before the unmount, in this order (the agent runtime).
        self.stopping = tuple(stopping)
        self.runtime_info = tuple(runtime_info)
        self.allow_other = allow_other
        self.options = options
        self.notify = notify
        self._stopped_by_us = False
        self._watching = False  # the signal watcher runs (before: a signal waits for it; after: logged)
        self._early_signal: int | None = None
        self._kernel_up = False  # services started

    # -- serving ---------------------------------------------------------------------
    async def serve(self, *, task_status: trio.TaskStatus[bool] = trio.TASK_STATUS_IGNORED) -> None:
        """Mount, serve until unmounted or signalled, then clean up. Started
        with True once the mount serves, or with False at the end if it
        ended (unmounted from outside, signalled) before that."""
        opts = mount_options(allow_other=self.allow_other, extra=self.options)
        previous = {s: signal.signal(s, self._signal_unwatched) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            await self._serve(opts, task_status)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _signal_unwatched(self, signum: int, frame: object) -> None:
        """SIGINT/SIGTERM while the watcher does not run (it restores this
        handler when it ends, and redelivers what it had not read)."""
        if self._watching:
            log.warning("got %s: already unmounting; the clean-up finishes first", signal.Signals(signum).name)
        elif self._early_signal is None:
            self._early_signal = signum  # the watcher acts on it once it runs

    async def _serve(self, opts: set[str], task_status: trio.TaskStatus[bool]) -> None:
        log.info("mounting %s on %s", self.state_dir, self.mountpoint)
        pyfuse3.init(self.ops, self.mountpoint, opts)
        self.ops.root_xattrs[PID_XATTR] = pid_note().encode()  # whom `capsulefs umount` asks to stop
        try:
            async with trio.open_nursery() as nursery:
                self.ops.nursery = nursery  # background blob checks
                await nursery.start(self._watch_signals)
                nursery.start_soon(self._run_fuse, nursery.cancel_scope)
                nursery.start_soon(tune_read_ahead, self.mountpoint)
                for service in self.services:
                    await nursery.start(service)
                self._kernel_up = True
                self.entries.serving()
                log.info("capsulefs mounted on %s", self.mountpoint)
                self._write_runtime()
                self.notify("READY=1")
                task_status.started(True)
        finally:
            self._remove_runtime()
            self.notify("STOPPING=1")
            self.ops.release_all()
            pyfuse3.close(unmount=self._stopped_by_us)
            self.live.close()
            log.info("capsulefs unmounted from %s", self.mountpoint)
        if not self._kernel_up:
            log.warning("the mount ended while the daemon was starting its services")
            task_status.started(False)

    def _write_runtime(self) -> None:
        info: dict[str, object] = {"mountpoint": self.mountpoint, "pid": os.getpid()}
        for source in self.runtime_info:
            info |= source.runtime_info()
        os.makedirs(os.path.dirname(runtime_path(self.state_dir)), exist_ok=True)
        atomic_write(runtime_path(self.state_dir), (json.dumps(info, sort_keys=True) + "\n").encode())

    def _remove_runtime(self) -> None:
        try:
            with open(runtime_path(self.state_dir)) as f:
                mine = json.load(f).get("pid") == os.getpid()
            if mine:
                os.unlink(runtime_path(self.state_dir))
        except (OSError, ValueError):
            pass

    async def _run_fuse(self, cancel_scope: trio.CancelScope) -> None:
        await pyfuse3.main()
        cancel_scope.cancel()  # the mount is gone: stop the other services

    async def _watch_signals(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """SIGINT or SIGTERM: stop the agents while the mount still serves
        them (each at a step boundary, within the supervisor's grace
        period), then unmount. A second signal unmounts at once."""
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            self._watching = True
            task_status.started()
            signum = self._early_signal if self._early_signal is not None else await _first(signals)
            log.info("got %s: stopping the agents, then unmounting %s", signal.Signals(signum).name, self.mountpoint)
            async with trio.open_nursery() as nursery:

                async def cut_short() -> None:
                    async for signum in signals:
                        log.warning("got %s again: unmounting now", signal.Signals(signum).name)
                        nursery.cancel_scope.cancel()

                nursery.start_soon(cut_short)
                await self._stop_first()
                nursery.cancel_scope.cancel()
            self._stopped_by_us = True
            pyfuse3.terminate()
            async for signum in signals:  # keep them from killing us mid-unmount
                log.warning("got %s: already unmounting", signal.Signals(signum).name)

    async def _stop_first(self) -> None:
        """Each ``stopping`` component's ``on_shutdown`` (cancelled, by a
        second signal: it must then stop at once, e.g. kill rather than wait)."""
        for component in self.stopping:
            try:
                await component.on_shutdown()
            except Exception:  # unmount all the same: what is left stops with the services
                log.exception("stopping %r before unmounting failed", component)

    def stop(self) -> None:
        """End serving and unmount (from the daemon's own trio loop)."""
        self._stopped_by_us = True
        pyfuse3.terminate()
