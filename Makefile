# gpuwatchd: `make demo` runs the daemon with a real training job; `make test` runs the tests.
# Both create .venv and install what they need; nothing has to be installed by hand.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
# A bare `torch` pulls a multi-GB CUDA build; pin the CPU build first so the
# `torch>=2.1` of the extras is already satisfied.
TORCH  ?= torch==2.13.0

.PHONY: demo test durations test-long lint typecheck bench check clean postgres tmux prometheus redis slurm man \
	gpu-check gpu-wheels

$(VENV)/.stamp: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install "$(TORCH)"
	# compat: a plain path in a .pth; the default finder .pth imports pathlib and more at
	# every start of this python (~15 ms CPU of each gpuwatchctl, docs/benchmarks.md).
	# setuptools calls compat transitional: where a later one refuses it, the default mode.
	$(PIP) install -e ".[torch,demo,dev]" --config-settings editable_mode=compat \
	  || $(PIP) install -e ".[torch,demo,dev]"
	touch $@

demo: $(VENV)/.stamp
	$(PY) examples/demo.py

# Debian's PostgreSQL server binaries: tests/test_study_postgres.py starts a private
# cluster with them (installed once, as root; a no-op when present).
postgres:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	      apt-get install -y -qq --no-install-recommends postgresql; \
	  else echo "the tests need PostgreSQL: sudo apt-get install postgresql" >&2; exit 1; fi; }

# Debian's tmux: tests/test_top.py runs `gpuwatchctl top` in a real terminal (a no-op when present).
tmux:
	@command -v tmux >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	      apt-get install -y -qq --no-install-recommends tmux; \
	  else echo "the tests need tmux: sudo apt-get install tmux" >&2; exit 1; fi; }

# $(call apt_install,PACKAGE,WHAT): as root, apt-get install Debian's PACKAGE with a
# policy-rc.d refusal that keeps the package's own service from starting during the
# install (prometheus would listen on 0.0.0.0:9090); else say that the tests need WHAT.
define apt_install
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    created=; if [ ! -e /usr/sbin/policy-rc.d ]; then \
	      printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && created=1; fi; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	      apt-get install -y -qq --no-install-recommends $(1); status=$$?; \
	    [ -n "$$created" ] && rm -f /usr/sbin/policy-rc.d; exit $$status; \
	  else echo "the tests need $(2): sudo apt-get install $(1)" >&2; exit 1; fi
endef

# Debian's prometheus and promtool: tests/test_metrics.py starts a private Prometheus on
# 127.0.0.1 and runs promtool (a no-op when present).
prometheus:
	@command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 || { \
	$(call apt_install,prometheus,prometheus and promtool); }

# Debian's redis-server: tests/test_study_journal.py starts a private one on 127.0.0.1 for
# Optuna's JournalRedisBackend (a no-op when present).
redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	$(call apt_install,redis-server,redis-server); }

# Debian's Slurm (slurmctld, slurmd, the clients) and munge: tests/slurm.py starts a private
# single-node cluster on 127.0.0.1 (a no-op when present; the packages' services are kept
# from starting).
slurm:
	@command -v slurmctld >/dev/null 2>&1 && command -v slurmd >/dev/null 2>&1 && \
	  command -v scontrol >/dev/null 2>&1 && command -v munged >/dev/null 2>&1 || { \
	$(call apt_install,slurmctld slurmd slurm-client munge,Slurm and munge); }

# Man pages generated from the argparse parsers (tests/test_cli_scripting.py checks they are current).
MANPAGE := COLUMNS=80 $(VENV)/bin/argparse-manpage --project-name gpuwatchd --version 0.1.0 \
	--manual-title "gpuwatchd manual" --function build_parser
man: $(VENV)/.stamp
	$(MANPAGE) --module gpuwatchd.cli.main --prog gpuwatchd --output man/gpuwatchd.1 \
	  --description "watch NVIDIA GPUs and the host, fix GPU-hour-wasting patterns"
	$(MANPAGE) --module gpuwatchd.cli.ctl --prog gpuwatchctl --output man/gpuwatchctl.1 \
	  --description "the client of gpuwatchd's control socket"

