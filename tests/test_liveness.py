"""The liveness schedule (``cachedstore/liveness.py``) without a network or a clock: when a
quiet stream PINGs or asks for progress, and the exact time it is declared stalled."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cachedstore.liveness import Liveness, Step, pings_fit


def _pinging(now: float = 0.0) -> Liveness:
    return Liveness(now, progress_interval=2.0, stall_timeout=8.0, ping_interval=5.0,
                    pinging=True)


def _progress(now: float = 0.0) -> Liveness:
    return Liveness(now, progress_interval=2.0, stall_timeout=8.0, ping_interval=5.0,
                    pinging=False)


def test_a_quiet_pinging_stream_pings_after_ping_interval_and_never_asks_for_progress():
    live = _pinging()
    heard = 0.0
    sent = []
    now = 0.0
    while now < 100.0:  # a healthy quiet stream: each PING answered 1 ms later
        now = live.next_wake(heard)
        step = live.step(now, heard, lagging=False)
        assert not step.stalled and not step.progress
        if step.ping:
            sent.append(now)
            heard = now + 0.001
    assert sent[0] == 5.1  # ping_interval and 2 % (clocks may run at different rates)
    # etcd sees them at least ping_interval apart (each after the previous one's answer)
    assert all(b - a >= 5.1 for a, b in zip(sent, sent[1:], strict=False))
    assert len(sent) == 19  # at 5.1 s, then every 5.101 s: each 5.1 s after the answer


def test_an_unanswered_ping_is_not_repeated_and_the_stream_stalls_at_stall_timeout():
    live = _pinging()
    assert live.step(5.0, 0.0, lagging=False) == Step()  # 2 % short of due
    assert live.step(5.1, 0.0, lagging=False) == Step(ping=True)
    wakes = []
    now = 5.0
    while True:
        now = live.next_wake(0.0)
        wakes.append(now)
        step = live.step(now, 0.0, lagging=False)
        assert not step.ping and not step.progress
        if step.stalled:
            break
    assert now == 8.0  # exactly stall_timeout after the last thing heard


def test_pings_are_used_only_if_the_stall_timeout_leaves_time_for_the_answer():
    assert pings_fit(5.0, 8.0)  # the defaults: 2.9 s for the answer
    assert not pings_fit(5.0, 6.0)  # 0.9 s: progress requests instead
    assert not pings_fit(0.0, 8.0)  # off
    assert pings_fit(0.5, 1.5)


def test_a_stream_never_confirmed_never_pings():
    """Behind grpc-proxy no progress request is answered (and the proxy would answer
    PINGs for etcd): each check is a progress request, one outstanding at a time, until
    the stall; after the watcher's unary probe (counted as heard), the next one again."""
    live = Liveness(0.0, progress_interval=2.0, stall_timeout=8.0, ping_interval=5.0,
                    pinging=True, confirmed=False)
    assert live.step(5.1, 0.0, lagging=False) == Step(progress=True)
    assert live.step(7.9, 0.0, lagging=False) == Step()  # outstanding
    assert live.step(8.0, 0.0, lagging=False) == Step(stalled=True)
    assert live.next_wake(8.2) == 9.9  # the tick; the next check at 13.3
    assert live.step(13.3, 8.2, lagging=False) == Step(progress=True)


def test_an_unconfirmed_stream_checks_on_the_ping_schedule_with_a_progress_request():
    """Before etcd answered it a progress request (a proxy never does), a stream that may
    PING sends a progress request when a PING would be due, never sooner, not again
    while it is outstanding; once answered, PINGs."""
    live = Liveness(0.0, progress_interval=2.0, stall_timeout=8.0, ping_interval=5.0,
                    pinging=True, confirmed=False)
    assert live.next_wake(0.0) == 2.0  # the tick (lagging scopes)
    assert live.step(2.0, 0.0, lagging=False) == Step()  # not after progress_interval
    assert live.step(5.1, 0.0, lagging=False) == Step(progress=True)
    assert live.step(6.0, 0.0, lagging=False) == Step()  # outstanding
    live.confirmed = True  # answered at 5.2
    assert live.next_wake(5.2) == 7.1  # the tick, then the PING at 10.3
    assert live.step(10.3, 5.2, lagging=False) == Step(ping=True)


def test_a_pinging_stream_asks_for_progress_only_while_a_scope_lags():
    live = _pinging()
    assert live.step(2.0, 1.9, lagging=True) == Step(progress=True)
    assert live.step(3.0, 2.9, lagging=True) == Step()  # not a progress_interval yet
    assert live.next_wake(2.9) == 4.0
    assert live.step(4.0, 3.9, lagging=True) == Step(progress=True)
    assert live.step(6.0, 5.9, lagging=False) == Step()


def test_a_progress_stream_asks_only_when_quiet_for_progress_interval():
    live = _progress()
    assert live.next_wake(0.0) == 2.0
    assert live.step(2.0, 0.0, lagging=False) == Step(progress=True)
    assert live.step(4.0, 3.5, lagging=False) == Step()  # heard 0.5 s ago: not quiet
    assert live.next_wake(3.5) == 5.5
    assert live.step(5.5, 3.5, lagging=False) == Step(progress=True)
    assert live.step(11.5, 3.5, lagging=False) == Step(stalled=True)


@settings(max_examples=300, deadline=None)
@given(pinging=st.booleans(),
       gaps=st.lists(st.tuples(st.floats(0.0, 3.0), st.booleans(), st.booleans()),
                     min_size=1, max_size=60))
def test_wake_ups_always_move_forward_and_stall_is_exact(
        pinging: bool, gaps: list[tuple[float, bool, bool]]) -> None:
    """Whatever is heard when: the next wake-up is later than the step before it (no busy
    loop); a PING is never sent while one is outstanding nor before ping_interval of quiet;
    the stream is stalled exactly when stall_timeout passed with nothing heard."""
    live = Liveness(0.0, progress_interval=2.0, stall_timeout=8.0, ping_interval=5.0,
                    pinging=pinging)
    now = heard = 0.0
    outstanding = False
    for gap, hear, lagging in gaps:
        wake = live.next_wake(heard)
        assert wake > now or now == 0.0
        now = max(now, min(wake, now + gap))
        step = live.step(now, heard, lagging)
        assert step.stalled == (now >= heard + 8.0)
        if step.stalled:
            return
        if step.ping:
            assert pinging and not outstanding and now >= heard + 5.0
            outstanding = True
        if step.progress and not lagging:
            assert not pinging and now >= heard + 2.0
        if hear:
            heard, outstanding = now, False
