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

.PHONY: install system-deps run test test-fast test-latest slow-list lint typecheck bench clean

$(VENV)/.installed: pyproject.toml Makefile constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==$(TORCH_VERSION)
	$(PIP) install --quiet -c constraints.txt -e '.[server,dev,fleet,hf,lightning]'
	touch $@

install: $(VENV)/.installed

# The CUDA build of torch for emulated-card fake trials (autotune.emulation) on hosts without a GPU. pip's
# configuration here puts a local CPU wheel first (find-links; 2.13.0+cpu sorts above 2.13.0), so this
# install reads no configuration file; the project goes in editable, without its torch extras.
CUDA_VENV := .venv-cuda
CUDA_PIP := PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= $(CUDA_VENV)/bin/python -m pip
$(CUDA_VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(CUDA_VENV)
	$(CUDA_PIP) install --quiet torch==$(TORCH_VERSION) numpy
	$(CUDA_VENV)/bin/python -c 'import sys, torch; sys.exit(torch.version.cuda is None)'
	$(CUDA_PIP) install --quiet -c constraints.txt -e . 'transformers>=5,<6' 'peft>=0.13' 'bitsandbytes>=0.45' 'torchao>=0.10'
	touch $@

# Debian's chromium for the browser tests (Playwright's own browser download cannot work here).
system-deps:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

run: install
	bash scripts/run.sh

# Two workers, a test file each at a time (module fixtures are built once): 16 min where one took 23.
TEST_WORKERS ?= 2
# The layering and public-API checks: seconds, run first so that an arrow up fails before the long suite starts.
FIRST_TESTS := tests/autotune/test_public_api.py tests/client/test_client_public_api.py \
	tests/client/test_integrations_public_api.py

test: install system-deps $(CUDA_VENV)/.installed
	$(PY) -m pytest -q -x -p no:cacheprovider $(FIRST_TESTS)
	$(PY) -m ruff check autotune server client tests bench examples
	$(PY) -m mypy
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=40 --junitxml=var/junit.xml

# The inner loop, under 3 minutes: the suite without the real-process truths, the emulated cards and the tests
# over 3 s in the last whole run (tests/conftest.py marks them from tests/slow_tests.txt); make test stays the
# whole suite and what CI runs.
test-fast: install
	$(PY) -m pytest -q -x -p no:cacheprovider $(FIRST_TESTS)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -q -m "not processes and not card and not slow" --durations=10

# tests/slow_tests.txt again, from the last make test's var/junit.xml.
slow-list:
	$(PY) scripts/slow_tests.py var/junit.xml

# The newest releases of the libraries constraints.txt pins (torch stays TORCH_VERSION), in a venv of their own:
# run it by hand to see whether a release still passes before moving a pin (docs/benchmarks.md, "Testing").
LATEST_VENV := .venv-latest
$(LATEST_VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LATEST_VENV)/bin/python -m pip install --quiet --upgrade --upgrade-strategy eager \
		torch==$(TORCH_VERSION) -e '.[server,dev,fleet,hf,lightning]'
	$(LATEST_VENV)/bin/python -m pip list --format=freeze > $(LATEST_VENV)/versions.txt
	touch $@

test-latest: system-deps $(CUDA_VENV)/.installed $(LATEST_VENV)/.installed
	@grep -iE '^(transformers|accelerate|peft|bitsandbytes|torchao)==' $(LATEST_VENV)/versions.txt
	$(LATEST_VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=20

bench: install
	$(PY) bench/search_table.py

clean:
	rm -rf $(VENV) $(CUDA_VENV) $(LATEST_VENV) var .pytest_cache .mypy_cache .ruff_cache
