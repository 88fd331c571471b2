"""Child processes of the throw-away servers, and the loopback plumbing they need.

:class:`ManagedProcess` launches a child in its own process group (so signals reach
whatever it forks), appends its output to a log file, and registers itself in a
module-level table while the child may be running; an :mod:`atexit` hook SIGKILLs
whatever is still registered when the interpreter exits. Also here: :func:`free_port`,
``host:port`` formatting, a proxy-free HTTP GET, the log tail quoted by start errors and
the environment handed to children.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import os
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path

DEFAULT_HOST = "127.0.0.1"
#: Seconds ``stop()`` waits after SIGTERM before it sends SIGKILL.
STOP_GRACE = 5.0
#: How many lines of the process log an :class:`EtcdStartError` quotes.
LOG_TAIL_LINES = 40


# --------------------------------------------------------------------------- ports & URLs

_ports_lock = threading.Lock()
_recent_ports: deque[int] = deque(maxlen=256)


def free_port(host: str = DEFAULT_HOST) -> int:
    """Return a TCP port that was free on ``host`` a moment ago (bind to port 0).

    Ports handed out recently by this process are never returned twice, so the members of
    one cluster cannot collide with each other; another process may still grab the port
    before it is used, which is why starts are retried with new ports.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with _ports_lock:
        for _ in range(100):
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.bind((host, 0))
                port = int(sock.getsockname()[1])
            if port not in _recent_ports:
                _recent_ports.append(port)
                return port
    raise OSError(f"no free port found on {host}")


def hostport(host: str, port: int) -> str:
    """``host:port``, with an IPv6 address in brackets."""
    try:
        is_v6 = ipaddress.ip_address(host).version == 6
    except ValueError:
        is_v6 = False
    return f"[{host}]:{port}" if is_v6 else f"{host}:{port}"


def http_get(url: str, *, timeout: float, context: ssl.SSLContext | None = None) -> bytes:
    """GET ``url`` ignoring any ``*_proxy`` environment variables; blocks up to ``timeout``."""
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=context))
    opener = urllib.request.build_opener(*handlers)
    with opener.open(url, timeout=timeout) as response:
        return response.read()


# --------------------------------------------------------------------------- processes


class ManagedProcess:
    """One child process (re)launched in its own process group, logged to a file.

    Thread-safe. Lives as long as its owner and survives restarts; registered in
    ``_LIVE`` while a child may be running so the atexit hook can kill it.
    """

    def __init__(self, label: str) -> None:
        self.label = label
        self.popen: subprocess.Popen[bytes] | None = None
        self.paused = False
        self.log_offset = 0
        self._lock = threading.RLock()

    @property
    def pid(self) -> int | None:
        popen = self.popen
        return popen.pid if popen is not None and popen.poll() is None else None

    def running(self) -> bool:
        popen = self.popen
        return popen is not None and popen.poll() is None

    def exit_code(self) -> int | None:
        """The exit code of the last child once it has exited; ``None`` while it runs or
        before the first launch."""
        popen = self.popen
        return None if popen is None else popen.poll()

    def launch(
        self, cmd: Sequence[str], *, log_path: Path, env: Mapping[str, str], cwd: Path
    ) -> None:
        with self._lock:
            if self.running():
                raise RuntimeError(f"{self.label} is already running (pid {self.pid})")
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "ab") as log:
                self.log_offset = log.tell()
                log.write(f"=== {time.strftime('%H:%M:%S')} {' '.join(cmd)}\n".encode())
                log.flush()
                # The child gets its own copy of the descriptor: nothing to close later, and
                # no pipe that could fill up and block etcd.
                self.popen = subprocess.Popen(
                    list(cmd),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=dict(env),
                    cwd=str(cwd),
                    start_new_session=True,
                )
            self.paused = False
            with _LIVE_LOCK:
                _LIVE.add(self)

    def _signal_group(self, sig: int) -> None:
        popen = self.popen
        if popen is None:
            return
        try:
            os.killpg(popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            if popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    popen.send_signal(sig)

    def send(self, sig: int) -> None:
        """Signal the whole process group (no-op when not running)."""
        with self._lock:
            if self.running():
                self._signal_group(sig)

    def pause(self) -> None:
        with self._lock:
            if not self.running():
                raise RuntimeError(f"{self.label} is not running")
            self._signal_group(signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        with self._lock:
            if self.running():
                self._signal_group(signal.SIGCONT)
            self.paused = False

    def kill(self) -> int | None:
        """SIGKILL the process group and reap it; returns the exit code (None if never run)."""
        with self._lock:
            popen = self.popen
            if popen is None:
                return None
            self._signal_group(signal.SIGKILL)
            code = popen.wait()
            self.paused = False
            with _LIVE_LOCK:
                _LIVE.discard(self)
            return code

    def terminate(self, grace: float = STOP_GRACE) -> int | None:
        """SIGTERM (and SIGCONT if paused), wait ``grace`` seconds, then SIGKILL."""
        with self._lock:
            popen = self.popen
            if popen is None:
                return None
            if popen.poll() is None:
                self._signal_group(signal.SIGTERM)
                if self.paused:
                    self._signal_group(signal.SIGCONT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    popen.wait(grace)
            return self.kill()  # reaps, and kills anything left in the group


_LIVE_LOCK = threading.Lock()
_LIVE: set[ManagedProcess] = set()


@atexit.register
def _kill_leftovers() -> None:
    """atexit hook: SIGKILL every child process still registered."""
    with _LIVE_LOCK:
        leftovers = list(_LIVE)
    for proc in leftovers:
        with contextlib.suppress(Exception):
            proc.kill()


def cleanup(proc: ManagedProcess, tmp_root: Path) -> None:
    """Finalizer shared by all servers: kill the child, remove the temporary directory."""
    with contextlib.suppress(Exception):
        proc.kill()
    shutil.rmtree(tmp_root, ignore_errors=True)


def log_tail(path: Path, lines: int = LOG_TAIL_LINES, offset: int = 0) -> str:
    """The last ``lines`` lines of ``path`` from byte ``offset`` on (``""`` if unreadable)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


def child_env(extra: Mapping[str, str] | None, strip_prefix: str) -> dict[str, str]:
    """os.environ without variables that would shadow our flags, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(strip_prefix)}
    env.update(extra or {})
    return env
