#!/usr/bin/env bash
# setup_venv.sh VENV_DIR -- CPU-only virtualenv for SGLang 0.5.23 prefill/decode disaggregation
# with kvconnect as its transfer backend. Idempotent: a re-run only fills in what is missing.
# Everything comes from pip except:
#   * torch==2.13.0+cpu: not on PyPI; pip finds it through TORCH_INDEX (the CPU index), its own
#     find-links, or TORCH_WHEEL=/path/to/torch-2.13.0+cpu-...whl;
#   * ./cpu_shim (sgl_kernel stub, torchvision guard, sglang.srt.plugins hook), shipped beside this file;
#   * kvconnect itself, installed editable from this checkout with its nixl and mooncake-cpu extras.
set -euo pipefail

VENV=${1:?usage: setup_venv.sh VENV_DIR}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PYTHON=${PYTHON:-python3}
TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
T0=$(date +%s)
say() { printf '[sglang venv %3ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }

SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0+cpu
TORCHVISION_VERSION=0.28.0

if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
fi
VENV=$(cd "$VENV" && pwd)
PY="$VENV/bin/python"
pip_() { "$PY" -m pip --disable-pip-version-check "$@"; }
have() { "$PY" -c 'import sys; from importlib.metadata import version as v; sys.exit(v(sys.argv[1]) != sys.argv[2])' "$@" 2>/dev/null; }

have torch "$TORCH_VERSION" || pip_ install -q --retries 1 --no-deps --extra-index-url "$TORCH_INDEX" "${TORCH_WHEEL:-torch==$TORCH_VERSION}"
say "pinned dependencies (requirements-cpu.lock, --no-deps)"
pip_ install -q --no-deps -r "$HERE/requirements-cpu.lock"
# torchvision's PyPI build is a CUDA build: imported by SGLang, guarded by the shim's .pth.
have torchvision "$TORCHVISION_VERSION" || pip_ install -q --no-deps "torchvision==$TORCHVISION_VERSION"
have sglang "$SGLANG_VERSION" || pip_ install -q --no-deps "sglang==$SGLANG_VERSION"

say "cpu shim (sgl_kernel stub, torchvision guard, plugin)"
pip_ install -q 'setuptools>=70.1'
BUILD=$(mktemp -d /tmp/sglang-cpu-shim.XXXXXX)
trap 'rm -rf "$BUILD"' EXIT
cp -r "$HERE/cpu_shim/." "$BUILD/"
pip_ install -q --no-deps --no-build-isolation --force-reinstall "$BUILD"
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import sglang_cpu_shim" > "$SITE/sglang_cpu_shim.pth"

say "kvconnect (editable, extras nixl and mooncake-cpu)"
pip_ install -q --no-build-isolation -e "$ROOT[nixl,mooncake-cpu]"

say "verifying imports"
# From / : a stale kvconnect.egg-info in the checkout would hide the installed entry points.
(cd / && SGLANG_USE_CPU_ENGINE=1 "$PY" - <<'PYEOF'
import warnings; warnings.filterwarnings("ignore")
from importlib.metadata import version, entry_points
import torch, torchvision, sgl_kernel, mooncake.engine, nixl, sglang_router, kvconnect
import sglang.srt.entrypoints.http_server, sglang.launch_server
eps = sorted(e.name for e in entry_points(group="sglang.srt.plugins"))
print("torch", torch.__version__, "| sglang", version("sglang"), "| sglang-router", version("sglang-router"),
      "| mooncake", version("mooncake-transfer-engine-non-cuda"), "| nixl", version("nixl"),
      "| numpy", version("numpy"), "| plugins", eps)
assert {"cpu_shim", "kvconnect"} <= set(eps), f"SGLang plugins missing: {eps}"
PYEOF
)
say "done: $VENV"
