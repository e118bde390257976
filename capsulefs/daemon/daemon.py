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

Theory of operation: :class:`Daemon` wires a :class:`~capsulefs.core.view.host.LiveHost`
(the pure view of the store) to :class:`~capsulefs.mount.ops.Operations`
(the pyfuse3 adapter). :meth:`Daemon.serve` mounts, calls ``task_status.started()``
once the kernel has the mount, and returns when the mount is gone.

The move driver (same process, same trio loop) uses the daemon as its
``AgentHooks`` (capsulefs.move.host): ``await freeze/resume/retire/prepare/activate(agent_id)``,
plus :meth:`Daemon.set_move_progress` for ``.control/status``. Each takes
effect for the next FUSE request. ``capsulefs.move.mount_moves.MountMoves`` is that
driver (a service, and the mount's ``.control/move``).

The daemon is also the mount's remover (``.control/remove``, which
``capsulefs rm`` writes while a daemon serves): :meth:`Daemon.remove` hides
the agent as a retire does, has the listeners stop its process, removes it
from the store and the areas beside it (capsulefs.agents.removal), all inside
:attr:`Daemon.move_guard` so that no move of it runs meanwhile.

While mounted the daemon keeps a runtime file, ``STATE/mount/daemon.json``
(mount point, pid, and what services add: the move port), removed at exit;
:func:`find_daemon` ignores one whose process or mount is gone.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager

import pyfuse3
import trio

from capsulefs.agents import grants
from capsulefs.core.errors import CapsuleError
from capsulefs.core.fsutil import atomic_write
from capsulefs.core.store.holder import HolderBook, HolderState, story
from capsulefs.core.store.lifecycle import Decision
from capsulefs.core.view.nodes import AgentState
from capsulefs.core.view.host import LiveHost
from capsulefs.core.view.errors import ReadOnly
from capsulefs.core.store.host_store import HostStore
from capsulefs.peer.identity import load_or_create_identity
from capsulefs.mount.ops import Operations
from capsulefs.move.host import holders_dir
from capsulefs.daemon.readahead import tune_read_ahead
from capsulefs.agents.removal import discard_leftovers, giving_up, refuse_if_moving

log = logging.getLogger(__name__)

FSNAME = "capsulefs"
WORK_DIR = "mount"  # under the state dir: scratch/ and snapshots/ (see core.view.scratch, core.view.snapshots)
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


#: How an agent of the store is shown at start, by its holder record, until
#: the move recovery settles it (absent: active, as a held agent, one whose
#: record is missing or unknown, which an operator must see to settle).
_START_STATE = {
    HolderState.FROZEN: AgentState.FROZEN,  # its move resumes; writes wait for the outcome
    HolderState.COMMITTING: AgentState.FROZEN,  # in doubt: the target may hold it already
    HolderState.RETIRED: AgentState.RETIRED,  # held elsewhere; recovery drops the files
    HolderState.REFUSED: AgentState.RETIRED,  # a move in that failed
    HolderState.REMOVED: AgentState.RETIRED,  # removed here (files left by a crash)
    HolderState.OFFERED: AgentState.RETIRED,  # a move in not activated: recovery refuses it
    HolderState.VERIFIED: AgentState.RETIRED,
    HolderState.PREPARED: AgentState.RETIRED,
    # Its record was lost or damaged: it may be held elsewhere now, where
    # writes taken here meanwhile would be missing (--learn would keep them
    # under recovery/, to merge by hand). Readable, not writable.
    HolderState.UNKNOWN: AgentState.FROZEN,
}


@asynccontextmanager
async def _no_moves(agent_id: str) -> AsyncIterator[None]:
    """The move guard of a daemon without move wiring: nothing moves."""
    yield


