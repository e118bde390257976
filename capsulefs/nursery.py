"""What a nursery of helper tasks reports when it fails.

trio wraps every failure of a nursery in an ExceptionGroup. The source's
pipeline in a move (a task that sends beside one that reads) fails for one
reason at a time, and its caller handles that reason by type (a broken
link, a read error, a corrupt blob, a timeout's Cancelled), so
:func:`first_failure` hands it the reason.
"""

from __future__ import annotations

import trio

__all__ = ["first_failure"]


def first_failure(group: BaseExceptionGroup) -> BaseException:
    """A KeyboardInterrupt or SystemExit in ``group`` if there is one (never
    hidden behind an ordinary failure); else the first failure that is not a
    Cancelled; a Cancelled only if that is all there is (the enclosing
    cancel scope then takes it)."""
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            leaves.append(exc)

    walk(group)
    fatal = [e for e in leaves if not isinstance(e, (Exception, trio.Cancelled))]
    failures = [e for e in leaves if not isinstance(e, trio.Cancelled)]
    return (fatal or failures or leaves)[0]