# The project's own bytecode first: the tests start hundreds of Python processes (daemons,
# workers, clients), and where PYTHONDONTWRITEBYTECODE is set each would compile it again.
PYTEST_N2 := $(PY) -m pytest -q -m "not long" -n 2 --dist loadfile --no-loadscope-reorder
test: $(VENV)/.stamp postgres tmux prometheus redis slurm
	$(PY) -m compileall -q gpuwatchd tests examples bench
	$(PYTEST_N2)

# tests/module_seconds.json: each test module's seconds in a whole run, the order in which
# `make test` hands modules to its workers (the longest first, tests/module_order.py).
durations: $(VENV)/.stamp postgres tmux prometheus redis slurm
	$(PYTEST_N2) --store-module-seconds tests/module_seconds.json

# make test runs on both cores (pytest-xdist, one test module per worker, the longest modules
# first; the systemd tests take a machine-wide lock, tests/systemd_ns.py).
# Issue 20's kill-chaos tests (tests/test_chaos_kill.py and its systemd variant in
# tests/test_systemd_service.py) once per seed, 1..10 in a row in one pytest run; `make test`
# runs seed 1 only, on a smaller study (kill points scaled, both kills kept: see
# hpo_env.chaos_size). A failure names its seed: replay it with GPUWATCHD_CHAOS_SEED=N
# (full size).
# Then the soaks marked `long` (tests/test_chaos.py), which `make test` leaves out.
CHAOS_SEEDS ?= 1-10
test-long: $(VENV)/.stamp
	GPUWATCHD_CHAOS_SEED=$(CHAOS_SEEDS) $(PY) -m pytest -q -m chaos --durations=30 \
	  tests/test_chaos_kill.py tests/test_systemd_service.py
	$(PY) -m pytest -q -m long --durations=10 tests

lint: $(VENV)/.stamp
	$(VENV)/bin/ruff check gpuwatchd tests bench examples setup.py

typecheck: $(VENV)/.stamp
	$(VENV)/bin/mypy gpuwatchd

check: lint typecheck test

bench: $(VENV)/.stamp
	$(PY) bench/tick.py

# The GPU battery (issue 22; bench/gpu_check.py, docs/gpu-check.md): gpuwatchd against a real
# NVIDIA GPU, its report and recordings in $(GPU_OUT)/. Without a GPU it says so, runs its
# CPU-side parts and exits 2. On a GPU machine without network, name the interpreter that has
# CUDA PyTorch: `make gpu-check GPU_PYTHON=python3`; the wheels `make gpu-wheels` put in .whl/
# here are installed for it under /tmp/gpuwatchd-site first (nothing else is installed).
GPU_OUT ?= gpu-check
GPU_BUDGET_S ?= 420
GPU_SITE := /tmp/gpuwatchd-site
ifdef GPU_PYTHON
gpu-check:
	@if [ -d .whl ]; then $(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile \
	  --no-cache-dir --upgrade --target $(GPU_SITE) .whl/*.whl; fi
	PYTHONPATH=$(GPU_SITE):$(CURDIR) $(GPU_PYTHON) bench/gpu_check.py --out $(GPU_OUT) \
	  --budget-s $(GPU_BUDGET_S)
else
gpu-check: $(VENV)/.stamp
	$(PY) bench/gpu_check.py --out $(GPU_OUT) --budget-s $(GPU_BUDGET_S)
endif

# Wheels for a GPU machine's Python 3.12 (manylinux x86-64) of what gpuwatchd and the battery
# need beyond what NVIDIA's CUDA images hold (PyTorch, numpy, psutil, PyYAML, rich,
# prometheus-client, nvidia-ml-py): the versions this venv has.
GPU_WHEELS := alembic apprise APScheduler colorlog Mako oauthlib optuna requests-oauthlib \
	shtab SQLAlchemy structlog tzlocal
gpu-wheels: $(VENV)/.stamp
	mkdir -p .whl
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp $(foreach n,17 24 27 28 31 34,--platform manylinux_2_$(n)_x86_64) \
	  --platform manylinux2014_x86_64 -d .whl \
	  $$(for n in $(GPU_WHEELS); do $(PY) -m pip show $$n 2>/dev/null | \
	     awk -v n=$$n '/^Version:/ {print n "==" $$2}'; done)
	$(PY) -m pip wheel -q --no-deps -w .whl \
	  "sdnotify==$$($(PY) -m pip show sdnotify | awk '/^Version:/ {print $$2}')"

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
