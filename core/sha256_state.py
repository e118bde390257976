"""A SHA-256 whose running state can be saved and resumed later, in another
process: the journal's digest grows with its new bytes only.

Rules:
  * hashlib cannot export a running hash. OpenSSL's low-level ``SHA256_*``
    functions keep theirs in a ``SHA256_CTX`` that the caller allocates: a
    public struct of 112 bytes (``openssl/sha.h``: eight state words, the
    bit count, the partial block, two ints). This module calls them through
    ctypes on the libcrypto the interpreter already loaded.
  * Used only if a known-answer test passes when first asked (a state saved
    after a few bytes, restored into a new context, finished, equals
    hashlib's digest); elsewhere (no libcrypto, a build without the
    deprecated functions, another layout) :func:`available` is False and
    callers hash the whole file, as before.
  * A saved state is tagged with the library's version string: a state
    saved by another OpenSSL is not resumed (:func:`resume` returns None).
  * The state is native bytes: it never leaves the host (the journal's tip,
    see :mod:`capsulefs.core.journal.tip`, is host-local).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import threading

log = logging.getLogger(__name__)

CTX_SIZE = 112  # sizeof(SHA256_CTX)
_NAMES = ("libcrypto.so.3", "libcrypto.so.1.1", "libcrypto.so")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_version = ""
_checked = False


def _load() -> ctypes.CDLL | None:
    global _lib, _version, _checked
    if _checked:
        return _lib
    with _lock:
        if _checked:
            return _lib
        import _hashlib  # noqa: F401  (loads libcrypto, so dlopen below finds the same copy)

        for name in _NAMES:
            try:
                lib = ctypes.CDLL(name)
                init, update, final = lib.SHA256_Init, lib.SHA256_Update, lib.SHA256_Final
                version = lib.OpenSSL_version
            except (OSError, AttributeError):
                continue
            init.argtypes = [ctypes.c_void_p]
            update.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
            final.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            version.argtypes = [ctypes.c_int]
            version.restype = ctypes.c_char_p
            if _known_answer(lib):
                _lib = lib
                _version = (version(0) or b"").decode("ascii", "replace")
                break
            log.info("sha256_state: %s failed the known-answer test; journal digests are hashed whole", name)
        _checked = True
        return _lib


def _known_answer(lib: ctypes.CDLL) -> bool:
    """A state saved mid-block, copied into a new context and finished,
    gives hashlib's digest."""
    try:
        data = b"capsulefs resumable sha256 " * 7  # crosses a 64-byte block, ends in a partial one
        ctx = ctypes.create_string_buffer(CTX_SIZE)
        lib.SHA256_Init(ctx)
        lib.SHA256_Update(ctx, data[:37], 37)
        again = ctypes.create_string_buffer(ctx.raw, CTX_SIZE)
        rest = data[37:]
        lib.SHA256_Update(again, rest, len(rest))
        out = ctypes.create_string_buffer(32)
        lib.SHA256_Final(out, again)
        return out.raw == hashlib.sha256(data).digest()
    except Exception as exc:  # pragma: no cover - a broken libcrypto
        log.info("sha256_state: known-answer test raised %s", exc)
        return False


def available() -> bool:
    """Whether states can be saved and resumed here."""
    return _load() is not None


def library() -> str:
    """The version string a saved state is tagged with ("" if unavailable)."""
    _load()
    return _version if _lib is not None else ""


class Sha256State:
    """A running SHA-256 (as ``hashlib.sha256()``) whose state can be saved."""

    __slots__ = ("_ctx",)

    def __init__(self, state: bytes | None = None) -> None:
        lib = _load()
        if lib is None:
            raise RuntimeError("resumable sha256 is not available (see sha256_state.available)")
        if state is None:
            self._ctx = ctypes.create_string_buffer(CTX_SIZE)
            lib.SHA256_Init(self._ctx)
        else:
            if len(state) != CTX_SIZE:
                raise ValueError(f"a sha256 state is {CTX_SIZE} bytes, not {len(state)}")
            self._ctx = ctypes.create_string_buffer(bytes(state), CTX_SIZE)

    def update(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        buf = data if isinstance(data, bytes) else bytes(data)
        assert _lib is not None
        _lib.SHA256_Update(self._ctx, buf, len(buf))

    def state(self) -> bytes:
        """The running state, to save."""
        return self._ctx.raw

    def copy(self) -> "Sha256State":
        return Sha256State(self._ctx.raw)

    def hexdigest(self) -> str:
        """The digest of everything so far (the running state is kept)."""
        ctx = ctypes.create_string_buffer(self._ctx.raw, CTX_SIZE)
        out = ctypes.create_string_buffer(32)
        assert _lib is not None
        _lib.SHA256_Final(out, ctx)
        return out.raw.hex()


def covers(state: bytes) -> int | None:
    """How many bytes a saved state has hashed, read from its own fields, or
    None if they disagree (the bit count ``Nl``/``Nh``, the partial block's
    length ``num`` and ``md_len``): a state that is not self-consistent is
    never handed to OpenSSL, which indexes its block by ``num``."""
    if len(state) != CTX_SIZE:
        return None
    nl, nh = int.from_bytes(state[32:36], "little"), int.from_bytes(state[36:40], "little")
    num, md_len = int.from_bytes(state[104:108], "little"), int.from_bytes(state[108:112], "little")
    bits = nh << 32 | nl
    if bits % 8 or md_len != 32 or num != (bits // 8) % 64:
        return None
    return bits // 8


def resume(state: bytes, lib_version: str, length: int) -> Sha256State | None:
    """A running hash from a saved state of the first ``length`` bytes, or
    None where states cannot be resumed here, it was saved by another
    library, or it does not cover exactly ``length`` bytes."""
    if _load() is None or lib_version != _version or covers(state) != length:
        return None
    return Sha256State(state)
