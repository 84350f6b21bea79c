# Distributed PyTorch, Hands-On: two commands.
#   make course   run every lab, execute every lesson, build the site, print a summary
#   make test     the full test suite (what CI runs)
#   make gpu-check  everything that needs CUDA, on the GPUs present (exits 1 without one)
#
# Environment: the active one if any (a venv, or conda from environment.yml), else ./.venv,
# created on first use. Dependencies: pyproject.toml's groups say who needs what (course: the
# "site" group, test: the "test" group); requirements.lock pins the whole environment CI runs
# (torch 2.13.0, its CPU wheel). To keep your own torch build (a CUDA one on a GPU box), install
# the groups' ranges instead of the lock:
#   make test LOCK=
SHELL := /bin/bash
BOOTSTRAP_PYTHON ?= python3
LOCK ?= requirements.lock

ifdef VIRTUAL_ENV
  PY := $(VIRTUAL_ENV)/bin/python
else ifdef CONDA_PREFIX
  PY := $(CONDA_PREFIX)/bin/python
else
  PY := .venv/bin/python
endif

PIP := $(PY) -m pip --disable-pip-version-check
comma := ,
# The dependency group each command installs (pyproject.toml); `deps` runs with its caller's.
course site: GROUP := site
test: GROUP := test
GROUP ?= test

.PHONY: course test deps test-tools site clean gpu-check lean lock

course: deps
	$(PY) tools/course.py

# COURSE_LOCK tells tests/test_environment.py which pins the environment should hold.
test: deps test-tools
	COURSE_LOCK=$(LOCK) $(PY) -m pytest

# pip reads pyproject.toml's dependency groups (PEP 735) from 25.1 on: older pips upgrade first.
deps:
	@if [ ! -x "$(PY)" ]; then \
		echo ">> creating .venv with $(BOOTSTRAP_PYTHON)"; \
		$(BOOTSTRAP_PYTHON) -m venv .venv; \
	fi
	@echo ">> installing the $(GROUP) group$(if $(LOCK),$(comma) as $(LOCK) pins it$(comma)) into $$($(PY) -c 'import sys; print(sys.prefix)')"
	@$(PIP) install --quiet 'pip>=25.1'
	@$(PIP) install --quiet --group $(GROUP) $(if $(LOCK),-c $(LOCK))

# Two system tools the tests use: a real headless Chromium (site tests) and shellcheck (the
# SLURM recipe). Debian/Ubuntu: installed here if missing (needs root or sudo). Elsewhere:
# install them yourself (set COURSE_CHROMIUM=/path/to/chromium if it is not on PATH).
test-tools:
	@missing=""; \
	[ -n "$$COURSE_CHROMIUM" ] || command -v chromium >/dev/null || missing="chromium"; \
	command -v shellcheck >/dev/null || missing="$$missing shellcheck"; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if command -v apt-get >/dev/null; then \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		echo ">> installing$$missing (apt-get)"; \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	else \
		echo ">> missing:$$missing; the tests that need them will fail and say so"; \
	fi

# Everything that needs CUDA, on the GPUs this machine has, in about 10 minutes on one GPU:
# every lab on NCCL (its GPU defaults, then fp32 parity), the tests marked gpu, and lab02 at
# the largest preset that fits. Appends to verified/gpu-check.jsonl (commit it). No `deps`:
# requirements.lock pins the CPU torch, and a GPU box keeps its own CUDA build. Without a GPU
# it prints one line and exits 1.
gpu-check:
	$(PY) tools/gpu_check.py

site: deps
	$(PY) tools/build_site.py

clean:
	rm -rf build site .pytest_cache

# Maintainers: re-pin requirements.lock after a change to pyproject.toml's groups (uv is in the
# test group; a test checks the lock is what this makes). uv keeps every pin the lock already has unless the change needs another;
# add --upgrade to move everything. CI's torch is the CPU wheel of torch 2.13.0, which PyPI does
# not carry: uv finds it on PyTorch's CPU index, or in a local folder of wheels:
#   make lock TORCH_WHEELS=/opt/wheels
TORCH_WHEELS ?= https://download.pytorch.org/whl/cpu/torch/
LOCK_OUT ?= requirements.lock
lock:
	$(PY) -m uv pip compile --quiet --group pyproject.toml:test --python-version 3.11 \
		--find-links $(TORCH_WHEELS) --custom-compile-command "make lock" -o $(LOCK_OUT)
