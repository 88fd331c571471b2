"""torch's coordination traffic, as each simulated rank issues it: :data:`PATTERNS`.

Every pattern is written against the ``torch.distributed.Store`` API only, so the same code
drives a rank's ``TorchEtcdStore`` and a rank's ``TCPStore`` client. Key names and call
sequences follow torch 2.13's sources:

- ``nccl_broadcast`` -- ``ProcessGroupNCCL::broadcastUniqueNCCLID`` (W ≤ 128: rank 0
  ``set``s the 128-byte id under key ``"0"``, every other rank blocks in ``get``) and
  ``allgatherUniqueNCCLIDs`` (W > 128: ``ceil(W/128)`` roots picked by ``getRootIndex`` each
  ``set`` ``UniqueNCCLID:r``, every rank ``multi_get``s them all), on the default group's
  store ``PrefixStore("cuda/", PrefixStore("0/", PrefixStore("default_pg", store)))``;
- ``store_barrier`` -- ``distributed_c10d._store_based_barrier`` itself (``add(k, 1)``,
  ``add(k, 0)``, whoever counts W sets ``k:last_worker``, all ``wait``), as
  ``TORCH_DIST_INIT_BARRIER=1`` runs it after ``init_process_group``;
- ``store_api_barrier`` -- ``Store.barrier(key, W)`` (torch 2.13's API) on the default
  group's ``PrefixStore``: the store's own when the ``PrefixStore`` forwards it, else torch's
  default (``add``, last sets a key, ``wait``) on the store below; the report says which ran
  (``barrier_forwarded``). A torch whose ``Store`` has no ``barrier`` skips the pattern
  (:meth:`Pattern.unsupported`, feature-detected), as it skips the ``multi_get`` patterns
  on a torch without ``multi_get``;
- ``elastic_barrier`` -- ``torch.distributed.elastic.utils.store.barrier``; when
  ``EtcdStore`` has a ``barrier`` of its own, that is called instead (see
  :func:`elastic_barrier_impl`);
- ``groups`` -- Megatron-like process groups (TP 8 × PP ≤ 4 × DP the rest), created in
  Megatron's order (DP, TP, PP) with torch's sequential group names ``"1"``, ``"2"`` ...;
  in each of its three groups a rank runs gloo's ``createAndConnectAllPairs`` (``set`` its
  own key, ``multi_get`` all group keys in batches of 128, under ``PrefixStore("cpu/")``)
  and the NCCL-id broadcast (under ``PrefixStore("cuda/")``);
- ``heartbeat`` / ``heartbeat_uncached`` -- the NCCL heartbeat monitor's
  ``check(["exception_dump"])`` on the global store, once per simulated second (the second
  variant's stores are built with ``preload_limit=0``: their cache is not complete);
- ``keepalive`` -- torchrun's rendezvous keep-alive: one agent per 8 ranks, each keeping
  alive every 5 simulated seconds (agents staggered over the 5 seconds) through torch's
  own ``_BackendRendezvousStateHolder`` on the rendezvous backend torchrun would use: our
  ``etcd-v3`` (``EtcdV3RendezvousBackend``: heartbeat keys) or torch's ``c10d`` backend
  on TCPStore (``compare_set`` of one state key; a lost race re-reads and retries).
  Set up unmeasured: agent 0 creates a complete round of every agent, then every agent
  keeps alive once.

A pattern is a number of *steps*; all ranks run a step concurrently, and steps are separated
by a job-wide barrier of the simulator (not of the store). Simulated seconds are steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    RendezvousTimeout,
    _BackendRendezvousStateHolder,
    _NodeDesc,
)

from cachedstore.torch import EtcdV3RendezvousBackend

__all__ = ["PATTERNS", "Pattern", "RankContext", "megatron_groups", "nccl_root_index",
           "store_has"]

#: ``TORCH_NCCL_RANKS_PER_ROOT``'s default.
RANKS_PER_ROOT = 128
#: gloo's ``kDefaultBatchSize`` for ``multi_get``.
GLOO_BATCH = 128
NCCL_ID = b"\x5a" * 128
RANKS_PER_NODE = 8
KEEPALIVE_PERIOD = 5
MAX_CAS_ATTEMPTS = 1_000


@dataclass
class RankContext:
    """What one simulated rank's step sees.

    ``store`` is the rank's raw store (wrapped in a recording store); ``default_store`` is
    ``PrefixStore("default_pg", store)`` as ``init_process_group`` makes it. ``etcd_store``
    is the rank's ``cachedstore.EtcdStore`` (None for TCPStore). ``scratch`` survives steps.
    """

    rank: int
    world: int
    store: dist.Store
    default_store: dist.Store
    etcd_store: Any
    timeout: timedelta
    scratch: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Pattern:
    """A named coordination pattern: ``steps(world)`` steps, each run by every rank.

    ``store_options`` are ``EtcdStore`` keywords for the ranks' stores in this pattern.
    """

    name: str
    title: str
    step: Callable[[RankContext, int], None]
    steps: Callable[[int], int] = lambda world: 1
    store_options: Mapping[str, Any] = field(default_factory=dict)
    #: Run as steps ``-setup_steps`` .. ``-1`` after connecting, before measuring.
    setup: Callable[[RankContext, int], None] | None = None
    setup_steps: int = 0
    #: ``requires(world)``: why this torch cannot run the pattern at ``world`` ranks (the
    #: API it lacks, feature-detected), or None when it can.
    requires: Callable[[int], str | None] = lambda world: None

    def unsupported(self, world: int) -> str | None:
        """Why the installed torch cannot run this pattern at ``world`` ranks, or None."""
        return self.requires(world)


def store_has(method: str) -> str | None:
    """None if this torch's ``torch.distributed.Store`` (and so ``PrefixStore`` and
    ``TCPStore``) has ``method``; else why a pattern that calls it cannot run."""
    if hasattr(dist.Store, method) and hasattr(dist.PrefixStore, method):
        return None
    return (f"torch {_torch_version()}'s torch.distributed.Store has no {method}() "
            f"(a newer torch's API)")


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


# --------------------------------------------------------------------------- NCCL ids


def nccl_root_index(rank: int, n_ranks: int, n_ids: int) -> int:
    """torch's ``getRootIndex``: the root slot of ``rank``, or -1 if it is not a root."""
    rmr, rpr = n_ranks % n_ids, n_ranks // n_ids
    rlim = rmr * (rpr + 1)
    if rank < rlim:
        return -1 if rank % (rpr + 1) else rank // (rpr + 1)
    return -1 if (rank - rlim) % rpr else (rank - rlim) // rpr + rmr


