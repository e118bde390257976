"""``mount --metrics-file PATH``: the metrics, written atomically every few seconds.

For node_exporter's textfile collector (``--collector.textfile.directory``,
which reads ``*.prom`` files): the file is replaced whole (temp file, fsync,
rename), so the collector never reads half of it. The series are rendered
on the event loop (they read the view), written in a worker thread.

Rules:
  * Written once before the mount reports ready, then every ``interval``
    seconds while it serves, and once more as it stops (its last counts).
  * A write that fails is logged (once until one succeeds again) and tried
    again at the next interval: the mount never stops for its metrics.
"""

from __future__ import annotations

import logging
import os

import trio

from capsulefs.core.fsutil import atomic_write
from capsulefs.core.view.host import LiveHost

log = logging.getLogger(__name__)

DEFAULT_INTERVAL = 15.0


def check_metrics_file(path: str) -> str | None:
    """Why ``path`` cannot take the metrics file (its directory is missing or
    not one), or None."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        return f"--metrics-file {path}: no such directory {directory}"
    if os.path.isdir(path):
        return f"--metrics-file {path} is a directory; name a file in it (e.g. capsulefs.prom)"
    return None


class MetricsFile:
    def __init__(self, live: LiveHost, path: str, interval: float = DEFAULT_INTERVAL) -> None:
        self.live = live
        self.path = os.path.abspath(path)
        self.interval = interval
        self._failing = False

    async def write(self) -> None:
        data = self.live.metrics_bytes()
        try:
            await trio.to_thread.run_sync(atomic_write, self.path, data, 0o644)
        except OSError as exc:
            if not self._failing:
                log.warning("could not write the metrics file %s: %s (trying again every %g s)",
                            self.path, exc, self.interval)
            self._failing = True
            return
        if self._failing:
            log.info("the metrics file %s is written again", self.path)
        self._failing = False

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self.write()
        task_status.started()
        try:
            while True:
                await trio.sleep(self.interval)
                await self.write()
        finally:
            with trio.CancelScope(shield=True):
                await self.write()
