"""The operator CLI against real etcd: output, exit codes, one-line errors, env variables.

Most commands run in-process through ``cachedstore.cli.main`` (fast); the ones whose point
is a process boundary (``python -m cachedstore``: ``__main__.py``; signals, ``cachedstore etcd``) run as
subprocesses.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from cachedstore import EtcdStore
from cachedstore.cli import EXIT_CODES_HELP, main
from cachedstore.server import LocalEtcd, free_port
from cachedstore.testing import make_tls_files

pytestmark = pytest.mark.timeout(60)

ENV_VARS = ("CACHEDSTORE_ENDPOINTS", "CACHEDSTORE_PREFIX", "CACHEDSTORE_CACERT",
            "CACHEDSTORE_CERT", "CACHEDSTORE_KEY", "CACHEDSTORE_USER", "CACHEDSTORE_PASSWORD",
            "CACHEDSTORE_DIAL_TIMEOUT")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


class Run:
    """What an in-process ``cachedstore`` invocation produced."""

    def __init__(self, code: int, out: bytes, err: bytes) -> None:
        self.code, self.out, self.err = code, out, err.decode()

    @property
    def text(self) -> str:
        return self.out.decode()

    def json(self) -> Any:
        return json.loads(self.out)


@pytest.fixture
def cli(capfdbinary: pytest.CaptureFixture[bytes]):
    def run(*argv: str) -> Run:
        code = main(list(argv))
        out, err = capfdbinary.readouterr()
        return Run(code, out, err)

    return run


def one_error_line(run: Run, command: str) -> str:
    """The single stderr line of a failed command (and no traceback)."""
    lines = run.err.strip().splitlines()
    assert len(lines) == 1, run.err
    assert lines[0].startswith(f"cachedstore {command}: error: "), lines[0]
    assert "Traceback" not in run.err
    return lines[0]


def conn(etcd: LocalEtcd, prefix: str) -> list[str]:
    return ["--endpoints", etcd.endpoint, "--prefix", prefix]


def python_m(*args: str, env: dict[str, str] | None = None, timeout: float = 30
             ) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "cachedstore", *args], capture_output=True,
                          text=True, timeout=timeout, env=full_env, check=False)


# --------------------------------------------------------------------------- get/set/delete


def test_set_get_delete_roundtrip(cli, etcd: LocalEtcd, prefix: str) -> None:
    c = conn(etcd, prefix)
    assert cli("set", "master_addr", "10.0.0.1:29500", *c).text == "OK\n"
    run = cli("get", "master_addr", *c)
    assert (run.code, run.out) == (0, b"10.0.0.1:29500\n")
    got = cli("get", "master_addr", "--json", *c).json()
    assert (got["name"], got["found"], got["value"]) == ("master_addr", True, "10.0.0.1:29500")
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix) as store:  # really in etcd
        assert store.get("master_addr") == b"10.0.0.1:29500"
    assert cli("delete", "master_addr", "--json", *c).json() == {
        "name": "master_addr", "deleted": True}
    run = cli("get", "master_addr", *c)
    assert run.code == 1 and run.out == b""
    assert "key not found: 'master_addr'" in one_error_line(run, "get")


def test_delete_missing_key_exits_1(cli, etcd: LocalEtcd, prefix: str) -> None:
    run = cli("delete", "never-set", *conn(etcd, prefix))
    assert run.code == 1
    assert "key not found" in one_error_line(run, "delete")


def test_get_timeout_waits_then_exits_5(cli, etcd: LocalEtcd, prefix: str) -> None:
    started = time.monotonic()
    run = cli("get", "late", "--timeout", "0.3", *conn(etcd, prefix))
    assert run.code == 5 and time.monotonic() - started >= 0.3
    assert "timed out after 0.3 s" in one_error_line(run, "get")


def test_get_timeout_returns_the_key_once_created(etcd: LocalEtcd, prefix: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "cachedstore", "get", "late", "--timeout", "30",
         *conn(etcd, prefix)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix) as store:
            store.set("late", "here")  # before or after the get starts: both must work
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert (proc.returncode, out, err) == (0, b"here\n", b"")


def test_set_reads_stdin_and_binary_values(etcd: LocalEtcd, prefix: str) -> None:
    value = b"\x00\xffbinary\n"
    done = subprocess.run([sys.executable, "-m", "cachedstore", "set", "blob", "-",
                           *conn(etcd, prefix)], input=value, capture_output=True, timeout=30,
                          check=False)
    assert done.returncode == 0, done.stderr
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix) as store:
        assert store.get("blob") == value


def test_environment_variables(cli, etcd: LocalEtcd, prefix: str,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHEDSTORE_ENDPOINTS", f"127.0.0.1:{free_port()},{etcd.endpoint}")
    monkeypatch.setenv("CACHEDSTORE_PREFIX", prefix)
    monkeypatch.setenv("CACHEDSTORE_DIAL_TIMEOUT", "5")
    assert cli("set", "from-env", "yes").code == 0  # fails over to the live endpoint
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix) as store:
        assert store.get("from-env") == b"yes"
    # flags win over the environment
    other = prefix + "other/"
    assert cli("set", "k", "v", "--prefix", other).code == 0
    with EtcdStore(endpoints=[etcd.endpoint], prefix=other) as store:
        assert store.get("k") == b"v"


# --------------------------------------------------------------------------- errors


def test_unreachable_endpoint_exits_3_quickly(cli) -> None:
    port = free_port()  # nothing listens there
    started = time.monotonic()
    run = cli("get", "k", "--endpoints", f"127.0.0.1:{port}", "--dial-timeout", "0.5")
    elapsed = time.monotonic() - started
    assert run.code == 3
    line = one_error_line(run, "get")
    assert f"127.0.0.1:{port}" in line and "unreachable" in line
    assert "etcd range" not in line  # no internal RPC names
    assert elapsed < 5.0  # bounded by --dial-timeout (plus slack), not the 10 s default


@pytest.mark.parametrize("argv, message", [
    (["get"], "the following arguments are required: name"),
    (["set", "k"], "the following arguments are required: value"),
    (["get", "k", "--dial-timeout", "0"], "must be > 0 seconds"),
    (["get", "k", "--timeout", "soon"], "not a number of seconds"),
    (["watch", "--count", "0"], "must be >= 1"),
    (["etcd", "--port", "70000"], "not a TCP port"),
    (["frobnicate"], "invalid choice"),
])
def test_usage_errors_exit_2_with_one_line(cli, argv: list[str], message: str) -> None:
    run = cli(*argv)
    assert run.code == 2
    lines = run.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "--help" in lines[0], run.err


def test_unknown_flag_names_the_subcommand(cli) -> None:
    run = cli("get", "k", "--bogus")
    assert run.code == 2
    assert run.err == ("cachedstore get: error: unrecognized arguments: --bogus "
                       "(see cachedstore get --help)\n")


def test_no_command_prints_help_and_exits_2(cli) -> None:
    run = cli()
    assert run.code == 2 and "usage: cachedstore" in run.err


def test_invalid_input_exits_2(cli, etcd: LocalEtcd, prefix: str) -> None:
    run = cli("get", "k", "--user", "root", "--endpoints", etcd.endpoint)  # no password
    assert run.code == 2
    assert "CACHEDSTORE_PASSWORD" in one_error_line(run, "get")
    run = cli("get", "k", "--cacert", "/nonexistent/ca.pem", *conn(etcd, prefix))
    assert run.code == 2
    assert "--cacert: cannot read TLS file /nonexistent/ca.pem" in one_error_line(run, "get")


def test_tls_files_are_checked_and_named_by_their_flags(cli, etcd: LocalEtcd, prefix: str,
                                                       tmp_path: Path) -> None:
    good, other = make_tls_files(tmp_path / "good"), make_tls_files(tmp_path / "other")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("this is not a certificate\n")
    c = conn(etcd, prefix)
    cases = [
        (["--cacert", str(garbage)], f"--cacert: {garbage} is not a PEM certificate"),
        (["--cert", str(good.client_cert)], "--cert and --key go together: give both or neither"),
        (["--cert", str(garbage), "--key", str(good.client_key)],
         f"--cert: {garbage} is not a PEM certificate"),
        (["--cert", str(good.client_cert), "--key", str(other.client_key)],
         f"--key: {other.client_key} is not the unencrypted PEM private key of --cert"),
    ]
    for flags, message in cases:
        run = cli("get", "k", *c, *flags)
        assert run.code == 2, run.err
        line = one_error_line(run, "get")
        assert line.endswith(message), line
        assert "cert_key" not in line and "cert_cert" not in line


def test_prefix_without_a_slash_warns_once(cli, etcd: LocalEtcd, prefix: str) -> None:
    bare = prefix.rstrip("/")
    run = cli("set", "k", "v", "--endpoints", etcd.endpoint, "--prefix", bare)
    assert run.code == 0
    assert run.err.splitlines() == [
        f"cachedstore set: warning: --prefix {bare!r} does not end with '/': the name 'k' "
        f"is the key '{bare}k'"]
    with EtcdStore(endpoints=[etcd.endpoint], prefix=bare) as store:
        assert store.get("k") == b"v"  # the key really is bare + "k"
    assert cli("set", "k", "v", *conn(etcd, prefix)).err == ""  # with the slash: silent


def test_etcd_on_a_foreign_address_names_host_not_port(cli) -> None:
    run = cli("etcd", "--host", "192.0.2.1", "--port", str(free_port()))  # TEST-NET-1
    assert run.code == 3
    line = one_error_line(run, "etcd")
    assert "--host 192.0.2.1 is not an address of this machine" in line
    assert "--port" not in line


def test_auth_wrong_password_exits_4_and_env_password_works(
        cli, etcd_factory, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    server = etcd_factory()
    server.enable_auth("rootpw")
    c = ["--endpoints", server.endpoint, "--prefix", prefix, "--user", "root"]
    run = cli("get", "k", *c, "--password", "wrong")
    assert run.code == 4
    assert "authentication failed" in one_error_line(run, "get")
    monkeypatch.setenv("CACHEDSTORE_PASSWORD", "rootpw")
    assert cli("set", "k", "v", *c).code == 0
    assert cli("get", "k", *c).out == b"v\n"
    # a user without a role on the prefix: permission denied
    server.etcdctl("user", "add", "nobody", "--interactive=false", input="nobodypw\n",
                   user="root", password="rootpw")
    monkeypatch.setenv("CACHEDSTORE_PASSWORD", "nobodypw")
    run = cli("get", "k", "--endpoints", server.endpoint, "--prefix", prefix,
              "--user", "nobody")
    assert run.code == 4
    assert "permission denied" in one_error_line(run, "get")


def test_tls_flags(cli, etcd_factory, prefix: str, tmp_path: Path) -> None:
    tls = make_tls_files(tmp_path / "good")
    server = etcd_factory(tls=tls)
    c = ["--endpoints", server.endpoint, "--prefix", prefix]
    assert cli("set", "secure", "yes", *c, "--cacert", tls.ca_cert).code == 0
    assert cli("get", "secure", *c, "--cacert", tls.ca_cert).out == b"yes\n"
    wrong_ca = make_tls_files(tmp_path / "other").ca_cert
    run = cli("get", "secure", *c, "--cacert", wrong_ca, "--dial-timeout", "1")
    assert run.code == 3
    assert "TLS" in one_error_line(run, "get")


# --------------------------------------------------------------------------- output


def test_json_is_json_also_for_a_missing_key(cli, etcd: LocalEtcd, prefix: str) -> None:
    c = conn(etcd, prefix)
    run = cli("get", "absent", "--json", *c)
    assert run.code == 1 and run.json() == {"name": "absent", "found": False}
    assert "key not found" in one_error_line(run, "get")
    run = cli("get", "late", "--json", "--timeout", "0.2", *c)
    assert run.code == 5 and run.json() == {"name": "late", "found": False}
    put = cli("set", "k", "v", "--json", *c).json()
    assert put["name"] == "k" and put["ok"] is True and put["revision"] > 0
    got = cli("get", "k", "--json", *c).json()
    assert got == {"name": "k", "found": True, "value": "v", "mod_revision": put["revision"],
                   "version": 1}
    assert cli("delete", "k", "--json", *c).json() == {"name": "k", "deleted": True}
    run = cli("delete", "k", "--json", *c)
    assert run.code == 1 and run.json() == {"name": "k", "deleted": False}


def test_binary_values_base64_in_json_and_byte_exact_with_raw(cli, etcd: LocalEtcd,
                                                              prefix: str) -> None:
    value = b"\x00\xff\xfebinary\n"
    with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix) as store:
        store.set("blob", value)
        store.set("text", "plain\n")
    c = conn(etcd, prefix)
    got = cli("get", "blob", "--json", *c).json()
    assert "value" not in got and base64.b64decode(got["value_base64"]) == value
    assert cli("get", "text", "--json", *c).json()["value"] == "plain\n"
    assert cli("get", "blob", "--raw", *c).out == value  # no newline added
    assert cli("get", "blob", *c).out == value + b"\n"


def test_watch_json_base64_for_binary_values(etcd: LocalEtcd, prefix: str) -> None:
    proc = start_watch(etcd, prefix, "--count", "2", "--json")
    try:
        with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix) as store:
            store.set("bin", b"\xff\x00")
            store.set("txt", "ok")
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    first, second = (json.loads(line) for line in out.splitlines())
    assert base64.b64decode(first["value_base64"]) == b"\xff\x00" and "value" not in first
    assert second["value"] == "ok"


# --------------------------------------------------------------------------- stats, help


def test_stats_json_and_text(cli, etcd: LocalEtcd, prefix: str) -> None:
    c = conn(etcd, prefix)
    cli("set", "a", "1", *c)
    cli("set", "b", "2", *c)
    run = cli("stats", "--json", *c)
    assert run.code == 0
    report = run.json()
    assert set(report) == {"prefix", "endpoints", "keys_under_prefix", "etcd",
                           "requests_made_by_this_command"}
    assert report["keys_under_prefix"] == 2
    assert report["prefix"] == prefix and report["endpoints"] == [etcd.endpoint]
    assert report["etcd"]["version"].startswith("3.")
    assert report["etcd"]["revision"] >= 2
    # a plain client: one count-only range and one status, no preload, no watch
    assert report["requests_made_by_this_command"] == {"range:ok": 1, "status:ok": 1}
    text = cli("stats", *c).text
    rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in text.splitlines())
    assert rows["keys under prefix"] == "2" and rows["etcd version"].startswith("3.")
    assert rows["prefix"] == prefix
    assert rows["etcd member id"] == f"{report['etcd']['member_id']:x}"  # as etcdctl shows it
    assert rows["etcd requests made"] == "range:ok=1, status:ok=1"
    for repr_only in ("{", "}", "None", "True", "False", "'"):
        assert repr_only not in text, text


def test_help_on_every_command_documents_exit_codes() -> None:
    commands = ["demo", "get", "set", "delete", "watch", "stats", "etcd"]
    top = python_m("--help")
    assert top.returncode == 0
    assert EXIT_CODES_HELP.strip() in top.stdout
    for command in commands:
        assert command in top.stdout
        done = python_m(command, "--help")
        assert done.returncode == 0, done.stderr
        assert f"usage: cachedstore {command}" in done.stdout
        assert "130  interrupted" in done.stdout
    assert "CACHEDSTORE_ENDPOINTS" in python_m("get", "--help").stdout


def test_console_script_and_version() -> None:
    from cachedstore import __version__

    done = subprocess.run(["cachedstore", "--version"], capture_output=True, text=True,
                          timeout=30, check=False)
    assert (done.returncode, done.stdout.strip()) == (0, f"cachedstore {__version__}")


# --------------------------------------------------------------------------- watch


def start_watch(etcd: LocalEtcd, prefix: str, *extra: str) -> subprocess.Popen[str]:
    """A ``cachedstore watch`` subprocess, returned once its watch exists (it says so on
    stderr after etcd confirmed the watch)."""
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    proc = subprocess.Popen([sys.executable, "-m", "cachedstore", "watch", *conn(etcd, prefix),
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    assert proc.stderr is not None
    line = proc.stderr.readline()
    assert line.startswith(f"watching {prefix} on {etcd.endpoint}"), line
    return proc


def test_watch_prints_changes_until_count(etcd: LocalEtcd, prefix: str) -> None:
    proc = start_watch(etcd, prefix, "--count", "3", "--json")
    try:
        with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix.rstrip("/") + "-x/") as other:
            other.set("a", "not under the watched prefix")
        with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix) as store:
            store.set("a", "1")
            store.set("b", "2")
            store.delete("a")
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    events = [json.loads(line) for line in out.splitlines()]
    assert [(e["type"], e["name"], e.get("value")) for e in events] == [
        ("PUT", "a", "1"), ("PUT", "b", "2"), ("DELETE", "a", None)]
    assert events[0]["revision"] < events[1]["revision"] < events[2]["revision"]


def test_watch_text_output_and_ctrl_c(etcd: LocalEtcd, prefix: str) -> None:
    proc = start_watch(etcd, prefix)
    try:
        with EtcdStore(endpoints=[etcd.endpoint], prefix=prefix) as store:
            store.set("k", "hello world")
        assert proc.stdout is not None
        assert proc.stdout.readline() == "PUT k hello world\n"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=15)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "Traceback" not in err


def test_watch_count_not_reached_by_timeout_exits_5(etcd: LocalEtcd, prefix: str) -> None:
    done = python_m("watch", "--count", "1", "--timeout", "0.5", *conn(etcd, prefix))
    assert done.returncode == 5
    assert done.stderr.strip().splitlines()[-1] == (
        "cachedstore watch: error: saw 0 of 1 events in 0.5 s")
    done = python_m("watch", "--timeout", "0.3", *conn(etcd, prefix))
    assert done.returncode == 0  # no --count: the timeout is just the end


# --------------------------------------------------------------------------- cachedstore etcd


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_etcd_command_serves_until_ctrl_c(tmp_path: Path) -> None:
    port = free_port()
    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    proc = subprocess.Popen([sys.executable, "-m", "cachedstore", "etcd", "--port", str(port),
                             "--data-dir", str(data)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith(f"etcd serving on http://127.0.0.1:{port}"), line
        children = [c for c in psutil.Process(proc.pid).children(recursive=True)
                    if c.name() == "etcd"]
        assert len(children) == 1
        etcd_pid = children[0].pid
        with EtcdStore(port=port, host="127.0.0.1") as store:
            store.set("/dev/hello", "world")
        # the port is taken now: a second one fails with one line, exit 3
        second = python_m("etcd", "--port", str(port))
        assert second.returncode == 3
        assert second.stderr.strip().splitlines() == [
            f"cachedstore etcd: error: cannot start etcd: 127.0.0.1:{port} is not available "
            f"(Address already in use); pick another --port"]
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0
    assert _gone(etcd_pid)
    assert (data / "member").is_dir()  # --data-dir is kept


def test_python_m_unreachable_one_line() -> None:
    done = python_m("set", "k", "v", "--endpoints", f"127.0.0.1:{free_port()}",
                    "--dial-timeout", "0.3")
    assert done.returncode == 3
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


def test_grpc_log_lines_are_dropped_from_stderr_others_kept(
        capfdbinary: pytest.CaptureFixture[bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    from cachedstore.cli import _without_grpc_logs

    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)
    with _without_grpc_logs():
        os.write(2, b"I1202 10:36:22.763785     429 ssl_transport_security.cc:2563] noise\n")
        os.write(2, b"E1202 10:36:22.8 12 chttp2_transport.cc:1] more noise\n")
        os.write(2, b"a line of ours\n")
        os.write(2, b"unterminated")
    assert capfdbinary.readouterr().err == b"a line of ours\nunterminated"


def test_grpc_verbosity_is_set_for_the_command_and_left_alone_when_chosen(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from cachedstore.cli import _quiet_grpc

    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)
    assert _quiet_grpc() is False  # grpc is imported in this process: too late here...
    assert os.environ["GRPC_VERBOSITY"] == "NONE"  # ...but children inherit it
    monkeypatch.setenv("GRPC_VERBOSITY", "INFO")  # asked for: kept
    assert _quiet_grpc() is True and os.environ["GRPC_VERBOSITY"] == "INFO"


def test_tls_failure_prints_one_line_without_grpc_logs(etcd_factory, prefix: str,
                                                       tmp_path: Path) -> None:
    server = etcd_factory(tls=make_tls_files(tmp_path / "good"))
    wrong_ca = make_tls_files(tmp_path / "other").ca_cert
    done = python_m("get", "k", "--endpoints", server.endpoint, "--prefix", prefix,
                    "--cacert", wrong_ca, "--dial-timeout", "1")
    assert done.returncode == 3
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "TLS handshake" in done.stderr