class Daemon:
    def __init__(
        self,
        state_dir: str,
        mountpoint: str,
        *,
        allow_other: bool = False,
        options: tuple[str, ...] = (),
        notify: Callable[[str], bool] = sd_notify,
    ) -> None:
        self.state_dir = os.path.abspath(state_dir)
        self.mountpoint = os.path.abspath(mountpoint)
        self.allow_other = allow_other
        self.options = options
        self.notify = notify
        store = HostStore.open(self.state_dir)
        grants.ensure(self.state_dir, store)  # (before a move brings an agent in: see grants)
        host_id = load_or_create_identity(self.state_dir).host_id
        self.live = LiveHost(
            store,
            host_id=host_id,
            work_dir=work_dir(self.state_dir),
            new_agent_id=lambda: secrets.token_hex(16),
            new_event_id=lambda: secrets.token_hex(12),
            now_ns=time.time_ns,
            owner_uid=os.getuid(),
        )
        self.ops = Operations(self.live)
        self.live.remover = self
        #: This host's holder records (the move service keeps them; read here).
        self.holders = HolderBook(holders_dir(self.state_dir))
        self._start_from_records()
        self.live.status_sections["record"] = self._record_status
        #: Other services of this daemon (the move service, the agent
        #: supervisor...): ``serve_*(task_status=...)`` callables started in
        #: the daemon's nursery once the mount is up, before READY=1, and
        #: cancelled when the mount goes away. Add them before ``serve``.
        self.services: list[Callable[..., Awaitable[None]]] = []
        #: Components that act on an agent's life (the agent supervisor):
        #: objects with async ``on_freeze``, ``on_resume``, ``on_retire``,
        #: ``on_activate`` and ``on_remove(agent_id)``, and optionally
        #: ``on_shutdown()`` (run before the unmount, the mount still serving).
        #: ``on_freeze`` runs before the mount refuses writes (so the agent's
        #: last work can be committed); the others run after the mount changed state
        #: (``on_remove``: once the agent is hidden, before its files go).
        self.listeners: list[object] = []
        #: ``move_guard(agent_id)``: an async context in which no move of the
        #: agent runs or starts; it raises MoveBusy at once if one runs. The
        #: move wiring (MountMoves) sets it; :meth:`remove` runs inside it.
        self.move_guard: Callable[[str], AbstractAsyncContextManager[None]] = _no_moves
        #: ``lifecycle(agent_id)``: the decision of core/store/lifecycle.py for
        #: the agent (what the mount shows, whether it runs); the move wiring
        #: sets it. None: every held agent is shown writable and runs.
        self.lifecycle: Callable[[str], Decision] | None = None
        #: ``doubt_detail(agent_id, name)``: why an agent in doubt is read-only, for status.
        self.doubt_detail: Callable[[str, str], str | None] | None = None
        #: What the runtime file says besides mount point and pid (services add keys).
        self.runtime_info: dict[str, object] = {}
        self._stopped_by_us = False
        self._watching = False  # the signal watcher runs (before: a signal waits for it; after: logged)
        self._early_signal: int | None = None
        self._kernel_up = False  # services started: the kernel may cache entries we must invalidate

    def _start_from_records(self) -> None:
        """Before the mount serves: show each agent of the store as its holder
        record says, not as active by default. The move recovery (a service,
        started after the mount is up) settles each record in time, but until
        it has, an agent a crash left retired here would be shown, and one
        left in the middle of a move (perhaps active on the target already)
        would take writes."""
        for agent_id in self.live.store.agent_ids():
            record = self.holders.get(agent_id)
            state = _START_STATE.get(record.state) if record is not None else None
            if state is not None:
                self.live.set_state(agent_id, state)

    def show_as_decided(self) -> None:
        """Before the mount serves: show each held agent as the lifecycle
        decides (in doubt: read-only until a peer answers)."""
        if self.lifecycle is None:
            return
        for agent_id in self.live.store.agent_ids():
            record = self.holders.get(agent_id)
            if record is not None and record.state is HolderState.HELD:
                self.live.set_state(agent_id, self.lifecycle(agent_id).view)

    def _as_decided(self, agent_id: str) -> None:
        """After the mount showed an agent writable (a resume, an activate):
        read-only again if the lifecycle says it is in doubt."""
        if self.lifecycle is not None and self.lifecycle(agent_id).view is AgentState.FROZEN:
            self.live.freeze(agent_id)

    def _record_status(self, agent_id: str) -> dict[str, object]:
        """The ``record`` section of ``.control/status``: what this host's
        holder record says (state, epoch) and the agent's one story
        (``holder.story``: the words import, ls and the log use too)."""
        record = self.holders.get(agent_id)
        name = self.live.agent(agent_id).stored_manifest().name
        told = story(record, name)
        out: dict[str, object] = {"state": None if record is None else record.state.value,
                                  "epoch": None if record is None else record.epoch,
                                  "story": told.as_json(), "detail": told.line()}
        if record is not None and record.state is HolderState.HELD and self.lifecycle is not None:
            out["standing"] = self.lifecycle(agent_id).standing.value
            if self.doubt_detail is not None:
                detail = self.doubt_detail(agent_id, name)
                if detail is not None:
                    out["detail"] = detail
        return out

    # -- the move driver's API (capsulefs.move.host.AgentHooks) ----------------------
    async def freeze(self, agent_id: str) -> None:
        """Every write to the agent fails with EROFS from now on. Requests run
        one at a time on this loop, so none is half-done when this returns:
        a move may copy the files. (An in-place edit still open is refused
        at its close.) Listeners first stop the agent's process and commit
        its workspace; that scan runs in a worker thread, and the mount
        serves every agent meanwhile, this one's writes included (they are
        in what a move then copies)."""
        for listener in self.listeners:
            await listener.on_freeze(agent_id)  # type: ignore[attr-defined]
        self.live.freeze(agent_id)

    async def resume(self, agent_id: str) -> None:
        """Writes to the agent work again (the move was rolled back, or the
        agent in doubt got its evidence), unless the lifecycle says it is in doubt."""
        self.live.resume(agent_id)
        self._as_decided(agent_id)
        for listener in self.listeners:
            await listener.on_resume(agent_id)  # type: ignore[attr-defined]

    async def retire(self, agent_id: str) -> None:
        """The agent is active elsewhere: it disappears from the root."""
        self._hide(agent_id)
        for listener in self.listeners:
            await listener.on_retire(agent_id)  # type: ignore[attr-defined]

    def _hide(self, agent_id: str) -> None:
        name = self.live.retire(agent_id)
        if name is not None and self._kernel_up:
            self.ops.kernel.invalidate_entry(pyfuse3.ROOT_INODE, os.fsencode(name))

    async def prepare(self, agent_id: str, staged_dir: str) -> None:
        """Target side, before activate: nothing for the mount to build."""

    async def activate(self, agent_id: str) -> None:
        """The agent (moved in, or resumed after a retire) is shown and writable."""
        name = self.live.activate(agent_id)
        self._as_decided(agent_id)
        if self._kernel_up:  # (at startup, recovery activates before the kernel's INIT: nothing is cached yet)
            self.ops.kernel.invalidate_entry(pyfuse3.ROOT_INODE, os.fsencode(name))
        for listener in self.listeners:
            await listener.on_activate(agent_id)  # type: ignore[attr-defined]

    # -- the mount's remover (.control/remove; capsulefs.core.view.control.Remover) --------
    async def remove(self, agent_id: str) -> None:
        """Remove the agent from this host; return once it is gone.

        Refused with MoveBusy while a move of it is under way (its holder
        record, or a move this daemon runs), with ReadOnly in failsafe. The
        agent first disappears from the root as a retired one does (so no
        write reaches it and the runtime does not restart it), then the
        listeners stop its process and drop its sandbox, then the store
        forgets it, then its snapshots and scratch files go. If the store
        could not remove it, it is shown and run again. Blobs stay for gc."""
        if self.live.failsafe is not None:
            raise ReadOnly(f"the mount went read-only after an internal error: {self.live.failsafe}")
        name = self.live.agent(agent_id).stored_manifest().name  # NotFoundError if gone meanwhile
        async with self.move_guard(agent_id):
            refuse_if_moving(self.holders, agent_id, name)
            self._hide(agent_id)
            try:
                with giving_up(self.state_dir, self.live.store, agent_id):
                    for listener in self.listeners:
                        await listener.on_remove(agent_id)  # type: ignore[attr-defined]
                    await trio.to_thread.run_sync(self.live.store.remove_agent, agent_id)
            except Exception:
                if agent_id in self.live.store.agent_ids():
                    log.warning("agent %s (%s) could not be removed: shown and run again", name, agent_id)
                    await self.activate(agent_id)
                raise
            self.live.forget(agent_id)
            # (a sandbox may hold gigabytes: off the loop that serves the mount)
            await trio.to_thread.run_sync(discard_leftovers, self.state_dir, work_dir(self.state_dir), agent_id)
        log.info("removed agent %s (%s)", name, agent_id)

    def set_move_progress(self, agent_id: str, progress: dict[str, object] | None) -> None:
        """What ``.control/status`` shows under "move" (None: the default)."""
        self.live.agent(agent_id).move_progress = progress

    def state(self, agent_id: str) -> AgentState:
        return self.live.state(agent_id)

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
        info = {"mountpoint": self.mountpoint, "pid": os.getpid()} | self.runtime_info
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
            signum = self._early_signal
            if signum is None:
                async for signum in signals:
                    break
            log.info("got %s: stopping the agents, then unmounting %s", signal.Signals(signum).name, self.mountpoint)
            async with trio.open_nursery() as nursery:

                async def cut_short() -> None:
                    async for signum in signals:
                        log.warning("got %s again: unmounting now", signal.Signals(signum).name)
                        nursery.cancel_scope.cancel()

                nursery.start_soon(cut_short)
                await self._shut_down_listeners()
                nursery.cancel_scope.cancel()
            self._stopped_by_us = True
            pyfuse3.terminate()
            async for signum in signals:  # keep them from killing us mid-unmount
                log.warning("got %s: already unmounting", signal.Signals(signum).name)

    async def _shut_down_listeners(self) -> None:
        """Each listener's ``on_shutdown`` (cancelled, by a second signal:
        it must then stop at once, e.g. kill rather than wait)."""
        for listener in self.listeners:
            on_shutdown = getattr(listener, "on_shutdown", None)
            if on_shutdown is not None:
                try:
                    await on_shutdown()
                except Exception:  # unmount all the same: what is left stops with the services
                    log.exception("stopping %r before unmounting failed", listener)

    def stop(self) -> None:
        """End serving and unmount (from the daemon's own trio loop)."""
        self._stopped_by_us = True
        pyfuse3.terminate()
