"""Child processes of the throw-away servers, and the loopback plumbing they need.

:class:`ManagedProcess` launches a child in its own process group (so signals reach
whatever it forks), appends its output to a log file, and registers itself in a
module-level table while the child may be running; an :mod:`atexit` hook SIGKILLs
whatever is still registered when the interpreter exits.

Children die with their parent even when it cannot clean up (SIGKILL, ``os._exit``):

* a child launched from the main thread asks the kernel for SIGKILL when its parent dies
  (``PR_SET_PDEATHSIG``, set by util-linux's ``setpriv`` which then execs the child; the
  kernel ties it to the thread that forked, so children of other threads, and hosts
  without ``setpriv``, rely on the janitor alone). No Python runs between fork and exec:
  a ``preexec_fn`` would force a full ``fork()`` that runs gRPC's and Python's at-fork
  handlers in the child, which aborted (grpc's epoll ``next_worker->state == KICKED``
  check) or deadlocked when the parent had live gRPC threads. Without it the child is
  started with ``vfork``, which runs no handlers;
* a *janitor* process (one per parent process, started with the first child, in its own
  session) holds the read end of a pipe from the parent. When the parent is gone the pipe
  reads EOF and the janitor SIGKILLs the process groups still registered and removes their
  working directories (only ones under the system's temporary directory), then exits. A
  parent that exits normally has unregistered everything, so its janitor just exits.

Also here: :func:`free_port`, ``host:port`` formatting, a proxy-free HTTP GET, the log
tail quoted by start errors and the environment handed to children.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import cast

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
        """Start ``cmd`` in its own session, output appended to ``log_path``.

        ``cwd`` is the child's private directory: if this process dies without cleaning
        up, the janitor removes it (when it lies under the temporary directory) after
        killing the child. Raises RuntimeError if a child is already running, OSError if
        it cannot be started.
        """
        with self._lock:
            if self.running():
                raise RuntimeError(f"{self.label} is already running (pid {self.pid})")
            prefix = _pdeathsig_prefix()
            if prefix and shutil.which(cmd[0]) is None:  # setpriv would exit 127 instead
                raise FileNotFoundError(f"{self.label}: no executable {cmd[0]!r}")
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "ab") as log:
                self.log_offset = log.tell()
                log.write(f"=== {time.strftime('%H:%M:%S')} {' '.join(cmd)}\n".encode())
                log.flush()
                # The child gets its own copy of the descriptor: nothing to close later, and
                # no pipe that could fill up and block etcd.
                self.popen = subprocess.Popen(
                    [*prefix, *cmd],
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
            _JANITOR.watch(self.popen.pid, Path(cwd))

    def _signal_group(self, sig: int) -> None:
        popen = self.popen
        if popen is None:
            return
        if popen.returncode is not None and _pid_in_use(popen.pid):
            # The child was reaped, so its pid is free for reuse once its group is empty
            # (the kernel frees a pid only when no process has it as its pid, group or
            # session id). A process that has the pid now is therefore not ours, and our
            # group is empty: signalling the group would kill a stranger, e.g. a later
            # etcd, which leads its own group. (With pid_max at 32,768 a test suite
            # recycles every pid within minutes, and a server is killed again at close.)
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
            _JANITOR.forget_pid(popen.pid)
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


def _pid_in_use(pid: int) -> bool:
    """Whether some process has ``pid`` now (signal 0: the existence check)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
    _JANITOR.forget_dir(tmp_root)


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


# --------------------------------------------------------------------------- dying together

#: ``prctl`` option: the signal this process gets when its parent (thread) dies.
PR_SET_PDEATHSIG = 1
_libc: ctypes.CDLL | None = None


