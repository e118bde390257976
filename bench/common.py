"""Shared helpers for benchmarks: side-by-side timing and capsule builders.

Machines here are noisy, so every benchmark runs the candidate and its
baseline alternately in one script and reports the median of the per-pair
ratios, never an absolute time alone.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(argv: list[str]) -> None:
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def pairs(candidate: Callable[[], object], baseline: Callable[[], object], rounds: int = 5, warmup: int = 1) -> dict:
    """Alternate candidate and baseline; return times and the median ratio."""
    for _ in range(warmup):
        candidate()
        baseline()
    cand, base = [], []
    for _ in range(rounds):
        cand.append(timed(candidate))
        base.append(timed(baseline))
    ratios = [b / c for c, b in zip(cand, base)]  # > 1: candidate faster
    return {
        "candidate_s": statistics.median(cand),
        "baseline_s": statistics.median(base),
        "speed_ratio": statistics.median(ratios),
        "ratios": ratios,
    }


def random_blobs(n: int, size: int, seed: int = 0) -> list[bytes]:
    """n distinct incompressible blobs of ``size`` bytes, quickly."""
    out = []
    block = hashlib.sha256(str(seed).encode()).digest()
    base = os.urandom(size)
    for i in range(n):
        prefix = hashlib.sha256(block + i.to_bytes(8, "big")).digest()
        out.append(prefix + base[len(prefix):])
    return out


def extract_all(tf: tarfile.TarFile, dest: Path) -> None:
    """Unpack a tar the benchmark made itself: with the "data" filter where
    this Python has it (3.11.4 on; Debian 12's 3.11.2, which setup builds
    the venv from as root, has none)."""
    if hasattr(tarfile, "data_filter"):
        tf.extractall(dest, filter="data")
    else:
        tf.extractall(dest)


def capsulefs_cmd() -> list[str]:
    return [str(REPO / ".venv" / "bin" / "capsulefs")]
