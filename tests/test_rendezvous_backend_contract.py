"""``RendezvousBackend``'s contract, as torch checks it for its own backends, on ``etcd-v3``
(issue 24 item 5).

Each case of torch's ``RendezvousBackendTestMixin`` (torch's
test/distributed/elastic/rendezvous/rendezvous_backend_test.py, which torch runs against
its c10d and etcd-v2 backends) is written here for ours; each test names the torch test it
mirrors. The corruption cases follow torch's c10d and etcd backend tests, whose
``_corrupt_state`` writes a value the backend did not write to the state key: ``get_state``
and ``set_state`` raise ``RendezvousStateError``. Real etcd; the backend built both by its
constructor and by ``create_backend`` (what torchrun's entry point calls).
"""

from __future__ import annotations

from base64 import b64encode
from collections.abc import Iterator
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import (
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import Token
from util import raw_client

from cachedstore import EtcdStore
from cachedstore.torch import EtcdV3RendezvousBackend, create_rdzv_handler
from cachedstore.torch.rendezvous import create_backend

pytestmark = pytest.mark.timeout(120)

RUN = "dummy_run_id"


@pytest.fixture(params=["constructor", "create_backend"])
def backend(request, etcd, prefix) -> Iterator[EtcdV3RendezvousBackend]:
    """A backend on a run of its own (``<prefix><run>/``), no state yet."""
    if request.param == "constructor":
        with EtcdStore(endpoints=[etcd.endpoint], prefix=f"{prefix}{RUN}/") as store:
            yield EtcdV3RendezvousBackend(store, RUN, ttl=600)
        return
    made, store = create_backend(RendezvousParameters(
        backend="etcd-v3", endpoint=etcd.endpoint, run_id=RUN, min_nodes=1, max_nodes=1,
        prefix=prefix))
    try:
        yield made
    finally:
        store.close()


def _corrupt_state(etcd, backend: EtcdV3RendezvousBackend, value: bytes = b"non_base64"
                   ) -> None:
    """What torch's c10d and etcd backend tests do: another writer puts a value the
    backend did not write under the state key."""
    raw = raw_client(etcd)
    try:
        raw.put(backend.key, value)
    finally:
        raw.close()


def _set_state(backend: EtcdV3RendezvousBackend, state: bytes, token: Any = None
               ) -> tuple[bytes, Token, bool]:
    result = backend.set_state(state, token)
    assert result is not None
    return result


# -- RendezvousBackendTestMixin -----------------------------------------------------------
def test_get_state_returns_backend_state(backend):
    """torch: test_get_state_returns_backend_state."""
    backend.set_state(b"x")
    result = backend.get_state()
    assert result is not None
    state, token = result
    assert state == b"x" and token is not None


def test_get_state_returns_none_if_backend_state_does_not_exist(backend):
    """torch: test_get_state_returns_none_if_backend_state_does_not_exist."""
    assert backend.get_state() is None


def test_get_state_raises_error_if_backend_state_is_corrupt(etcd, backend):
    """torch: test_get_state_raises_error_if_backend_state_is_corrupt (its c10d and etcd
    backends' ``_corrupt_state``: "non_base64" under the state key)."""
    _corrupt_state(etcd, backend)
    with pytest.raises(RendezvousStateError, match="corrupt"):
        backend.get_state()


def test_set_state_sets_backend_state_if_it_does_not_exist(backend):
    """torch: test_set_state_sets_backend_state_if_it_does_not_exist."""
    state, token, has_set = _set_state(backend, b"x")
    assert state == b"x" and token is not None and has_set


def test_set_state_sets_backend_state_if_token_is_current(backend):
    """torch: test_set_state_sets_backend_state_if_token_is_current."""
    _, token1, has_set1 = _set_state(backend, b"x")
    state2, token2, has_set2 = _set_state(backend, b"y", token1)
    assert state2 == b"y" and token1 != token2
    assert has_set1 and has_set2


def test_set_state_returns_current_backend_state_if_token_is_old(backend):
    """torch: test_set_state_returns_current_backend_state_if_token_is_old."""
    _, token1, _ = _set_state(backend, b"x")
    state2, token2, _ = _set_state(backend, b"y", token1)
    state3, token3, has_set = _set_state(backend, b"z", token1)
    assert (state3, token3) == (state2, token2)
    assert not has_set


def test_set_state_returns_current_backend_state_if_token_is_none(backend):
    """torch: test_set_state_returns_current_backend_state_if_token_is_none."""
    state1, token1, _ = _set_state(backend, b"x")
    state2, token2, has_set = _set_state(backend, b"y")
    assert (state2, token2) == (state1, token1)
    assert not has_set


def test_set_state_returns_current_backend_state_if_token_is_invalid(backend):
    """torch: test_set_state_returns_current_backend_state_if_token_is_invalid."""
    state1, token1, _ = _set_state(backend, b"x")
    state2, token2, has_set = _set_state(backend, b"y", token="invalid")
    assert (state2, token2) == (state1, token1)
    assert not has_set


# -- corruption: what torch's c10d and etcd backend tests corrupt, and more ---------------
_HEADER = b"cachedstore-rdzv/1 "
CORRUPT = {
    "non_base64": b"non_base64",  # torch's c10d and etcd backend tests
    "torchs_base64_format": b64encode(b"x"),  # how torch's backends store a state
    "empty": b"",
    "header_only_magic": _HEADER,
    "short_instance": _HEADER + b"0123\nx",
    "instance_not_hex": _HEADER + b"z" * 32 + b"\nx",
    "instance_with_a_slash": _HEADER + b"0" * 15 + b"/" + b"0" * 16 + b"\nx",
    "no_newline": _HEADER + b"0" * 32 + b" x",
}


@pytest.mark.parametrize("value", list(CORRUPT.values()), ids=list(CORRUPT))
def test_every_read_of_a_corrupt_state_raises_rendezvous_state_error(etcd, backend, value):
    """torch's c10d backend raises RendezvousStateError wherever it decodes the stored
    state: in ``get_state``, and in ``set_state`` (the compare-and-set answers with the
    corrupt value, or a token that is not one makes it read the state)."""
    _, token, _ = _set_state(backend, b"x")
    _corrupt_state(etcd, backend, value)
    with pytest.raises(RendezvousStateError, match="corrupt"):
        backend.get_state()
    for stale in (None, token, "invalid"):
        with pytest.raises(RendezvousStateError, match="corrupt"):
            backend.set_state(b"y", stale)
    raw = raw_client(etcd)
    try:
        assert raw.get(backend.key)[0] == value  # nothing overwrote it
        raw.delete(backend.key)
    finally:
        raw.close()
    # Gone, the run starts afresh (as with torch's backends).
    assert backend.get_state() is None
    assert _set_state(backend, b"z")[::2] == (b"z", True)


def test_a_state_after_a_valid_header_is_torchs_and_handed_over_unchanged(etcd, backend):
    """What follows the header is opaque (torch's backends do not unpickle it either)."""
    instance = "0123456789abcdef" * 2
    _corrupt_state(etcd, backend, _HEADER + instance.encode() + b"\nnot a pickle\n\x00")
    result = backend.get_state()
    assert result is not None and result[0] == b"not a pickle\n\x00"
    assert backend.instance == instance


def test_torchs_handler_reports_a_corrupt_state(etcd, prefix):
    """torch's DynamicRendezvousHandler gets RendezvousStateError from the backend (the
    contract's exception), naming the key, and raises it from ``next_rendezvous``. (Handed
    the bytes, torch would fail to unpickle them, with a message that names no key.)"""
    raw = raw_client(etcd)
    try:
        raw.put(f"{prefix}{RUN}/state", b"non_base64")
    finally:
        raw.close()
    handler = create_rdzv_handler(RendezvousParameters(
        backend="etcd-v3", endpoint=etcd.endpoint, run_id=RUN, min_nodes=1, max_nodes=1,
        prefix=prefix, join_timeout="10"))
    try:
        with pytest.raises(RendezvousStateError, match=f"etcd-v3 rendezvous: .*corrupt: "
                                                       f"b'{prefix}{RUN}/state'"):
            handler.next_rendezvous()
    finally:
        handler._store.close()
