"""A strict reader of Prometheus's text exposition format (version 0.0.4), for
the tests: it refuses what a scraper or node_exporter's textfile collector
would refuse, and more (a sample before its TYPE, a family split in two, a
series twice, histogram buckets that are not cumulative)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL = r"[a-zA-Z_][a-zA-Z0-9_]*"
_VALUE = r'"((?:[^"\\\n]|\\[\\"n])*)"'
_SAMPLE = re.compile(rf"({_NAME})(?:\{{((?:{_LABEL}={_VALUE})(?:,{_LABEL}={_VALUE})*)?\}})? (\S+)(?: (-?\d+))?")
_PAIR = re.compile(rf"({_LABEL})={_VALUE}")
_TYPES = ("counter", "gauge", "histogram", "summary", "untyped")
_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count")}


class PromError(AssertionError):
    pass


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "\\": "\\", '"': '"'}[m.group(1)], text)


def _number(text: str, line: int) -> float:
    if text in ("+Inf", "-Inf", "NaN"):
        return float(text.replace("Inf", "inf").replace("NaN", "nan"))
    if not re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", text):
        raise PromError(f"line {line}: {text!r} is not a number")
    return float(text)


@dataclass
class Family:
    name: str
    type: str = "untyped"
    help: str | None = None
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)


def parse(data: bytes) -> dict[str, Family]:
    """The families of an exposition, by name; PromError names the first fault."""
    text = data.decode("utf-8")
    if not text.endswith("\n"):
        raise PromError("the exposition does not end with a newline")
    families: dict[str, Family] = {}
    current: Family | None = None
    closed: set[str] = set()

    def family_of(name: str, line: int) -> Family:
        nonlocal current
        if current is not None and current.name != name:
            closed.add(current.name)
        if name in closed and (current is None or current.name != name):
            raise PromError(f"line {line}: {name} appears again after other families")
        current = families.setdefault(name, Family(name))
        return current

    for no, line in enumerate(text[:-1].split("\n"), 1):
        if not line:
            raise PromError(f"line {no} is empty")
        if line.startswith("#"):
            parts = line.split(" ", 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                if not re.fullmatch(_NAME, parts[2]):
                    raise PromError(f"line {no}: {parts[2]!r} is not a metric name")
                fam = family_of(parts[2], no)
                rest = parts[3] if len(parts) == 4 else ""
                if parts[1] == "HELP":
                    if fam.help is not None:
                        raise PromError(f"line {no}: a second HELP for {fam.name}")
                    if re.search(r"\\[^\\n]", rest.replace("\\\\", "")):
                        raise PromError(f"line {no}: HELP of {fam.name} has an escape other than \\\\ and \\n")
                    fam.help = rest
                else:
                    if fam.samples or fam.type != "untyped" or rest not in _TYPES:
                        raise PromError(f"line {no}: TYPE {rest!r} of {fam.name} is unknown, twice or after samples")
                    fam.type = rest
            continue
        m = _SAMPLE.fullmatch(line)
        if m is None:
            raise PromError(f"line {no}: not a sample line: {line!r}")
        name, labels_text, value_text = m.group(1), m.group(2), m.group(5)
        base = name
        if current is not None and current.type in _SUFFIXES:
            if name == current.name and "" not in _SUFFIXES[current.type]:
                raise PromError(f"line {no}: a {current.type} has no plain sample {name}")
            if any(name == current.name + suffix for suffix in _SUFFIXES[current.type]):
                base = current.name
        fam = family_of(base, no)
        pairs = tuple(_PAIR.findall(labels_text or ""))
        labels = tuple((k, _unescape(v)) for k, v in pairs)
        if len({k for k, _ in labels}) != len(labels):
            raise PromError(f"line {no}: a label twice")
        key = (name, tuple(sorted(labels)))
        if key in fam.samples:
            raise PromError(f"line {no}: series {name}{dict(labels)} twice")
        value = _number(value_text, no)
        if fam.type == "counter" and (value < 0 or math.isnan(value)):
            raise PromError(f"line {no}: counter {name} is {value}")
        fam.samples[key] = value
    for fam in families.values():
        if fam.type == "histogram":
            _check_histogram(fam)
    return families


def _check_histogram(fam: Family) -> None:
    series: dict[tuple[tuple[str, str], ...], list[tuple[float, float]]] = {}
    for (name, labels), value in fam.samples.items():
        if name == fam.name + "_bucket":
            le = dict(labels).get("le")
            if le is None:
                raise PromError(f"{name} without le")
            rest = tuple(p for p in labels if p[0] != "le")
            series.setdefault(rest, []).append((_number(le, 0), value))
    for rest, buckets in series.items():
        buckets.sort()
        counts = [v for _, v in buckets]
        if counts != sorted(counts):
            raise PromError(f"{fam.name}{dict(rest)}: buckets are not cumulative")
        if buckets[-1][0] != math.inf:
            raise PromError(f"{fam.name}{dict(rest)}: no +Inf bucket")
        count = fam.samples.get((fam.name + "_count", rest))
        if count != buckets[-1][1] or (fam.name + "_sum", rest) not in fam.samples:
            raise PromError(f"{fam.name}{dict(rest)}: _count is not the +Inf bucket, or _sum is missing")


def value(families: dict[str, Family], name: str, **labels: str) -> float:
    """One series' value (0 if the family has no such series yet, KeyError if no such family)."""
    fam = families.get(name) or next((f for f in families.values() if f.type in _SUFFIXES and any(
        name == f.name + suffix for suffix in _SUFFIXES[f.type])), None)
    if fam is None:
        raise KeyError(name)
    return fam.samples.get((name, tuple(sorted(labels.items()))), 0.0)
