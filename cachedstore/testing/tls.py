"""Throw-away TLS material for local etcd: a private CA, server and client certificates."""

from __future__ import annotations

import os
from pathlib import Path

from cachedstore.server import TLSFiles


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
    makes etcd treat the certificate's holder as that user. Raises :class:`ImportError`
    without ``trustme`` (the ``testing`` extra).
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
