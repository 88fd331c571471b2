"""``cachedstore.clock``: the injectable time every wait of the store goes through."""

from __future__ import annotations

import threading

import pytest

from cachedstore.clock import SYSTEM_CLOCK, FakeClock


def test_fake_time_moves_only_when_advanced_and_wakes_a_parked_wait_at_its_deadline() -> None:
    clock = FakeClock(start=50.0)
    event = threading.Event()
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(clock.wait(event, 10.0)))
    waiter.start()
    clock.wait_for_waiters(1)
    assert clock.monotonic() == 50.0 and clock.waiting == 1
    clock.advance(9.0)
    waiter.join(0.05)
    assert waiter.is_alive()  # 1 s of fake time left
    clock.advance(1.0)
    waiter.join(5)
    assert result == [False] and clock.waiting == 0 and clock.monotonic() == 60.0


def test_a_set_event_ends_a_fake_wait_at_once_and_time_never_goes_back() -> None:
    clock = FakeClock()
    event = threading.Event()
    threading.Timer(0.01, event.set).start()
    assert clock.wait(event, None) is True
    with pytest.raises(ValueError, match="forward"):
        clock.advance(-1)
    with pytest.raises(TimeoutError, match="parked"):
        clock.wait_for_waiters(1, timeout=0.05)


def test_the_system_clock_is_real_time() -> None:
    before = SYSTEM_CLOCK.monotonic()
    SYSTEM_CLOCK.sleep(0.01)
    assert SYSTEM_CLOCK.monotonic() - before >= 0.01
    assert SYSTEM_CLOCK.wait(threading.Event(), 0.0) is False
