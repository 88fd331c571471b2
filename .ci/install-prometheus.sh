#!/usr/bin/env bash
# Install a Prometheus server binary for tests/test_prometheus_e2e.py.
#
# Uses Debian's `prometheus` package when no prometheus binary is present yet
# (/usr/bin/prometheus or `prometheus` on PATH). The e2e test starts its own
# instance (own --config.file, own tmp --storage.tsdb.path, a free loopback
# port), so the service the Debian package may start is not needed: this script
# stops it if it is running, so that nothing keeps port 9090 busy.
#
# Idempotent; needs root (CI runs as root). Usage: bash .ci/install-prometheus.sh
set -euo pipefail

have_prometheus() {
    [ -x /usr/bin/prometheus ] || command -v prometheus >/dev/null 2>&1
}

if have_prometheus; then
    echo "install-prometheus: already present: $(command -v prometheus || echo /usr/bin/prometheus)"
else
    echo "install-prometheus: installing Debian's prometheus package"
    start=$(date +%s)
    # policy-rc.d exit 101 asks invoke-rc.d not to start the service at install time
    # (a no-op on machines without an init system); removed again below.
    policy=/usr/sbin/policy-rc.d
    created_policy=0
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy"
        chmod +x "$policy"
        created_policy=1
    fi
    trap 'if [ "$created_policy" = 1 ]; then rm -f "$policy"; fi' EXIT
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus
    echo "install-prometheus: installed in $(( $(date +%s) - start )) s"
fi

# Make sure no packaged service keeps port 9090 (or any port) busy.
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
    systemctl stop prometheus.service >/dev/null 2>&1 || true
    systemctl disable prometheus.service >/dev/null 2>&1 || true
elif [ -x /etc/init.d/prometheus ]; then
    /etc/init.d/prometheus stop >/dev/null 2>&1 || true
fi
# Without an init system a maintainer script may still have started the daemon:
# the packaged one runs as the `prometheus` system user, our tests run as the
# invoking user, so only that user's prometheus processes are stopped.
if command -v pgrep >/dev/null 2>&1 && id prometheus >/dev/null 2>&1; then
    for pid in $(pgrep -x -u prometheus prometheus || true); do
        kill "$pid" 2>/dev/null || true
    done
fi

prom=$(command -v prometheus || echo /usr/bin/prometheus)
"$prom" --version 2>&1 | head -n 1
