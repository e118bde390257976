"""The daemon's counters and gauges, in Prometheus's text exposition format.

Rules:
  * Every series is defined once, here (:data:`REGISTRY`): name, type, help,
    label names. docs/mount.md's table lists them, and a test keeps the two
    equal. Code where an event happens increments its counter (one line);
    nothing else in the daemon knows about metrics.
  * A counter only grows (per process: it starts at 0 with the daemon). A
    gauge is set by a collector (``Registry.on_collect``) right before the
    series are rendered: what is read from the view (agents by state) is
    read when someone asks, never kept in step by hand.
  * Label values are free text, escaped on output (backslash, quote,
    newline); a label set is given in the order of the metric's label names.
  * Thread-safe: counters are incremented from worker threads too. Render
    on the thread that owns what the collectors read (the mount's).

Theory of operation: the output is version 0.0.4 of the text format (what
node_exporter's textfile collector and every Prometheus scraper read):
``# HELP`` and ``# TYPE`` lines, then one ``name{labels} value`` line per
series; a histogram has cumulative ``_bucket{le=...}`` series, ``_sum`` and
``_count``. No dependency: the format is a page long.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4"
_NAME_OK = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_:")

Labels = tuple[str, ...]


def _check_name(name: str) -> str:
    if not name or name[0].isdigit() or not set(name) <= _NAME_OK:
        raise ValueError(f"{name!r} is not a metric or label name")
    return name


def escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def format_value(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return str(int(v)) if float(v).is_integer() and abs(v) < 2**53 else repr(float(v))


class _Metric:
    TYPE = ""

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()) -> None:
        self.name = _check_name(name)
        self.help = help
        self.labels: Labels = tuple(_check_name(label) for label in labels)
        self._lock = threading.Lock()

    def _key(self, values: Sequence[str]) -> Labels:
        if len(values) != len(self.labels):
            raise ValueError(f"{self.name} takes labels {self.labels}, not {tuple(values)}")
        return tuple(str(v) for v in values)

    def _series(self, suffix: str, key: Labels, value: float, extra: tuple[tuple[str, str], ...] = ()) -> str:
        pairs = [*zip(self.labels, key), *extra]
        inner = ",".join(f'{k}="{escape_label(v)}"' for k, v in pairs)
        return f"{self.name}{suffix}{{{inner}}} {format_value(value)}" if inner else \
            f"{self.name}{suffix} {format_value(value)}"

    def lines(self) -> list[str]:
        help = self.help.replace("\\", "\\\\").replace("\n", "\\n")
        return [f"# HELP {self.name} {help}", f"# TYPE {self.name} {self.TYPE}", *self._body()]

    def _body(self) -> list[str]:
        raise NotImplementedError


class _Values(_Metric):
    """A metric of one value per label set (a counter or a gauge)."""

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, help, labels)
        self._values: dict[Labels, float] = {} if labels else {(): 0.0}

    def value(self, *labels: str) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def _body(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return [self._series("", k, v) for k, v in items]


class Counter(_Values):
    """A count that only grows. Without labels it shows 0 from the start;
    with labels, each label set once it was first counted (or ``touch``ed)."""

    TYPE = "counter"

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()) -> None:
        if not name.endswith("_total"):
            raise ValueError(f"counter {name!r} must end in _total")
        super().__init__(name, help, labels)

    def inc(self, *labels: str, by: float = 1.0) -> None:
        if by < 0:
            raise ValueError(f"{self.name}: a counter cannot go down ({by})")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + by

    def touch(self, *labels: str) -> None:
        """Show this label set (at 0 if never counted)."""
        key = self._key(labels)
        with self._lock:
            self._values.setdefault(key, 0.0)


class Gauge(_Values):
    """A value that goes up and down, set by a collector before rendering."""

    TYPE = "gauge"

    def set(self, value: float, *labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = float(value)

    def replace(self, values: dict[Labels, float]) -> None:
        """Every label set at once (those not given are no longer shown)."""
        new = {self._key(k): float(v) for k, v in values.items()}
        with self._lock:
            self._values = new


class Histogram(_Metric):
    """Observations counted into cumulative buckets (``le``), with their sum and count."""

    TYPE = "histogram"

    def __init__(self, name: str, help: str, labels: Sequence[str] = (), *, buckets: Iterable[float]) -> None:
        super().__init__(name, help, labels)
        if "le" in self.labels:
            raise ValueError("a histogram's labels cannot include le")
        bounds = sorted(float(b) for b in buckets if not math.isinf(b))
        self.buckets: tuple[float, ...] = (*bounds, math.inf)
        self._values: dict[Labels, tuple[list[int], list[float]]] = {}  # counts per bucket, [sum]

    def observe(self, value: float, *labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            counts, total = self._values.setdefault(key, ([0] * len(self.buckets), [0.0]))
            for i, bound in enumerate(self.buckets):
                if value <= bound:
                    counts[i] += 1
                    break
            total[0] += value

    def count(self, *labels: str) -> int:
        with self._lock:
            got = self._values.get(self._key(labels))
            return sum(got[0]) if got else 0

    def _body(self) -> list[str]:
        with self._lock:
            items = sorted((k, (list(c), s[0])) for k, (c, s) in self._values.items())
        out = []
        for key, (counts, total) in items:
            running = 0
            for bound, n in zip(self.buckets, counts):
                running += n
                out.append(self._series("_bucket", key, running, (("le", format_value(bound)),)))
            out.append(self._series("_sum", key, total))
            out.append(self._series("_count", key, running))
        return out


class Registry:
    """The series one process exposes, in the order they were defined."""

    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}
        self._collectors: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def _add(self, metric: _Metric) -> None:
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name} is defined twice")
        self._metrics[metric.name] = metric

    def counter(self, name: str, help: str, labels: Sequence[str] = ()) -> Counter:
        c = Counter(name, help, labels)
        self._add(c)
        return c

    def gauge(self, name: str, help: str, labels: Sequence[str] = ()) -> Gauge:
        g = Gauge(name, help, labels)
        self._add(g)
        return g

    def histogram(self, name: str, help: str, labels: Sequence[str] = (), *, buckets: Iterable[float]) -> Histogram:
        h = Histogram(name, help, labels, buckets=buckets)
        self._add(h)
        return h

    def metrics(self) -> list[_Metric]:
        return list(self._metrics.values())

    def on_collect(self, collect: Callable[[], None]) -> Callable[[], None]:
        """Run ``collect`` before each render (it sets gauges); returns a
        function that removes it again (a daemon that stops)."""
        with self._lock:
            self._collectors.append(collect)

        def remove() -> None:
            with self._lock:
                if collect in self._collectors:
                    self._collectors.remove(collect)

        return remove

    def render(self) -> bytes:
        """Every series, after running the collectors. A collector that fails
        is logged and its gauges keep their last values: a scrape never fails
        for one of them."""
        with self._lock:
            collectors = list(self._collectors)
        for collect in collectors:
            try:
                collect()
            except Exception:
                log.exception("a metrics collector failed; its gauges keep their last values")
        lines: list[str] = []
        for metric in self.metrics():
            lines += metric.lines()
        return ("\n".join(lines) + "\n").encode()


class PhaseTimer:
    """Times the phases of one run (a move): ``enter(phase)`` ends the phase
    before it, ``end()`` the last; each phase's seconds go to ``histogram``
    with ``labels`` followed by the phase."""

    def __init__(self, histogram: Histogram, *labels: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.histogram = histogram
        self.labels = labels
        self.clock = clock
        self._phase: str | None = None
        self._since = 0.0

    def enter(self, phase: str) -> None:
        if phase == self._phase:
            return
        now = self.clock()
        self.end(now)
        self._phase, self._since = phase, now

    def end(self, now: float | None = None) -> None:
        if self._phase is not None:
            now = self.clock() if now is None else now
            self.histogram.observe(max(0.0, now - self._since), *self.labels, self._phase)
            self._phase = None


# -- the series ------------------------------------------------------------------------------------
# docs/mount.md ("Metrics") lists each one; tests/unit/test_metrics.py keeps the table equal to these.

REGISTRY = Registry()

AGENTS = REGISTRY.gauge("capsulefs_agents", "Agents this mount shows, by the state of their directory "
                        "(active, frozen while a move or a doubt holds them).", ["state"])
AGENT_PROCESSES = REGISTRY.gauge("capsulefs_agent_processes", "Agents by the state of their process "
                                 "(running, backoff, blocked, ...; none with mount --no-run).", ["state"])
AGENT_RESTARTS = REGISTRY.counter("capsulefs_agent_restarts_total",
                                  "Agent processes started again after they exited or could not start.")
EVENTS_APPENDED = REGISTRY.counter("capsulefs_journal_events_appended_total",
                                   "Journal events this daemon appended (writes to the journal through the mount, "
                                   "memory edits, model switches, workspace commits), by kind.", ["kind"])
EDITS = REGISTRY.counter("capsulefs_edits_total", "Edits of working memory, the spec or the semantic index "
                         "committed through the mount, by file.", ["file"])
FAILSAFE = REGISTRY.gauge("capsulefs_failsafe", "1 while the mount is read-only after an internal fault (failsafe).")
FAILSAFE_ENTERED = REGISTRY.counter("capsulefs_failsafe_entered_total",
                                    "Times the mount went read-only after an internal fault.")
BLOB_QUARANTINES = REGISTRY.counter("capsulefs_blob_quarantines_total",
                                    "Blobs found damaged and moved to objects/.corrupt/.")
MOVES = REGISTRY.counter("capsulefs_moves_total", "Moves of an agent away from this host that ended, by outcome "
                         "(done, rolled_back, stale, abandoned; failed: did not start) and cause.",
                         ["outcome", "cause"])
MOVES_IN = REGISTRY.counter("capsulefs_moves_in_total", "Agents moved here and activated.")
FLEET_ARRIVALS = REGISTRY.gauge("capsulefs_fleet_arrivals", "Fleet mode: agents held here that arrived while the "
                                "daemon served and that the directory has not confirmed, by state (asking, "
                                "retrying, refused).", ["state"])
MOVE_BYTES = REGISTRY.counter("capsulefs_move_bytes_total", "Bytes of moves: sent (on the wire, framing "
                              "included) by this host as a source, received (blob bytes) as a target.",
                              ["direction"])
MOVE_PHASE_SECONDS = REGISTRY.histogram("capsulefs_move_phase_seconds", "Seconds each phase of a move away "
                                        "from this host took (warming with a blob tier, freezing, offer, "
                                        "transferring, verify, prepare, activate, in_doubt, abort).", ["phase"],
                                        buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 1800))
TIER_PENDING = REGISTRY.gauge("capsulefs_tier_pending_blobs",
                              "Blobs stored here and not yet known to be in the blob tier (mount --blobs).")
TIER_PUTS = REGISTRY.counter("capsulefs_tier_puts_total", "Blobs this daemon put to the blob tier, by outcome "
                             "(stored; present: the tier had it; marked: the tier had it under a tier gc's mark, put again later; "
                             "failed: retried later).", ["outcome"])
TIER_BYTES = REGISTRY.counter("capsulefs_tier_bytes_total", "Blob bytes between this daemon and the blob tier: "
                              "put (stored by this daemon) or fetched (for a move here).", ["direction"])
TIER_CACHE_FETCHES = REGISTRY.counter("capsulefs_tier_cache_fetches_total",
                                     "Evicted blobs (gc --tier-cache) a reader here needed, by outcome (fetched "
                                     "back from the blob tier; failed: the reader got an error).", ["outcome"])
TIER_CACHE_BYTES = REGISTRY.counter("capsulefs_tier_cache_fetched_bytes_total",
                                    "Bytes of evicted blobs fetched back from the blob tier for a reader here.")
for _outcome in ("fetched", "failed"):
    TIER_CACHE_FETCHES.touch(_outcome)
for _direction in ("sent", "received"):
    MOVE_BYTES.touch(_direction)
for _file in ("working_memory.md", "spec.json", "index.json"):
    EDITS.touch(_file)
