"""Throw-away TLS material (a private CA, server and client certificates) for local etcd."""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path


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


def make_tls_files(
    directory: str | os.PathLike[str],
    client_cert_auth: bool = False,
    *,
    client_common_name: str | None = None,
) -> TLSFiles:
    """Create a throw-away CA (with :mod:`trustme`) and write PEM files into ``directory``.

    Writes ``ca.pem``, ``server.pem``/``server-key.pem`` (valid for ``127.0.0.1``, ``::1``
    and ``localhost``) and ``client.pem``/``client-key.pem``. The client certificate has
    no common name unless ``client_common_name`` is given; with etcd auth enabled a CN
    makes etcd treat the certificate's holder as that user.
    """
    import trustme

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "::1", "localhost")
    client = ca.issue_cert("client.localhost", common_name=client_common_name)
    ca.cert_pem.write_to_path(str(out / "ca.pem"))
    server.cert_chain_pems[0].write_to_path(str(out / "server.pem"))
    server.private_key_pem.write_to_path(str(out / "server-key.pem"))
    client.cert_chain_pems[0].write_to_path(str(out / "client.pem"))
    client.private_key_pem.write_to_path(str(out / "client-key.pem"))
    for key in ("server-key.pem", "client-key.pem"):
        os.chmod(out / key, 0o600)
    return TLSFiles(
        ca_cert=str(out / "ca.pem"),
        server_cert=str(out / "server.pem"),
        server_key=str(out / "server-key.pem"),
        client_cert_auth=client_cert_auth,
        client_cert=str(out / "client.pem"),
        client_key=str(out / "client-key.pem"),
    )
