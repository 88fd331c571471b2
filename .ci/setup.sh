#!/usr/bin/env bash
# Everything the tests need on a fresh machine: the pinned CPU torch first (so that no
# package can make pip resolve a bare `torch` to a multi-GB CUDA build), then the project
# with its test extras, then Debian's prometheus for the end-to-end metrics test.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
python -m pip install -q torch==2.13.0
python -m pip install -q -e '.[test,torch]'
bash .ci/install-prometheus.sh
