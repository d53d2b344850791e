# Both targets create or reuse .venv; CPU torch is pinned for local installs.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.trainscout-installed

.PHONY: venv demo test clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/trainscout demo --fault hang --rank 2 --step 20

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) runs .pytest_cache