def nccl_init(store: dist.Store, group_rank: int, group_size: int) -> None:
    """One communicator init on ``store`` (the group's ``cuda/`` prefix store)."""
    if group_size <= RANKS_PER_ROOT:
        if group_rank == 0:
            store.set("0", NCCL_ID)
        elif group_size > 1 and len(store.get("0")) != len(NCCL_ID):
            raise AssertionError("bad NCCL id")
        return
    n_roots = math.ceil(group_size / RANKS_PER_ROOT)
    keys = [f"UniqueNCCLID:{r}" for r in range(n_roots)]
    root = nccl_root_index(group_rank, group_size, n_roots)
    if root >= 0:
        store.set(keys[root], NCCL_ID)
    if any(len(v) != len(NCCL_ID) for v in store.multi_get(keys)):
        raise AssertionError("bad NCCL id")


def _default_cuda_store(ctx: RankContext) -> dist.Store:
    if "cuda0" not in ctx.scratch:
        ctx.scratch["cuda0"] = dist.PrefixStore("cuda/", dist.PrefixStore("0/", ctx.default_store))
    return ctx.scratch["cuda0"]


def _nccl_broadcast(ctx: RankContext, step: int) -> None:
    nccl_init(_default_cuda_store(ctx), ctx.rank, ctx.world)


# --------------------------------------------------------------------------- barriers


def _store_barrier(ctx: RankContext, step: int) -> None:
    from torch.distributed.distributed_c10d import _store_based_barrier

    _store_based_barrier(ctx.rank, ctx.default_store, "0", ctx.world, ctx.timeout)


def _store_api_barrier(ctx: RankContext, step: int) -> None:
    ctx.default_store.barrier("fanout_barrier", ctx.world, ctx.timeout)


