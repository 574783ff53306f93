# Two commands do everything on a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is pinned first: this exact version installs the CPU build from local files;
# an unpinned torch would pull a multi-GB CUDA build. The compat extra (Accelerate, Lightning,
# for tests/compat) depends on torch too, so the pin goes on that pip line as well.
TORCH_PIN := torch==2.13.0

.PHONY: demo test test-slow bench install clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q $(TORCH_PIN) -e '.[dev,compat]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/gradsync demo

test: install
	$(PY) -m pytest tests

# minutes-long proofs kept out of `make test` (e.g. a rank pausing 3 minutes between steps)
test-slow: install
	$(PY) -m pytest tests -m slow -s

bench: install
	$(VENV)/bin/gradsync bench

clean:
	rm -rf $(VENV) build src/*.egg-info
