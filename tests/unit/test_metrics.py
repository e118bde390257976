"""core/metrics: the text format a scraper reads, and docs/mount.md's table of the series."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from capsulefs.core import metrics
from capsulefs.core.metrics import PhaseTimer, Registry
from prom_kit import PromError, parse, value

DOCS = Path(__file__).resolve().parents[2] / "docs" / "mount.md"


def test_every_series_renders_as_strict_text_format() -> None:
    r = Registry()
    c = r.counter("x_events_total", "Events.\nSecond line \\ with a backslash.", ["kind"])
    g = r.gauge("x_agents", "Agents.", ["state"])
    h = r.histogram("x_phase_seconds", "Phases.", ["phase"], buckets=(0.1, 1, 10))
    r.counter("x_plain_total", "No labels: 0 from the start.")
    c.inc("note")
    c.inc("note", by=2)
    c.inc('a "quoted"\\ odd\nkind')
    g.replace({("active",): 3, ("frozen",): 0})
    for seconds in (0.05, 0.5, 0.5, 50):
        h.observe(seconds, "offer")
    fams = parse(r.render())
    assert fams["x_events_total"].type == "counter" and fams["x_events_total"].help == \
        "Events.\\nSecond line \\\\ with a backslash."
    assert value(fams, "x_events_total", kind="note") == 3
    assert value(fams, "x_events_total", kind='a "quoted"\\ odd\nkind') == 1
    assert value(fams, "x_agents", state="active") == 3 and ("x_agents", (("state", "frozen"),)) in fams["x_agents"].samples
    assert value(fams, "x_plain_total") == 0 and ("x_plain_total", ()) in fams["x_plain_total"].samples
    assert [value(fams, "x_phase_seconds_bucket", phase="offer", le=le) for le in ("0.1", "1", "10", "+Inf")] == \
        [1, 3, 3, 4]
    assert value(fams, "x_phase_seconds_count", phase="offer") == 4
    assert math.isclose(value(fams, "x_phase_seconds_sum", phase="offer"), 51.05)


def test_the_registry_refuses_what_the_format_cannot_say() -> None:
    r = Registry()
    c = r.counter("y_total", "Y.", ["kind"])
    with pytest.raises(ValueError):
        c.inc("a", by=-1)  # a counter never goes down
    with pytest.raises(ValueError):
        c.inc()  # its label is missing
    with pytest.raises(ValueError):
        r.counter("y_total", "again")  # one definition per name
    with pytest.raises(ValueError):
        r.counter("y_count", "a counter's name ends in _total")
    with pytest.raises(ValueError):
        r.gauge("y-gauge", "not a metric name")
    with pytest.raises(ValueError):
        r.histogram("y_seconds", "le is the histogram's own", ["le"], buckets=(1,))


@pytest.mark.parametrize("bad", [
    b"x_total 1",  # no final newline
    b"x_total{a=\"1\"} 1\nx_total{a=\"1\"} 2\n",  # a series twice
    b"# TYPE x_total counter\nx_total -1\n",  # a counter below 0
    b"x 1\n\nx_y 2\n",  # an empty line
    b"a 1\nb 1\na{l=\"2\"} 1\n",  # a family split in two
    b"x{a=\"\\t\"} 1\n",  # an escape the format has not
    b"x one\n",  # not a number
    b"# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\nh_sum 1\nh_count 1\n",  # not cumulative
    b"x 1\n# TYPE x gauge\n",  # TYPE after the samples
])
def test_the_tests_reader_is_strict(bad: bytes) -> None:
    with pytest.raises(PromError):
        parse(bad)


def test_a_phase_timer_times_each_phase_until_the_next() -> None:
    r = Registry()
    h = r.histogram("z_seconds", "Z.", ["phase"], buckets=(1, 10))
    now = [100.0]
    timer = PhaseTimer(h, clock=lambda: now[0])
    timer.enter("freezing")
    now[0] += 0.5
    timer.enter("offer")
    timer.enter("offer")  # the same phase again: still one
    now[0] += 5
    timer.end()
    timer.end()  # ended once
    fams = parse(r.render())
    assert value(fams, "z_seconds_sum", phase="freezing") == 0.5 and value(fams, "z_seconds_count", phase="freezing") == 1
    assert value(fams, "z_seconds_sum", phase="offer") == 5 and value(fams, "z_seconds_count", phase="offer") == 1


def test_docs_list_every_series_with_its_type_and_labels() -> None:
    text = DOCS.read_text()
    start = text.index("## Metrics")
    section = text[start:text.index("\n## ", start + 1)]
    rows = re.findall(r"^\| `(capsulefs_\w+)` \| (\w+) \|([^|]*)\| [^|]+ \|$", section, re.M)
    documented = {name: (kind, tuple(re.findall(r"`(\w+)`", labels))) for name, kind, labels in rows}
    defined = {m.name: (m.TYPE, m.labels) for m in metrics.REGISTRY.metrics()}
    assert documented == defined
    parse(metrics.REGISTRY.render())  # and the process's own series render strictly
