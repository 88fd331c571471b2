"""CoherentCache on its own: the revision rules, without etcd (pure data structure)."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from cachedstore.cache import NOT_SERVING, AsyncWaiter, CoherentCache, ThreadWaiter
from cachedstore.metrics import make_metrics
from cachedstore.scoping import Scope


def make(maxsize: int = 100) -> tuple[CoherentCache, CollectorRegistry]:
    registry = CollectorRegistry()
    cache = CoherentCache(maxsize, make_metrics(registry))
    cache.watch_up(0)
    return cache, registry


def test_not_served_until_the_watch_is_up():
    cache = CoherentCache(10, make_metrics(None, enabled=False))
    cache.apply_write("k", b"v", 5)
    assert cache.floor == NOT_SERVING and cache.lookup("k") is None
    cache.watch_up(5)
    assert cache.lookup("k") == (b"v", 5, 5)
    cache.watch_down()
    assert cache.lookup("k") is None
    assert cache.peek("k") == (b"v", 5, 5)


def test_older_events_never_replace_newer_state():
    cache, _ = make()
    cache.apply_events([("k", b"new", 10)], 10)
    cache.apply_events([("k", b"old", 7)], 7)
    assert cache.lookup("k")[0] == b"new"
    cache.apply_events([("k", None, 11)], 11)
    assert cache.lookup("k") == (None, 11, 0)  # absent: mod_revision 0


def test_own_write_then_its_event_is_a_no_op():
    cache, _ = make()
    cache.apply_write("k", b"mine", 20)
    cache.apply_events([("k", b"mine", 20)], 20)
    assert cache.lookup("k") == (b"mine", 20, 20)


def test_fill_refused_if_a_newer_event_arrived_while_in_flight_even_if_evicted():
    cache, registry = make(maxsize=1)
    token = cache.begin(["k"])
    cache.apply_events([("k", b"new", 12)], 12)
    cache.apply_events([("other", b"x", 13)], 13)  # evicts k
    assert cache.peek("k") is None
    dropped = cache.end_fill(["k"], token, {"k": (b"old", 3)}, 11)
    assert dropped == 1
    assert cache.peek("k") is None
    assert registry.get_sample_value("cachedstore_fills_dropped_total") == 1


def test_fill_accepted_when_nothing_newer_happened():
    cache, _ = make()
    token = cache.begin(["k", "absent"])
    cache.apply_events([("k", b"older", 4)], 4)  # older than the read: the read includes it
    assert cache.end_fill(["k", "absent"], token, {"k": (b"v", 5)}, 9) == 0
    assert cache.lookup("k") == (b"v", 9, 5)
    assert cache.lookup("absent") == (None, 9, 0)  # negative entry, as of revision 9


def test_fill_refused_after_a_reset():
    cache, _ = make()
    token = cache.begin(["k"])
    cache.reset(50)
    assert cache.end_fill(["k"], token, {"k": (b"v", 5)}, 40) == 1
    assert cache.peek("k") is None and cache.applied_revision == 50


def test_failed_read_only_unregisters():
    cache, _ = make()
    token = cache.begin(["k"])
    assert cache.end_fill(["k"], token, None, 0) == 0
    assert cache._inflight == {} and cache._dirty == {}


def test_catch_up_floor_after_reconnect():
    cache, _ = make()
    cache.apply_events([("old", b"1", 5)], 5)
    cache.watch_down()
    cache.watch_up(9)  # events 6..9 are being replayed
    assert cache.lookup("old") is None  # as of 5 < 9: not served yet
    cache.apply_write("fresh", b"f", 10)
    assert cache.lookup("fresh")[0] == b"f"  # as of 10 >= 9: served
    cache.apply_events([("x", b"x", 9)], 9)  # caught up
    assert cache.floor == 0 and cache.lookup("old")[0] == b"1"


def test_eviction_counted_and_bounded():
    cache, registry = make(maxsize=3)
    for i in range(10):
        cache.apply_events([(f"k{i}", b"v", i + 1)], i + 1)
    assert len(cache) == 3
    assert registry.get_sample_value("cachedstore_cache_evictions_total") == 7
    assert registry.get_sample_value("cachedstore_cache_entries") == 3


def test_waiters_woken_by_put_only_for_their_key():
    cache, registry = make()
    a, b = ThreadWaiter(), ThreadWaiter()
    cache.add_waiter("a", a)
    cache.add_waiter("b", b)
    assert registry.get_sample_value("cachedstore_waiters") == 2
    cache.apply_events([("a", None, 3)], 3)  # a delete wakes nobody
    assert not a.event.is_set()
    cache.apply_events([("a", b"1", 4)], 4)
    assert a.event.is_set() and a.value == b"1" and not b.event.is_set()
    cache.remove_waiter("a", a)
    cache.remove_waiter("b", b)
    assert registry.get_sample_value("cachedstore_waiters") == 0


def test_a_waiter_whose_loop_closed_is_forgotten_at_its_wake_or_nudge():
    """A coroutine left pending when its loop closed never removes its waiter: the first
    wake or nudge that finds the loop closed unregisters it (else it would count as a
    blocked reader, which turns watch pacing off, for the store's life)."""
    cache, registry = make()
    live = ThreadWaiter()
    cache.add_waiter("k", live)
    for name in ("k", "j"):
        loop = asyncio.new_event_loop()
        cache.add_waiter(name, AsyncWaiter(loop))
        loop.close()
    cache.add_prefix_waiter("p/", AsyncWaiter(loop))
    assert cache.n_waiters == 4 and cache.awaited()
    cache.apply_events([("k", b"1", 3)], 3)  # a wake finds the loop closed
    assert cache.n_waiters == 3 and live.value == b"1"
    cache.remove_waiter("k", live)
    cache.nudge_all()  # so does a nudge
    assert cache.n_waiters == 0 and not cache.awaited()
    assert registry.get_sample_value("cachedstore_waiters") == 0


def test_a_removal_that_finds_the_lock_held_is_made_by_the_next_registration():
    """``remove_waiter_soon`` (a finalizer's) never waits: with the lock held, by the
    collector's own thread here, it leaves the removal to the next thread that registers
    or removes a waiter."""
    cache, registry = make()
    waiter = ThreadWaiter()
    cache.add_waiter("k", waiter)
    with cache._lock:
        cache.remove_waiter_soon("k", waiter)
    assert cache.n_waiters == 1
    other = ThreadWaiter()
    cache.add_waiter("j", other)
    assert cache.n_waiters == 1 and "k" not in cache._waiters
    cache.remove_waiter("j", other)
    cache.remove_waiter_soon("j", other)  # the lock free: at once (here, nothing left)
    assert cache.n_waiters == 0 and registry.get_sample_value("cachedstore_waiters") == 0


def test_a_removal_left_for_later_is_made_by_the_next_watch_response():
    """A reader may never come again: the watch's next response makes the removal too."""
    cache, registry = make()
    waiter = ThreadWaiter()
    cache.add_waiter("k", waiter)
    with cache._lock:
        cache.remove_waiter_soon("k", waiter)
    assert cache.n_waiters == 1 and cache.awaited()
    cache.apply_events([("j", b"1", 3)], 3)
    assert cache.n_waiters == 0 and not cache.awaited()
    assert registry.get_sample_value("cachedstore_waiters") == 0


def test_async_waiter_woken_from_another_thread():
    cache, _ = make()

    async def main():
        waiter = AsyncWaiter(asyncio.get_running_loop())
        cache.add_waiter("k", waiter)
        await asyncio.to_thread(cache.apply_write, "k", b"v", 8)
        return await asyncio.wait_for(waiter.future, 5)

    assert asyncio.run(main()) == b"v"


def test_close_releases_waiters_and_stops_serving():
    cache, _ = make()
    cache.apply_write("k", b"v", 1)
    waiter = ThreadWaiter()
    cache.add_waiter("x", waiter)
    cache.close()
    assert waiter.event.is_set() and waiter.value is None
    assert cache.closed and cache.lookup("k") is None


def test_a_complete_cache_knows_absence_until_it_evicts():
    cache, _ = make(maxsize=3)
    cache.reset(10, [("a", b"1", 4), ("b", b"2", 9)])
    assert cache.complete and cache.applied_revision == 10
    assert cache.lookup_or_absent("a") == (b"1", 10, 4)
    assert cache.lookup_or_absent("zz") == (None, 10, 0)  # known absent, no read needed
    cache.watch_down()
    assert cache.lookup_or_absent("zz") is None  # not while the watch is down
    cache.watch_up(10)
    assert cache.lookup_or_absent("zz") == (None, 10, 0)
    cache.apply_events([("c", b"3", 11)], 11)
    assert cache.complete
    cache.apply_events([("d", b"4", 12)], 12)  # a fourth key: evicts, completeness ends
    assert not cache.complete and cache.lookup_or_absent("zz") is None
    cache.reset(20)
    assert not cache.complete


def test_a_snapshot_larger_than_the_cache_is_not_complete():
    cache, _ = make(maxsize=2)
    cache.reset(5, [("a", b"1", 1), ("b", b"2", 2), ("c", b"3", 3)])
    assert not cache.complete and len(cache) == 2


def test_a_waiter_stays_registered_after_a_wake():
    from cachedstore.cache import CoherentCache
    from cachedstore.metrics import NullMetrics
    from cachedstore.waiters import ThreadWaiter

    cache = CoherentCache(10, NullMetrics())
    cache.reset(1)
    cache.watch_up(1)
    waiter = ThreadWaiter()
    cache.add_waiter("k", waiter)
    cache.apply_events([("k", b"1", 2)], 2)
    assert waiter.event.is_set() and waiter.take() == b"1"
    cache.apply_events([("k", None, 3)], 3)  # deleted before the owner looked
    cache.apply_events([("k", b"2", 4)], 4)  # the next put still reaches it
    assert waiter.event.is_set() and waiter.take() == b"2"
    cache.remove_waiter("k", waiter)
    assert cache.n_waiters == 0


def test_awaited_while_a_waiter_is_registered_or_the_cache_is_not_serving():
    """What the watch's pacing asks (StoreConfig.watch_pacing): someone waits for the next
    events. on_waiter is called for every waiter added, after the lock is released."""
    cache, _ = make()
    cache.apply_events([("k", b"v", 3)], 3)
    assert cache.floor == 0 and not cache.awaited()
    added: list[bool] = []
    cache.on_waiter = lambda: added.append(cache._lock.locked())
    waiter = ThreadWaiter()
    cache.add_waiter("k", waiter)
    assert cache.awaited() and added == [False]
    cache.remove_waiter("k", waiter)
    assert not cache.awaited()
    cache.add_prefix_waiter("q/", waiter)
    assert cache.awaited() and added == [False, False]
    cache.remove_prefix_waiter("q/", waiter)
    knowledge = ThreadWaiter()  # "q/ is empty", ended by a put: nobody blocks on it
    cache.add_prefix_waiter("q/", knowledge, blocking=False)
    assert not cache.awaited() and added == [False, False] and cache.n_waiters == 1
    cache.apply_events([("q/1", b"item", 4)], 4)
    assert knowledge.event.is_set()  # still woken by a put
    cache.remove_prefix_waiter("q/", knowledge, blocking=False)
    assert cache.n_waiters == 0 and not cache.awaited()
    cache.watch_down()  # not serving: reads go to etcd until the watch catches up
    assert cache.awaited()
    cache.watch_up(10)  # replaying up to 10
    assert cache.floor == 10 and cache.awaited()
    cache.apply_events([("k", b"w", 10)], 10)
    assert cache.floor == 0 and not cache.awaited()


# -- rule 10: etcd's history going back ---------------------------------------------------
def _rewinding() -> tuple[CoherentCache, list[tuple[object, int, int]]]:
    """A cache that knows etcd committed revision 12 (a/new, b/gone), and what its
    ``on_rewind`` was told."""
    cache, _ = make()
    told: list[tuple[object, int, int]] = []
    cache.on_rewind = lambda root, known, revision: told.append((root, known, revision))
    cache.reset(10, [("a", b"old", 5)])
    cache.apply_events([("a", b"new", 11), ("b", b"gone", 12)], 12)
    return cache, told


def test_a_write_answered_older_than_what_was_known_when_it_was_sent_starts_over():
    cache, told = _rewinding()
    old_root = cache.scope_of("a")
    waiter = ThreadWaiter()
    cache.add_waiter("a", waiter)
    ticket = cache.begin(["c"])
    cache.end_write([("c", b"mine")], ticket, 11)  # 11 < 12, known when it was sent
    assert cache.rewinds == 1
    assert [(known, revision) for _, known, revision in told] == [(12, 11)]
    new_root = told[0][0]
    assert new_root is cache.scope_of("a") and new_root is not old_root
    assert old_root.removed and new_root.opening
    assert waiter.event.is_set()  # re-checks
    # Nothing of the lost history is served, nor the write at a number it reused.
    assert len(cache) == 0 and cache.floor == NOT_SERVING
    for name in ("a", "b", "c"):
        assert cache.peek(name) is None
    # The old watch's late events are ignored; the new root opens at the new history.
    cache.apply_events([("a", b"lost", 13)], 13, old_root)
    assert cache.peek("a") is None
    cache.reset(11, [("a", b"old", 5), ("c", b"mine", 11)], new_root)
    cache.watch_up(11, new_root)
    assert cache.lookup("a") == (b"old", 11, 5) and cache.lookup("b") is None
    assert cache.applied_revision == 11


def test_no_result_of_an_operation_begun_before_the_rewind_is_installed():
    """Its revision is a number of the lost history, however new it looks."""
    cache, told = _rewinding()
    before = cache.begin(["a"])
    cache.end_fill(["x"], cache.begin(["x"]), {}, 9)  # the answer that shows it
    assert cache.rewinds == 1
    new_root = told[0][0]
    cache.reset(9, [("a", b"old", 5)], new_root)
    cache.watch_up(9, new_root)
    assert cache.end_fill(["a"], before, {"a": (b"lost", 13)}, 13) == 1
    assert cache.lookup("a") == (b"old", 9, 5)
    assert cache.rewinds == 1  # and it does not count as another one


def test_a_late_answer_or_a_lagging_member_is_not_a_rewind():
    """Older than what the cache knows *now* is a late answer (gated by rule 3, as
    before); a lagging member answers a linearizable request at least at what was known
    when it was sent."""
    cache, told = _rewinding()
    ticket = cache.begin(["a"])  # knows 12
    cache.apply_events([("a", b"newer", 14)], 14)
    assert cache.end_fill(["a"], ticket, {"a": (b"new", 11)}, 13) == 1  # late: dropped
    assert not cache.answered(cache.known_revision, 14)
    assert cache.rewinds == 0 and told == []
    assert cache.lookup("a") == (b"newer", 14, 14)


def test_the_watchers_check_of_a_member_behind_the_cache():
    cache, told = _rewinding()
    ticket = cache.known_revision
    assert cache.answered(ticket, 8)
    assert cache.rewinds == 1 and told[0][1:] == (12, 8)
    # A ticket from before the rewind proves nothing more (it knew the lost numbers: no
    # second rewind), but its holder learns the history went back since it was taken.
    assert cache.answered(ticket, 9)
    assert cache.rewinds == 1 and len(told) == 1


def _touched_cache_holding_a_lost_key() -> tuple[CoherentCache, list[Scope]]:
    """A cache of a store watching what it touched: the key scope of "a" open and
    watched at revision 12 (etcd is about to lose it), and the roots ``on_rewind`` is
    told of."""
    from cachedstore.metrics import NullMetrics

    cache = CoherentCache(10, NullMetrics(), scope_key=lambda name: "k" + name,
                          root=(b"/p/", b"/p0"))
    told: list[Scope] = []
    cache.on_rewind = lambda root, known, revision: told.append(root)
    scope = cache.begin_scope("ka", b"/p/a", b"")
    cache.open_scope(scope, 12, [("a", b"lost", 12)])
    cache.watch_up(12, scope)
    return cache, told


def test_a_fall_back_racing_a_rewind_keeps_the_rewinds_root():
    """A store watching what it touched falls back to its whole prefix (too many scopes)
    just after a rewind made a root: the rewind's root, which the watcher is reading and
    whose creation the cache awaits, stays and is the fall-back's root (it covers every
    name). A new root replaced it, without the awaited creation."""
    cache, told = _touched_cache_holding_a_lost_key()
    assert cache.answered(cache.known_revision, 9)
    assert cache.collapse(b"/p/", b"/p0") is told[0]
    assert not told[0].removed and told[0].awaiting_create
    assert cache.floor == NOT_SERVING and cache.scope_of("b") is told[0]


def test_a_scope_begun_as_the_history_goes_back_is_never_opened_nor_served():
    """A store watching what it touched: a reader begins a scope's opening, the rewind
    lands before the cache registers it, and the root the rewind made covers every name;
    the late scope is a stray that nothing opens, watches or consults."""
    cache, told = _touched_cache_holding_a_lost_key()
    assert cache.lookup("a") == (b"lost", 12, 12)
    assert cache.answered(cache.known_revision, 9)  # the next answer: etcd went back
    late = cache.begin_scope("kb", b"/p/b", b"")
    assert late.removed and cache.scope_of("b") is told[0]
    cache.open_scope(late, 9, [("b", b"v", 9)])
    assert cache.peek("b") is None and cache.peek("a") is None
    assert not cache.scoped and cache.floor == NOT_SERVING