def _prctl() -> Callable[..., int]:
    """libc's ``prctl``, loaded once in the parent (never between fork and exec)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return cast(Callable[..., int], _libc.prctl)


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies; exit at once (code 1)
    if the parent, ``parent_pid``, is already gone. Linux only; a no-op elsewhere.

    The kernel sends the signal when the parent *thread* that forked this process ends,
    so the parent must fork from a thread that lives as long as it (the main thread).
    """
    if not sys.platform.startswith("linux"):
        return
    _prctl()(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def _pdeathsig_prefix() -> list[str]:
    """The command prefix that makes a child die with this process: ``setpriv
    --pdeathsig KILL --``, only for children forked by the main thread (see
    :func:`die_with_parent`) on Linux hosts that have ``setpriv``; else nothing (the
    janitor still kills the child). ``setpriv`` sets the signal and execs the command, so
    the child keeps its pid and its name."""
    if not sys.platform.startswith("linux") or \
            threading.current_thread() is not threading.main_thread():
        return []
    setpriv = _setpriv()
    return [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []


@functools.cache
def _setpriv() -> str | None:
    """util-linux's ``setpriv`` if it is on PATH and knows ``--pdeathsig`` (looked up once)."""
    found = shutil.which("setpriv")
    if found is None:
        return None
    probe = subprocess.run([found, "--pdeathsig", "KILL", "--", "true"],
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, check=False)
    return found if probe.returncode == 0 else None


#: The janitor's program (stdlib only, run with ``python -I -S``): JSON lines on stdin
#: register/unregister process groups and directories; at EOF it cleans up what is left.
_JANITOR_SCRIPT = r"""
import json, os, shutil, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGHUP, signal.SIG_IGN)
pids, dirs = {}, set()
for line in sys.stdin:
    verb, arg, *rest = json.loads(line)
    if verb == "pid": pids[arg] = rest[0]
    elif verb == "unpid": pids.pop(arg, None)
    elif verb == "dir": dirs.add(arg)
    elif verb == "undir": dirs.discard(arg)
def started(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[19]
    except OSError:
        return None
def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False
victims = [pid for pid, start in pids.items() if start is not None and started(pid) == start]
for pid in victims:
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
            break
        except OSError:
            pass
deadline = time.monotonic() + 10
while any(alive(pid) for pid in victims) and time.monotonic() < deadline:
    time.sleep(0.05)
for path in dirs:
    shutil.rmtree(path, ignore_errors=True)
"""


def _start_time(pid: int) -> str | None:
    """Field 22 of ``/proc/<pid>/stat`` (start time in clock ticks): with the pid, it names
    one process, so a recycled pid is never killed by mistake."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[19]
    except OSError:
        return None


class _Janitor:
    """This process's janitor (see the module docstring). Thread-safe; best effort: if the
    janitor cannot be started or has died, registering is silently a no-op."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._owner = 0

    def _send(self, *record: object) -> None:
        line = (json.dumps(record) + "\n").encode()
        with self._lock:
            if self._proc is None or self._owner != os.getpid():
                self._start()
            proc = self._proc
            if proc is None or proc.stdin is None:
                return
            try:
                proc.stdin.write(line)
                proc.stdin.flush()
            except OSError:
                pass

    def _start(self) -> None:
        self._owner = os.getpid()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _JANITOR_SCRIPT], stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True, cwd="/")
        except OSError:
            self._proc = None

    def watch(self, pid: int, directory: Path) -> None:
        """Kill process group ``pid`` and remove ``directory`` (if under the temporary
        directory) should this process die first."""
        self._send("pid", pid, _start_time(pid))
        tmp = Path(tempfile.gettempdir()).resolve()
        resolved = directory.resolve()
        if resolved != tmp and tmp in resolved.parents:
            self._send("dir", str(resolved))

    def forget_pid(self, pid: int) -> None:
        if self._proc is not None:
            self._send("unpid", pid)

    def forget_dir(self, directory: Path) -> None:
        if self._proc is not None:
            self._send("undir", str(directory.resolve()))

    def _after_fork_in_child(self) -> None:
        # The pipe belongs to the parent's janitor; a forked child starts its own if needed.
        # The lock may have been held by another thread at the fork: a fresh one.
        self._lock = threading.Lock()
        self._proc, self._owner = None, 0


_JANITOR = _Janitor()
os.register_at_fork(after_in_child=_JANITOR._after_fork_in_child)
