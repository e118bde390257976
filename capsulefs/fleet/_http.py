"""Reading httpx response bodies with a cap, and stopping early cleanly.

httpx and httpcore read a body through seven nested async generators.
Closing the outermost one (``aclosing``) leaves the inner ones unfinished,
and trio warns about each when it collects them. So a body is left early the
one way that finishes all of them: close the response (its connection),
then pull once more; the innermost read fails and the failure runs out
through every generator. Only bytes already buffered can come first.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx

_DRAIN_LIMIT = 10_000  # pulls after close; each returns a buffered chunk or ends the chain


class BodyReader:
    """The chunks of one response body; :meth:`aclose` if not read to the end."""

    def __init__(self, resp: httpx.Response) -> None:
        self._resp = resp
        self._chunks = resp.aiter_bytes()
        self._finished = False

    async def next(self) -> bytes | None:
        """The next chunk, or None at the end of the body."""
        if self._finished:
            return None
        try:
            return await self._chunks.__anext__()
        except StopAsyncIteration:
            self._finished = True
            return None
        except BaseException:
            self._finished = True  # an exception out of the chain finished every generator in it
            raise

    async def aclose(self) -> None:
        if self._finished:
            return
        self._finished = True
        await self._resp.aclose()
        for _ in range(_DRAIN_LIMIT):
            try:
                await self._chunks.__anext__()
            except (StopAsyncIteration, httpx.HTTPError, OSError, RuntimeError):
                return


async def read_capped(resp: httpx.Response, limit: int, too_big: Callable[[], Exception]) -> bytes:
    """The whole body, or ``too_big()`` raised once it passes ``limit`` bytes."""
    reader = BodyReader(resp)
    buf = bytearray()
    try:
        while (chunk := await reader.next()) is not None:
            buf += chunk
            if len(buf) > limit:
                raise too_big()
    finally:
        await reader.aclose()
    return bytes(buf)
