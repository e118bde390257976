"""Semantic index at 100k chunks: build time, disk size, and query latency of
the index's search against a brute-force numpy scan of the same vectors,
and (to show why the index scans exactly) an inverted-file partition.

One run, side by side:
  * build: a synthetic journal of N events (one chunk each) is indexed from
    scratch with the default hashed n-gram embedder (parse + embed + quantise);
    then an incremental update after 1,000 appended events;
  * disk: index.json size, save and load (digest check + decode) times;
  * query: Q queries (a few words drawn from a random event), each embedded
    once; the same query vectors go to ``VectorIndex.search_vector`` and to
    the baseline ``np.argsort(-(V @ q))[:k]`` over the same float32 matrix.
    The methods run interleaved, query by query, so load from other
    processes hits all alike; latency is the median and p95, and each
    method's recall@k is its overlap with the brute-force top k.

Run: .venv/bin/python bench/bench_index.py [--chunks 100000] [--queries 300]
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import tempfile
import time

import numpy as np

from capsulefs.core.semantic.embedders import HashedEmbedder
from capsulefs.core.journal.events import AssistantMessage, ToolResult, UserMessage
from capsulefs.core.journal.record import Record
from capsulefs.core.semantic.index import update_index
from capsulefs.core.semantic.vectors import load_index, save_index

SYLLABLES = "ka lo mi ne ru ta so vi de po li ma zu be ko ri sa te no gu fa xe yo wi".split()


def vocabulary(n: int, rng: random.Random) -> list[str]:
    words = set()
    while len(words) < n:
        words.add("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4))))
    return sorted(words)


def make_journal(n: int, seed: int = 7, machine: str = "benchhost", start: int = 0, prev: str | None = None):
    """``n`` chained events of 15-60 words (one chunk each). Like an agent's
    history, each event is about one of 500 topics: 70% of its words come
    from that topic's own 150-word vocabulary, 30% from a shared Zipf one."""
    rng = random.Random(seed)
    vocab = vocabulary(20_000, random.Random(1))
    cum = list(itertools.accumulate(1.0 / (i + 1) for i in range(len(vocab))))  # Zipf
    topic_rng = random.Random(2)
    topics = [topic_rng.sample(vocab, 150) for _ in range(500)]
    topic_cum = list(itertools.accumulate(1.0 / (i + 1) ** 0.7 for i in range(150)))
    lines = []
    texts = []
    for i in range(start, start + n):
        length = rng.randint(15, 60)
        own = round(length * 0.7)
        words = rng.choices(rng.choice(topics), cum_weights=topic_cum, k=own)
        words += rng.choices(vocab, cum_weights=cum, k=length - own)
        rng.shuffle(words)
        text = " ".join(words).capitalize() + "."
        kind = i % 3
        event = (
            UserMessage(text=text) if kind == 0 else AssistantMessage(text=text) if kind == 1 else ToolResult(call_id=f"c{i}", content=text)
        )
        rec = Record(
            id=f"{i + 1:024x}", machine=machine, seq=i + 1, clock=i + 1, prev=prev, time="2026-12-02T10:00:00.000Z", event=event
        )
        prev = rec.digest
        lines.append(rec.line + b"\n")
        texts.append(text)
    return b"".join(lines), texts, prev


