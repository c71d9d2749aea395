#!/usr/bin/env bash
# The P/D conformance suite (tests/test_pd_conformance.py) with CUDA caches, registered as VRAM.
#
#   integration/gpu/run_pd_gpu.sh [--backend nixl|mooncake|all] [--mode one-gpu|two-gpu|two-node]
#       [--producer-node HOST --producer-addr IP --consumer-addr IP] [--remote-python PATH]
#       [--select EXPR] [--python PATH] [-- PYTEST_ARGS...]
#
# --select EXPR narrows the backend's tests (pytest -k "BACKEND and (EXPR)"), e.g. --select dense.
#
# Modes:
#   one-gpu   producer and consumer processes both on cuda:0 of this node (the default)
#   two-gpu   producer on cuda:0, consumer on cuda:1 of this node
#   two-node  consumer (this pytest) here on cuda:0, producer on cuda:0 of --producer-node, launched
#             over `ssh -o BatchMode=yes`; this checkout must be at the same path there, with its
#             .venv (or pass --remote-python). --producer-addr / --consumer-addr are the addresses
#             each node is reached on (side channel, control connection, Mooncake engine).
#
# NIXL runs with UCX's defaults (nothing forced: cuda_ipc on one node, RDMA or tcp across nodes);
# the kill test alone holds UCX to tcp,cuda_copy, so that the pull is still running when it kills.
# Mooncake needs the CUDA build (`pip install 'kvconnect[mooncake]'`; `mooncake-cpu` cannot register
# VRAM). A random KVCONNECT_SECRET is set unless one is given.
#
# Exit status: pytest's; 0 with "skipped: no CUDA device" where torch sees no GPU; 2 for bad usage or
# a host that cannot run the mode asked for.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/../.." && pwd)"
PY="$REPO/.venv/bin/python"
BACKEND=nixl
MODE=""
PRODUCER_NODE=""
PRODUCER_ADDR=""
CONSUMER_ADDR=""
REMOTE_PY=""
EXTRA_SELECT=""

die() { echo "run_pd_gpu: $*" >&2; exit 2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --backend) BACKEND="${2:?}"; shift 2 ;;
    --mode) MODE="${2:?}"; shift 2 ;;
    --producer-node) PRODUCER_NODE="${2:?}"; shift 2 ;;
    --producer-addr) PRODUCER_ADDR="${2:?}"; shift 2 ;;
    --consumer-addr) CONSUMER_ADDR="${2:?}"; shift 2 ;;
    --remote-python) REMOTE_PY="${2:?}"; shift 2 ;;
    --python) PY="${2:?}"; shift 2 ;;
    --select) EXTRA_SELECT="${2:?}"; shift 2 ;;
    -h|--help) sed -n '2,24p' "$0" | sed -e 's/^#//' -e 's/^ //'; exit 0 ;;
    --) shift; break ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done
[ -n "$MODE" ] || { [ -n "$PRODUCER_NODE" ] && MODE=two-node || MODE=one-gpu; }
case "$BACKEND" in
  nixl|mooncake) SELECT="$BACKEND" ;;
  all) SELECT="nixl or mooncake" ;;
  *) die "--backend must be nixl, mooncake or all, not $BACKEND" ;;
esac
[ -z "$EXTRA_SELECT" ] || SELECT="($SELECT) and ($EXTRA_SELECT)"
case "$MODE" in
  one-gpu|two-gpu) ;;
  two-node)
    [ -n "$PRODUCER_NODE" ] && [ -n "$PRODUCER_ADDR" ] && [ -n "$CONSUMER_ADDR" ] \
      || die "mode two-node needs --producer-node, --producer-addr and --consumer-addr" ;;
  *) die "--mode must be one-gpu, two-gpu or two-node, not $MODE" ;;
esac
[ -x "$PY" ] || die "no Python at $PY (run \`make venv\` with a CUDA torch, or pass --python)"

# How many GPUs torch sees here; "none" when CUDA is unavailable (a CPU build, no driver, no device).
GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else "none")')" \
  || die "cannot import torch with $PY"
if [ "$GPUS" = none ]; then
  echo "skipped: no CUDA device (torch.cuda.is_available() is False with $PY)"
  exit 0
fi

unset KVCONNECT_TEST_PRODUCER_LAUNCH KVCONNECT_TEST_PRODUCER_PYTHON KVCONNECT_TEST_PRODUCER_HOST \
      KVCONNECT_TEST_CONSUMER_HOST KVCONNECT_TEST_DEVICE KVCONNECT_TEST_PRODUCER_DEVICE
export KVCONNECT_SECRET="${KVCONNECT_SECRET:-$("$PY" -c 'import secrets; print(secrets.token_hex(32))')}"

case "$MODE" in
  one-gpu)
    export KVCONNECT_TEST_DEVICE=cuda:0 KVCONNECT_TEST_PRODUCER_DEVICE=cuda:0 ;;
  two-gpu)
    [ "$GPUS" -ge 2 ] || die "mode two-gpu needs 2 CUDA devices, torch sees $GPUS"
    export KVCONNECT_TEST_DEVICE=cuda:1 KVCONNECT_TEST_PRODUCER_DEVICE=cuda:0 ;;
  two-node)
    REMOTE_PY="${REMOTE_PY:-$REPO/.venv/bin/python}"
    SSH=(ssh -o BatchMode=yes -o ConnectTimeout=15)
    # Checked here so that a wrong node, path or interpreter fails with its own message, not as a
    # producer that never connects back.
    timeout 120 "${SSH[@]}" "$PRODUCER_NODE" "cd '$REPO' && '$REMOTE_PY' -c 'import kvconnect, torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)'" \
      || die "$PRODUCER_NODE cannot run the producer: needs this checkout at $REPO and $REMOTE_PY with kvconnect and a CUDA torch"
    export KVCONNECT_TEST_PRODUCER_LAUNCH="ssh -o BatchMode=yes $PRODUCER_NODE cd $REPO &&"
    export KVCONNECT_TEST_PRODUCER_PYTHON="$REMOTE_PY"
    export KVCONNECT_TEST_PRODUCER_HOST="$PRODUCER_ADDR" KVCONNECT_TEST_CONSUMER_HOST="$CONSUMER_ADDR"
    export KVCONNECT_TEST_DEVICE=cuda:0 KVCONNECT_TEST_PRODUCER_DEVICE=cuda:0 ;;
esac

if [ "$BACKEND" != nixl ]; then
  "$PY" -c 'import sys, mooncake.engine as m; sys.exit(0 if m.SUPPORT_CUDA else 3)' 2>/dev/null \
    || die "Mooncake here is not the CUDA build: install kvconnect[mooncake] (mooncake-transfer-engine), not mooncake-cpu"
fi

echo "run_pd_gpu: mode $MODE, backend $BACKEND, $GPUS GPU(s) here; consumer ${KVCONNECT_TEST_DEVICE}," \
     "producer ${KVCONNECT_TEST_PRODUCER_DEVICE}${PRODUCER_NODE:+ on $PRODUCER_NODE}"
cd "$REPO"
exec "$PY" -m pytest -q -p no:cacheprovider tests/test_pd_conformance.py -k "$SELECT" "$@"
