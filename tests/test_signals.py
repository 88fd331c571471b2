"""Clean exits: ``cachedstore etcd`` and the demo on SIGINT, SIGTERM, SIGHUP and SIGKILL.

After each signal, checked by pid: no etcd left (and nothing listening on its port), no
worker process, no temporary directory. SIGINT/SIGTERM/SIGHUP are handled like Ctrl-C;
SIGKILL cannot be handled, so there the children must die with their parent
(``PR_SET_PDEATHSIG``) and the janitor process must remove the temporary directory.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from cachedstore.server import free_port

pytestmark = pytest.mark.timeout(120)

#: Upper bound for a dead parent's children and directory to go (a bound, not a timing).
GONE_WITHIN = 20.0


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("CACHEDSTORE_")}


def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + GONE_WITHIN
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _port_closed(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def _assert_cleaned_up(pids: list[int], directory: Path, port: int | None) -> None:
    _wait_until(lambda: all(_gone(pid) for pid in pids), f"still running: {pids}")
    _wait_until(lambda: not directory.exists(), f"{directory} left behind")
    if port is not None:
        assert _port_closed(port)


def _janitor(parent: int) -> psutil.Process:
    """The janitor process ``cachedstore.server.process`` started for ``parent``."""
    found = [c for c in psutil.Process(parent).children()
             if c.cmdline()[1:4] == ["-I", "-S", "-c"]]
    assert len(found) == 1, [c.cmdline() for c in psutil.Process(parent).children()]
    return found[0]


def _kill_parent(proc: subprocess.Popen[str], children: list[int]) -> psutil.Process:
    """SIGKILL ``proc`` while its janitor is stopped: the children must die of
    PR_SET_PDEATHSIG alone. Returns the janitor, resumed, to clean up the directory."""
    janitor = _janitor(proc.pid)
    janitor.suspend()
    try:
        proc.kill()
        proc.communicate(timeout=30)
        _wait_until(lambda: all(_gone(pid) for pid in children),
                    f"children outlived their parent: {children}")
    finally:
        janitor.resume()
    return janitor


SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGKILL]


@pytest.mark.parametrize("sig", SIGNALS, ids=[s.name for s in SIGNALS])
def test_cachedstore_etcd_leaves_nothing_behind(sig: signal.Signals) -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cachedstore", "etcd", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env())
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith(f"etcd serving on http://127.0.0.1:{port}"), line
        etcd = next(c for c in psutil.Process(proc.pid).children() if c.name() == "etcd")
        tmp_root = Path(etcd.cwd())
        assert tmp_root.is_dir() and not _port_closed(port)
        if sig == signal.SIGKILL:
            janitor = _kill_parent(proc, [etcd.pid])
            err = ""
        else:
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
        _wait_until(lambda: _gone(janitor.pid), "the janitor did not exit")
    else:
        assert proc.returncode == 0, err
        assert "Traceback" not in err and "stopping etcd" in err
    _assert_cleaned_up([etcd.pid], tmp_root, port)


def _demo_children(pid: int) -> tuple[psutil.Process, list[psutil.Process]]:
    """The demo's etcd and its worker processes, once both workers are running."""
    deadline = time.monotonic() + 60
    while True:
        children = psutil.Process(pid).children()
        etcds = [c for c in children if c.name() == "etcd"]
        workers = [c for c in children if "multiprocessing.spawn" in " ".join(c.cmdline())
                   and "resource_tracker" not in " ".join(c.cmdline())]
        if len(etcds) == 1 and len(workers) == 2:
            return etcds[0], workers
        assert time.monotonic() < deadline, [c.cmdline() for c in children]
        time.sleep(0.1)


DEMO_SIGNALS = [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL]  # SIGINT: test_demo.py


@pytest.mark.parametrize("sig", DEMO_SIGNALS, ids=[s.name for s in DEMO_SIGNALS])
def test_demo_leaves_nothing_behind(sig: signal.Signals) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "cachedstore", "demo", "--workers", "2", "--rounds", "100000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        assert proc.stderr is not None
        # the first line is printed once etcd answers; the workers are spawned next
        assert "etcd 3." in proc.stderr.readline()
        etcd, workers = _demo_children(proc.pid)
        tmp_root = Path(etcd.cwd())
        if sig == signal.SIGKILL:
            janitor = _kill_parent(proc, [etcd.pid, *(w.pid for w in workers)])
            err = ""
        else:
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
        _wait_until(lambda: _gone(janitor.pid), "the janitor did not exit")
    else:
        assert proc.returncode == 130, err
        assert err.strip().splitlines()[-1] == "cachedstore demo: interrupted"
        assert "Traceback" not in err
    _assert_cleaned_up([etcd.pid, *(w.pid for w in workers)], tmp_root, None)


