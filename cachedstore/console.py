"""What the ``cachedstore`` command and its demo share: exit codes, and errors for people.

Both :mod:`cachedstore.cli` and :mod:`cachedstore.demo` (whose worker processes report
their failures to the parent as an exit code and a line) import this module; it imports
neither of them, so the layering is ``cli`` → ``demo`` → ``console`` → ``errors``.

* :data:`EXIT_CODES_HELP` and the ``EXIT_*`` constants: the command's exit codes.
* :class:`CommandError`: a failure that already knows its exit code and message.
* :func:`exit_code_for`: the exit code of any exception.
* :func:`one_line`: an exception as one line for a person: no log tail, no internal RPC
  names (``etcd range: ...``), library parameter names spelled as the command's flags.

Pure functions, thread-safe, no I/O.
"""

from __future__ import annotations

import re

from . import errors

__all__ = [
    "EXIT_CODES_HELP",
    "EXIT_ETCD_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_PERMISSION",
    "EXIT_TIMEOUT",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "CommandError",
    "exit_code_for",
    "one_line",
]

EXIT_OK = 0
EXIT_NOT_FOUND = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_PERMISSION = 4
EXIT_TIMEOUT = 5
EXIT_ETCD_ERROR = 6
EXIT_INTERRUPTED = 130

EXIT_CODES_HELP = """\
exit codes:
  0    success
  1    key not found (get, delete)
  2    usage error: bad arguments or invalid input
  3    etcd unreachable, TLS handshake failed, or etcd could not be started
  4    permission denied or authentication failed
  5    timed out (get --timeout, watch --count with --timeout, a stuck demo)
  6    any other error (reported by etcd, or a failed demo worker)
  130  interrupted (Ctrl-C, SIGTERM, SIGHUP) -- except watch and etcd, where that is how
       you stop them (exit 0)
"""

#: Longest line :func:`one_line` returns.
MAX_LINE = 500


class CommandError(Exception):
    """A failure of a command (or of the demo) whose exit code is known: ``exit_code``."""

    def __init__(self, message: str, exit_code: int = EXIT_UNREACHABLE) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def exit_code_for(exc: BaseException) -> int:
    """The exit code for an exception (see :data:`EXIT_CODES_HELP`)."""
    from .server import EtcdNotFoundError, EtcdStartError

    if isinstance(exc, CommandError):
        return exc.exit_code
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(exc, errors.KeyNotFoundError):
        return EXIT_NOT_FOUND
    if isinstance(exc, (errors.InvalidInputError, errors.InvalidTypeError)):
        return EXIT_USAGE
    if isinstance(exc, errors.EtcdPermissionError):
        return EXIT_PERMISSION
    if isinstance(exc, (errors.EtcdConnectionError, EtcdNotFoundError, EtcdStartError)):
        return EXIT_UNREACHABLE
    if isinstance(exc, errors.StoreTimeoutError):
        return EXIT_TIMEOUT
    return EXIT_ETCD_ERROR


#: ``etcd <rpc>: `` at the start of a connection-layer message: the RPC is an internal name.
_RPC_PREFIX = re.compile(r"^etcd (?:range|txn|put|delete_range|status|authenticate|"
                         r"lease_grant|lease_revoke|lease_time_to_live|watch): ")
#: Library parameter names (``EtcdStore``, ``Credentials``) → the command's flags.
_FLAGS = {"ca_cert": "--cacert", "cert_cert": "--cert", "cert_key": "--key"}
_PARAMETER = re.compile(r"\b(" + "|".join(_FLAGS) + r")\b")
_USER_AND_PASSWORD = re.compile(r"\buser and password\b")


def _for_people(text: str) -> str:
    """``text`` without an RPC prefix, library parameter names spelled as flags."""
    stripped = _RPC_PREFIX.sub("", text, count=1)
    if stripped != text and not stripped.startswith("etcd"):
        stripped = "etcd: " + stripped  # "etcd put: permission denied" -> "etcd: ..."
    stripped = _PARAMETER.sub(lambda m: _FLAGS[m.group(1)], stripped)
    return _USER_AND_PASSWORD.sub("--user and --password", stripped)


def one_line(exc: BaseException) -> str:
    """``str(exc)`` on one line, for a person.

    The first line (etcd start errors append a log tail) with the last line of that tail
    when there is one, internal RPC names dropped (``etcd range: etcd unreachable`` →
    ``etcd unreachable``), ``ca_cert``/``cert_cert``/``cert_key`` named as the flags
    ``--cacert``/``--cert``/``--key``, whitespace collapsed, at most :data:`MAX_LINE`
    characters.
    """
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    text = lines[0]
    tail = [line for line in lines[1:] if not line.startswith("---")]
    if tail and getattr(exc, "log_tail", None):
        text += f" [etcd log: {tail[-1][:200]}]"
    text = " ".join(text.split())
    text = _for_people(text)
    return text if len(text) <= MAX_LINE else text[:MAX_LINE - 3] + "..."
