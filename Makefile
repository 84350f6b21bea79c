# Distributed PyTorch, Hands-On: two commands.
#   make course   run every lab, execute every lesson, build the site, print a summary
#   make test     the full test suite (what CI runs)
#   make gpu-check  everything that needs CUDA, on the GPUs present (exits 1 without one)
#
# Environment: the active one if any (a venv, or conda from environment.yml), else ./.venv,
# created on first use. Versions: requirements.txt gives the supported ranges; constraints.txt
# pins what CI runs (torch 2.13.0 CPU). On a GPU machine keep your own torch build with
#   make test CONSTRAINTS=
SHELL := /bin/bash
BOOTSTRAP_PYTHON ?= python3
CONSTRAINTS ?= constraints.txt

ifdef VIRTUAL_ENV
  PY := $(VIRTUAL_ENV)/bin/python
else ifdef CONDA_PREFIX
  PY := $(CONDA_PREFIX)/bin/python
else
  PY := .venv/bin/python
endif

PIP_CONSTRAINTS := $(if $(CONSTRAINTS),-c $(CONSTRAINTS))

.PHONY: course test deps test-tools site clean gpu-check lean

course: deps
	$(PY) tools/course.py

test: deps test-tools
	$(PY) -m pytest

deps:
	@if [ ! -x "$(PY)" ]; then \
		echo ">> creating .venv with $(BOOTSTRAP_PYTHON)"; \
		$(BOOTSTRAP_PYTHON) -m venv .venv; \
	fi
	@echo ">> installing requirements into $$($(PY) -c 'import sys; print(sys.prefix)')"
	@$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt $(PIP_CONSTRAINTS)

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
# constraints.txt pins the CPU torch, and a GPU box keeps its own CUDA build. Without a GPU
# it prints one line and exits 1.
gpu-check:
	$(PY) tools/gpu_check.py

site: deps
	$(PY) tools/build_site.py

clean:
	rm -rf build site .pytest_cache
