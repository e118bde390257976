"""first_failure: the one reason a failed pipeline of helper tasks reports."""

from __future__ import annotations

import pytest
import trio

from capsulefs.nursery import first_failure


def cancelled() -> trio.Cancelled:
    return trio.Cancelled._create()  # trio has no public constructor; what a cancelled task raises


def test_the_first_ordinary_failure_wins_over_cancellations_nested_or_not() -> None:
    disk = OSError(28, "No space left on device")
    group = BaseExceptionGroup("", [cancelled(), BaseExceptionGroup("", [cancelled(), disk]), ValueError("later")])
    assert first_failure(group) is disk


def test_an_interrupt_is_never_hidden_behind_an_ordinary_failure() -> None:
    interrupt = KeyboardInterrupt()
    assert first_failure(BaseExceptionGroup("", [ValueError("x"), interrupt])) is interrupt


def test_only_cancellations_give_a_cancellation() -> None:
    c = cancelled()
    assert first_failure(BaseExceptionGroup("", [c, cancelled()])) is c


async def test_a_real_nursery_reports_the_failing_task_not_its_cancelled_sibling() -> None:
    async def fails() -> None:
        await trio.sleep(0)
        raise OSError(5, "Input/output error")

    with pytest.raises(BaseExceptionGroup) as info:
        async with trio.open_nursery(strict_exception_groups=True) as nursery:
            nursery.start_soon(trio.sleep_forever)
            nursery.start_soon(fails)
    failure = first_failure(info.value)
    assert isinstance(failure, OSError) and failure.errno == 5