def elastic_barrier_impl() -> str:
    """``"EtcdStore.barrier"`` if this cachedstore has one, else torch's elastic barrier."""
    from cachedstore import EtcdStore

    return "EtcdStore.barrier" if hasattr(EtcdStore, "barrier") else "torch elastic barrier"


def _elastic_barrier(ctx: RankContext, step: int) -> None:
    key = "torchelastic/fanout_barrier"
    if ctx.etcd_store is not None and hasattr(ctx.etcd_store, "barrier"):
        # Called like torch's Store.barrier(key, world_size, timeout); the elastic keys live
        # under the default prefix as torchelastic's store.barrier would put them.
        ctx.etcd_store.barrier("default_pg/" + key, ctx.world, ctx.timeout.total_seconds())
        return
    from torch.distributed.elastic.utils.store import barrier

    barrier(ctx.default_store, ctx.world, key, barrier_timeout=ctx.timeout.total_seconds())


# --------------------------------------------------------------------------- groups


def megatron_groups(world: int, tp: int = 8, pp: int = 4) -> list[list[int]]:
    """Megatron-LM's groups for ``world`` ranks, in creation order: DP, then TP, then PP.

    ``tp`` and ``pp`` shrink to fit small worlds (TP ≤ world, PP ≤ world / TP); DP takes the
    rest. Rank layout: TP fastest, then DP, then PP.
    """
    tp = min(tp, world)
    pp = max(1, min(pp, world // tp))
    dp = world // (tp * pp)
    if tp * pp * dp != world:
        raise ValueError(f"world {world} is not a multiple of TP {tp} x PP {pp}")
    groups: list[list[int]] = []
    for i in range(pp):  # data-parallel groups
        for j in range(tp):
            groups.append([i * tp * dp + j + k * tp for k in range(dp)])
    for i in range(world // tp):  # tensor-parallel groups
        groups.append(list(range(i * tp, (i + 1) * tp)))
    stride = world // pp
    for j in range(stride):  # pipeline-parallel groups
        groups.append([j + k * stride for k in range(pp)])
    return groups


def gloo_connect(store: dist.Store, group_rank: int, group_size: int) -> None:
    """gloo's ``createAndConnectAllPairs``: set own rank info, ``multi_get`` every rank's."""
    store.set(str(group_rank), b"h" * 48)
    keys = [str(r) for r in range(group_size)]
    for start in range(0, group_size, GLOO_BATCH):
        store.multi_get(keys[start:start + GLOO_BATCH])


def _groups(ctx: RankContext, step: int) -> None:
    for index, ranks in enumerate(megatron_groups(ctx.world)):
        if ctx.rank not in ranks:
            continue  # torch names the group anyway: names stay sequential on every rank
        group = dist.PrefixStore(f"{index + 1}/", ctx.default_store)
        group_rank = ranks.index(ctx.rank)
        gloo_connect(dist.PrefixStore("0", dist.PrefixStore("cpu/", group)), group_rank,
                     len(ranks))
        nccl_init(dist.PrefixStore("cuda/", group), group_rank, len(ranks))


# --------------------------------------------------------------------------- steady state

HEARTBEAT_SECONDS = 10
KEEPALIVE_SECONDS = 10


def _heartbeat(ctx: RankContext, step: int) -> None:
    if ctx.store.check(["exception_dump"]):
        raise AssertionError("nobody set exception_dump")


def _agent_holder(ctx: RankContext) -> Any:
    """This agent's torch rendezvous state holder, on the rendezvous backend torchrun would
    use with this rank's store: ``etcd-v3`` (ours) or ``c10d`` (torch's, on TCPStore)."""
    if "holder" not in ctx.scratch:
        if ctx.etcd_store is not None:
            backend: Any = EtcdV3RendezvousBackend(ctx.etcd_store, "fanout")
        else:
            backend = C10dRendezvousBackend(ctx.store, "fanout")
        # Nobody is declared dead during the run: steady state, no membership change.
        settings = RendezvousSettings(
            run_id="fanout", min_nodes=1, max_nodes=ctx.world,
            timeout=RendezvousTimeout(),
            keep_alive_interval=timedelta(seconds=KEEPALIVE_PERIOD),
            keep_alive_max_attempt=1_000_000)
        # cache_duration=0: keep-alives are 5 s apart, past torch's 1 s state cache.
        ctx.scratch["holder"] = _BackendRendezvousStateHolder(backend, settings,
                                                              cache_duration=0)
    return ctx.scratch["holder"]


def _agent_node(agent: int) -> Any:
    return _NodeDesc(f"node-{agent}", 1000 + agent, 0)


def _agent_keep_alive(ctx: RankContext, holder: Any, node: Any) -> int:
    """torch's ``_RendezvousKeepAliveOp`` as its op executor runs it: a sync (a read),
    then set the heartbeat and sync (a write) until the write lands; a lost write returned
    a newer state, in which this node's heartbeat is old again. Returns the writes."""
    holder.sync()
    for attempt in range(1, MAX_CAS_ATTEMPTS + 1):
        holder.state.last_heartbeats[node] = datetime.now(timezone.utc)
        holder.mark_dirty()
        if holder.sync():
            return attempt
    raise AssertionError(f"rank {ctx.rank}: keep-alive lost {MAX_CAS_ATTEMPTS} times")


def _keepalive_setup(ctx: RankContext, step: int) -> None:
    """Step -2: agent 0 creates a complete round of every agent. Step -1: every agent
    keeps alive once (it takes its lease; torch's agents did so when they joined)."""
    if ctx.rank % RANKS_PER_NODE:
        return
    agent = ctx.rank // RANKS_PER_NODE
    holder = _agent_holder(ctx)
    if step == -2 and agent == 0:
        holder.sync()
        now = datetime.now(timezone.utc)
        for a in range(math.ceil(ctx.world / RANKS_PER_NODE)):
            holder.state.participants[_agent_node(a)] = a
            holder.state.last_heartbeats[_agent_node(a)] = now
        holder.state.round, holder.state.complete = 1, True
        holder.mark_dirty()
        if not holder.sync():
            raise AssertionError("agent 0 could not create the rendezvous state")
    elif step == -1:
        _agent_keep_alive(ctx, holder, _agent_node(agent))


def _keepalive(ctx: RankContext, step: int) -> None:
    if ctx.rank % RANKS_PER_NODE:
        return  # one agent per node
    agent = ctx.rank // RANKS_PER_NODE
    if step % KEEPALIVE_PERIOD != agent % KEEPALIVE_PERIOD:
        return
    writes = _agent_keep_alive(ctx, _agent_holder(ctx), _agent_node(agent))
    ctx.scratch["cas_attempts"] = ctx.scratch.get("cas_attempts", 0) + writes


PATTERNS: dict[str, Pattern] = {p.name: p for p in (
    Pattern("nccl_broadcast", "NCCL-id broadcast (default group)", _nccl_broadcast,
            requires=lambda world: store_has("multi_get") if world > RANKS_PER_ROOT else None),
    Pattern("store_barrier", "store-based barrier (c10d, add + add(k,0) + wait)",
            _store_barrier),
    Pattern("store_api_barrier", "Store.barrier (torch 2.13 API)", _store_api_barrier,
            requires=lambda world: store_has("barrier")),
    Pattern("elastic_barrier", "elastic barrier", _elastic_barrier),
    Pattern("groups", "Megatron groups: gloo all-gather + NCCL id per group", _groups,
            requires=lambda world: store_has("multi_get")),
    Pattern("heartbeat", f"heartbeat check, {HEARTBEAT_SECONDS} simulated s", _heartbeat,
            steps=lambda world: HEARTBEAT_SECONDS),
    Pattern("heartbeat_uncached",
            f"heartbeat check, {HEARTBEAT_SECONDS} simulated s, preload_limit=0",
            _heartbeat, steps=lambda world: HEARTBEAT_SECONDS,
            store_options={"preload_limit": 0}),
    Pattern("keepalive", f"rendezvous keep-alive, {KEEPALIVE_SECONDS} simulated s",
            _keepalive, steps=lambda world: KEEPALIVE_SECONDS, setup=_keepalive_setup,
            setup_steps=2),
)}
