"""Domain errors of capsulefs.

Every error raised by ``capsulefs.core`` is a :class:`CapsuleError`. The
message alone must be enough for a person to act: it names the file, the
field or the value at fault. Boundaries map these types in one place each:
the CLI prints ``str(exc)`` and exits non-zero, the FUSE adapter maps the
type to an errno (see ``capsulefs.mount.errors``).
"""

from __future__ import annotations


class CapsuleError(Exception):
    """Base class of every domain error."""


class FormatError(CapsuleError):
    """A capsule, manifest or record does not follow the capsule format."""


class UnsafePathError(FormatError):
    """A path from outside (tar member, manifest key, user input) is unsafe."""


class SpecError(FormatError):
    """environment/spec.json breaks one of the spec's rules."""


class NameTooLong(FormatError):
    """A file or agent name longer than a file name may be (``format.MAX_NAME_BYTES``)."""


class IntegrityError(CapsuleError):
    """Bytes do not match the digest that names or lists them."""


class CorruptBlobError(IntegrityError):
    """A stored blob's bytes do not hash to its name."""

    def __init__(self, path: str, actual: str | None = None, *, why: str | None = None) -> None:
        self.path = path
        self.actual = actual
        detail = f" (its bytes hash to {actual})" if actual else ""
        super().__init__(f"corrupt blob {path}: {why or 'content does not match its name'}{detail}")


class BlobUnavailable(IntegrityError):
    """A blob a manifest lists is not in the store and could not be fetched
    back from the blob tier (lost, the tier down, or its copy wrong): that
    file only, as a read error (EIO through the mount)."""


class NotFoundError(CapsuleError):
    """An agent, blob or file that was asked for does not exist."""


class ExistsError(CapsuleError):
    """Something that must be new already exists."""


class StoreError(CapsuleError):
    """The host store is unusable (unknown layout, bad permissions...)."""


class SignatureError(CapsuleError):
    """A signature is missing, malformed, or does not match."""


class ImportRefused(CapsuleError):
    """An archive was refused before anything of it landed."""


class FilesBusy(CapsuleError):
    """An agent's files lock stayed taken (by a `capsulefs append` from
    another process) longer than the caller would wait."""
