"""For tests and benchmarks: needs the ``testing`` extra (``pip install 'cachedstore[testing]'``).

What only tests and benchmarks run, kept out of :mod:`cachedstore.server` (which the demo and
the ``cachedstore etcd`` command use):

* :class:`LocalEtcdCluster` -- ``N`` :class:`~cachedstore.server.LocalEtcd` members on
  loopback forming one cluster (``cluster``),
* :class:`GrpcProxy` -- ``etcd grpc-proxy start`` in front of some endpoints (``proxy``),
* :func:`make_tls_files` -- a throw-away CA with server and client certificates, made with
  ``trustme`` (``tls``).

They follow :mod:`cachedstore.server`'s blocking behaviour and cleanup contract. This package
imports :mod:`cachedstore.server`; nothing outside it imports this one.
"""

from __future__ import annotations

from .cluster import LocalEtcdCluster
from .proxy import GrpcProxy
from .tls import make_tls_files

__all__ = ["GrpcProxy", "LocalEtcdCluster", "make_tls_files"]