_forked_children_ran_python = []


def _record_python_in_child() -> None:
    if _forked_children_ran_python:
        os.write(_forked_children_ran_python[0], b"x")


os.register_at_fork(after_in_child=_record_python_in_child)


def test_children_start_without_running_python_between_fork_and_exec(tmp_path: Path) -> None:
    """A child is started with no Python (and so no at-fork handler) run in it before exec.

    A ``preexec_fn`` forces a full ``fork()`` that runs every at-fork handler in the child:
    gRPC's aborted there (``ev_epoll1_linux.cc ... next_worker->state == KICKED``) and
    Python's could deadlock on a lock held by another thread when etcd was restarted by a
    process with a live store. Python's ``after_in_child`` handlers stand in for gRPC's here:
    both run only after a real ``fork()``."""
    from cachedstore.server.process import ManagedProcess, _pdeathsig_prefix

    assert "--pdeathsig" in _pdeathsig_prefix(), \
        "setpriv is needed for children to die with their parent (test_signals SIGKILL)"
    read_end, write_end = os.pipe()
    _forked_children_ran_python.append(write_end)
    child = ManagedProcess("true")
    try:
        child.launch(["true"], log_path=tmp_path / "log", env=_env(), cwd=tmp_path)
        assert child.popen is not None and child.popen.wait(timeout=30) == 0
    finally:
        _forked_children_ran_python.clear()
        child.kill()
        os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        assert reader.read() == b"", "the child ran Python at-fork handlers before exec"


def test_a_reaped_childs_pid_is_never_signalled_once_another_process_has_it(tmp_path: Path
                                                                           ) -> None:
    """A server is killed again after it was reaped (``stop()``, then ``close()``; a kill,
    then the finalizer). With ``pid_max`` at 32,768 a CI run recycles every pid within
    minutes, and each etcd leads a process group of its own: the group signal of a reaped
    child must not reach whichever process has its pid now. The recycling is staged: the
    reaped child's pid is set to a live bystander's."""
    from cachedstore.server.process import ManagedProcess

    ours, bystander = ManagedProcess("ours"), ManagedProcess("bystander")
    for proc in (ours, bystander):
        proc.launch(["sleep", "60"], log_path=tmp_path / f"{proc.label}.log", env=_env(),
                    cwd=tmp_path)
    try:
        assert ours.kill() == -signal.SIGKILL
        assert ours.popen is not None and bystander.popen is not None
        ours.popen.pid = bystander.popen.pid  # what a recycled pid looks like from here
        ours.kill()
        ours.terminate(grace=0.1)
        ours.send(signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):  # a SIGKILL lands in microseconds
            bystander.popen.wait(timeout=0.5)
    finally:
        bystander.kill()


def test_a_reaped_childs_group_is_still_killed_while_it_has_members(tmp_path: Path) -> None:
    """The other side of that rule: once the group's leader was reaped, the processes it
    forked are still killed with the group (their group id keeps its pid from reuse)."""
    from cachedstore.server.process import ManagedProcess

    child = ManagedProcess("leader")
    pid_file = tmp_path / "grandchild"
    child.launch(["sh", "-c", f"sleep 60 & echo $! > {pid_file}; wait"],
                 log_path=tmp_path / "log", env=_env(), cwd=tmp_path)
    assert child.popen is not None
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline, "the shell never started its child"
        time.sleep(0.01)
    grandchild = psutil.Process(int(pid_file.read_text()))
    try:
        os.kill(child.popen.pid, signal.SIGKILL)  # the leader alone
        child.popen.wait(timeout=30)
        assert grandchild.is_running() and grandchild.status() != psutil.STATUS_ZOMBIE
        child.kill()
        grandchild.wait(timeout=30)
    finally:
        if grandchild.is_running():
            grandchild.kill()
