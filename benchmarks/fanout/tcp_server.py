"""One torch ``TCPStore`` server (libuv) in a child process: :class:`TCPStoreServer`.

The server runs in its own process so that its event loop does not share a GIL with the
simulated ranks, as in a real job. ``close()`` (also on ``__exit__``) ends it: stdin is
closed, then SIGKILL after 5 s. Construction blocks until the server printed its port
(bounded by ``startup_timeout``) and raises ``RuntimeError`` otherwise.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from typing import Any

__all__ = ["TCPStoreServer"]

_SCRIPT = (
    "import sys, datetime, torch.distributed as d\n"
    "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, use_libuv=True,\n"
    "               timeout=datetime.timedelta(seconds=600))\n"
    "print(s.port, flush=True)\n"
    "sys.stdin.read()\n"
)


class TCPStoreServer:
    """A ``TCPStore`` master on 127.0.0.1 in another Python process (``host``, ``port``)."""

    host = "127.0.0.1"

    def __init__(self, startup_timeout: float = 60.0) -> None:
        self._proc = subprocess.Popen([sys.executable, "-c", _SCRIPT], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self._proc.stdout.readline()
                                                             if self._proc.stdout else ""),
                                  name="fanout-tcpstore-port", daemon=True)
        reader.start()
        reader.join(startup_timeout)
        text = line[0].strip() if line else ""
        if not text.isdigit():
            self.close()
            raise RuntimeError(f"the TCPStore server did not start: {text!r}")
        self.port = int(text)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self._proc.stdin:
                self._proc.stdin.close()
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def __enter__(self) -> TCPStoreServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