class IVF:
    """An inverted-file partition, for comparison only (the index does not use
    one; see core/semantic/vectors.py): spherical k-means on mean-centred rows into about
    sqrt(rows) lists, rows grouped by list, a query scans the nearest lists."""

    def __init__(self, matrix: np.ndarray, *, seed: int = 0, iters: int = 8, per_list: int = 32) -> None:
        rng = np.random.default_rng(seed)
        n = len(matrix)
        nlist = max(1, int(round(n**0.5)))
        self.mean = matrix.mean(axis=0)
        sample = self._centred(matrix[np.sort(rng.choice(n, min(n, nlist * per_list), replace=False))])
        cent = sample[rng.choice(len(sample), nlist, replace=False)].copy()
        for _ in range(iters):
            assign = np.argmax(sample @ cent.T, axis=1)
            order = np.argsort(assign, kind="stable")
            counts = np.bincount(assign, minlength=nlist)
            full = counts > 0
            starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
            cent[full] = np.add.reduceat(sample[order], starts[full], axis=0)
            empty = np.flatnonzero(~full)
            if len(empty):
                cent[empty] = sample[rng.choice(len(sample), len(empty), replace=False)]
            cent /= np.maximum(np.linalg.norm(cent, axis=1, keepdims=True), 1e-9)
        self.centroids = cent
        assign = np.concatenate(
            [np.argmax(self._centred(matrix[i : i + 16384]) @ cent.T, axis=1) for i in range(0, n, 16384)]
        )
        self.order = np.argsort(assign, kind="stable")
        self.offsets = np.searchsorted(assign[self.order], np.arange(nlist + 1))
        self.grouped = matrix[self.order]
        self.sizes = np.diff(self.offsets)

    def _centred(self, rows: np.ndarray) -> np.ndarray:
        r = rows - self.mean
        return r / np.maximum(np.linalg.norm(r, axis=1, keepdims=True), 1e-9)

    def search(self, q: np.ndarray, k: int, nprobe: int) -> list[int]:
        lists = np.argpartition(-(self.centroids @ q), nprobe - 1)[:nprobe]
        spans = [(self.offsets[i], self.offsets[i + 1]) for i in lists]
        scores = np.concatenate([self.grouped[a:b] @ q for a, b in spans])
        rows = np.concatenate([self.order[a:b] for a, b in spans])
        top = np.argpartition(-scores, min(k, len(scores) - 1))[:k]
        return rows[top[np.argsort(-scores[top])]].tolist()


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(p * len(values)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=100_000)
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("-k", type=int, default=10)
    ap.add_argument("--more", type=int, default=1000, help="events appended for the incremental update")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one round: does it run (CI), not a figure")
    args = ap.parse_args()
    if args.smoke:
        args.chunks, args.queries, args.more = 300, 10, 50

    t = time.perf_counter()
    journal, texts, last = make_journal(args.chunks)
    print(f"journal: {args.chunks} events, {len(journal) / 1e6:.1f} MB (generated in {time.perf_counter() - t:.1f} s)")

    emb = HashedEmbedder()
    t = time.perf_counter()
    index, report = update_index(None, journal, emb)
    build = time.perf_counter() - t
    print(f"build (full):         {build:7.2f} s  {len(index)} chunks, {len(index) / build:,.0f} chunks/s  [{report.mode}]")

    more, _, _ = make_journal(args.more, seed=8, start=args.chunks, prev=last)
    t = time.perf_counter()
    index, report = update_index(index, journal + more, emb)
    inc = time.perf_counter() - t
    print(f"update (+{args.more} events): {inc:7.2f} s  [{report.mode}, +{report.added} rows]")

    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        path = os.path.join(tmp, "index.json")
        t = time.perf_counter()
        save_index(path, index)
        save = time.perf_counter() - t
        size = os.path.getsize(path)
        t = time.perf_counter()
        loaded, why = load_index(path)
        load = time.perf_counter() - t
        assert loaded is not None, why
    per_chunk = size / len(index)
    print(f"index.json:           {size / 1e6:7.1f} MB ({per_chunk:.0f} B/chunk); save {save:.2f} s, load {load:.2f} s")

    rng = random.Random(3)
    queries = []
    sources = []
    for _ in range(args.queries):
        src = rng.randrange(len(texts))
        sources.append(src)
        words = texts[src].rstrip(".").lower().split()
        s = rng.randrange(0, max(1, len(words) - 6))
        queries.append(" ".join(words[s : s + rng.randint(3, 6)]))
    t = time.perf_counter()
    qvecs = emb.embed(queries)
    embed_ms = (time.perf_counter() - t) / len(queries) * 1e3

    hit1 = sum(
        bool(hits) and loaded.entries[hits[0][1]].event == f"{src + 1:024x}"
        for src, hits in ((src, loaded.search_vector(q, 1)) for src, q in zip(sources, qvecs))
    )
    matrix = loaded.matrix()  # the same (dequantised) vectors the index holds
    k = args.k

    def brute(q: np.ndarray) -> list[int]:
        return np.argsort(-(matrix @ q))[:k].tolist()

    t = time.perf_counter()
    ivf = IVF(matrix)
    ivf_build = time.perf_counter() - t
    nlist = len(ivf.centroids)
    probes = sorted({max(1, round(nlist * f)) for f in (0.04, 0.08, 0.16, 0.32)})
    methods = {"brute": brute, "exact": lambda q: [r for _, r in loaded.search_vector(q, k)]}
    for probe in probes:
        methods[f"probe{probe}"] = lambda q, probe=probe: ivf.search(q, k, probe)
    times: dict[str, list[float]] = {m: [] for m in methods}
    results: dict[str, list[list[int]]] = {m: [] for m in methods}
    for q in qvecs[:5]:
        for fn in methods.values():
            fn(q)  # warm up
    names = list(methods)
    for i, q in enumerate(qvecs):  # interleaved, rotating order: load spikes hit every method alike
        for name in names[i % len(names) :] + names[: i % len(names)]:
            t = time.perf_counter()
            res = methods[name](q)
            times[name].append(time.perf_counter() - t)
            results[name].append(res)

    print(f"query embed:          {embed_ms:7.3f} ms/query")
    med_b, p95_b = statistics.median(times["brute"]) * 1e3, pct(times["brute"], 0.95) * 1e3
    print(f"brute force (V@q + argsort): median {med_b:7.3f} ms  p95 {p95_b:7.3f} ms  ({len(loaded)} rows x {matrix.shape[1]} dims, k={k})")
    for name in names[1:]:
        ts, rs = times[name], results[name]
        med, p95 = statistics.median(ts) * 1e3, pct(ts, 0.95) * 1e3
        overlap = sum(len(set(a) & set(b)) for a, b in zip(rs, results["brute"])) / (k * len(rs))
        label = "index search (exact)" if name == "exact" else f"IVF, probe {name[5:]}/{nlist} lists"
        print(
            f"{label + ':':<34} median {med:7.3f} ms  p95 {p95:7.3f} ms  "
            f"speed-up {med_b / med:5.2f}x (p95 {p95_b / p95:5.2f}x); recall@{k} vs brute {overlap:.3f}"
        )
    print(f"IVF (not used by the index): {nlist} lists, sizes median {int(np.median(ivf.sizes))} max {ivf.sizes.max()}, trained in {ivf_build:.2f} s")
    print(f"index search: top-1 is the query's own source event for {hit1}/{len(queries)} queries")


if __name__ == "__main__":
    main()
