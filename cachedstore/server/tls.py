"""The PEM files a TLS-serving local etcd uses: :class:`TLSFiles`.

Making throw-away ones (a private CA, server and client certificates) is
:func:`cachedstore.testing.make_tls_files`, behind the ``testing`` extra."""

from __future__ import annotations

import ssl
from dataclasses import dataclass


@dataclass(frozen=True)
class TLSFiles:
    """PEM files for a TLS-serving etcd.

    ``client_cert_auth`` makes etcd demand a client certificate signed by ``ca_cert``;
    ``client_cert``/``client_key`` are what our own health checks, ``etcdctl`` and the
    grpc-proxy present (required when ``client_cert_auth`` is set).
    """

    ca_cert: str
    server_cert: str
    server_key: str
    client_cert_auth: bool = False
    client_cert: str | None = None
    client_key: str | None = None

    def ssl_context(self) -> ssl.SSLContext:
        """A client-side context trusting ``ca_cert``, presenting the client cert if any."""
        context = ssl.create_default_context(cafile=self.ca_cert)
        if self.client_cert and self.client_key:
            context.load_cert_chain(self.client_cert, self.client_key)
        return context

