"""capsulefs.core: the pure domain code of capsulefs.

Rules:
  * Nothing here imports trio, pyfuse3, socket, ssl or subprocess (a test
    enforces it). The only I/O is plain file I/O through ``os``, always via
    the atomic helpers in :mod:`capsulefs.core.fsutil`.
  * Time and randomness are parameters, never read from globals, so every
    behaviour is reproducible in a test.
  * Errors are :class:`capsulefs.core.errors.CapsuleError` subclasses whose
    message names the problem; the CLI prints that message, the FUSE adapter
    maps the type to an errno.
"""
