# Both targets create or reuse .venv; CPU torch is pinned for local installs.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.trainscout-installed
# DeepSpeed ships as a source archive that imports torch to build: install it after torch, into the
# same environment (no build isolation), with its compiled ops left out (they build on first use)
DEEPSPEED := deepspeed==0.19.8

.PHONY: venv demo test test-fast check clean

$(STAMP): pyproject.toml Makefile setup.py src/trainscout/fingerprint/_native.c
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test]"
	DS_BUILD_OPS=0 $(PY) -m pip install -q --no-build-isolation "$(DEEPSPEED)"
	# DeepSpeed compiles its CPU shared-memory collective on the first job; build it once here
	$(PY) -c 'from deepspeed.accelerator import get_accelerator as a; b = a().create_op_builder("ShareMemCommBuilder"); b.load() if b is not None and b.is_compatible() else None'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/trainscout demo --fault hang --rank 2 --step 20

test: $(STAMP)
	$(PY) -m pytest -q tests

# unit tests only (~1 min): the loop while changing code; `make test` before stopping
test-fast: $(STAMP)
	$(PY) -m pytest -q tests/unit

# lint, format and types, as CI runs them before the tests
check: $(STAMP)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/mypy src

clean:
	rm -rf $(VENV) runs .pytest_cache
