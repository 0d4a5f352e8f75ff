# Two entry points: `make run` (set up, probe the examples, serve them) and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of this release installs quickly here; on a CUDA machine pip picks the CUDA build.
TORCH_VERSION ?= 2.13.0
RUN_BUDGET ?= 64MiB
RUN_DIR ?= var/run
PORT ?= 8765

.PHONY: install system-deps run test lint typecheck bench clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==$(TORCH_VERSION)
	$(PIP) install --quiet -e '.[server,dev,fleet,hf,lightning]'
	touch $@

install: $(VENV)/.installed

# Debian's chromium for the browser tests (Playwright's own browser download cannot work here).
system-deps:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

run: install
	bash scripts/run.sh

test: install system-deps
	$(PY) -m ruff check autotune server client tests bench examples
	$(PY) -m mypy
	$(PY) -m pytest

bench: install
	$(PY) bench/search_table.py

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache
