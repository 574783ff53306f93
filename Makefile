# Two commands do everything on a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is pinned first: this exact version installs the CPU build from local files;
# an unpinned torch would pull a multi-GB CUDA build. The compat extra (Accelerate, Lightning,
# for tests/compat) depends on torch too, so the pin goes on that pip line as well.
TORCH_PIN := torch==2.13.0

.PHONY: demo test test-gpu test-slow test-torch-next dist bench install clean

# uv installs what pip would, several times faster (parallel downloads and unpacking); it is pip-installed
# into the venv itself, so a bare machine needs nothing more. torch comes from the local CPU wheel
# only (--no-index: never a CUDA download); its own dependencies and the rest come with the next line.
# --compile-bytecode: pip writes .pyc files at install and uv does not; where PYTHONDONTWRITEBYTECODE is set
# (as here) every interpreter the suite starts would compile torch again (about 12 s per import).
UV := $(VENV)/bin/uv
WHEELS ?= /opt/wheels

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q uv
	$(UV) pip install -q --compile-bytecode --python $(PY) --no-index --no-deps --find-links $(WHEELS) $(TORCH_PIN)
	$(UV) pip install -q --compile-bytecode --python $(PY) $(TORCH_PIN) -e '.[dev,compat]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/gradsync demo

# Two workers (-n 2): the suite is CPU-bound forked ranks and fresh interpreters, and one worker computes
# while the other waits on a rank's bounded timeout. --dist loadfile: a file runs on one worker, so its
# module fixtures and torch.compile's in-process caches are built once (per test, both workers compiled
# the same graphs: 1468 CPU-s and 12m27 against 1265 CPU-s and 10m38 for the suite).
TEST_WORKERS ?= 2

test: install
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile

# on a machine with CUDA: the GPU tests (skipped elsewhere) and the GPU benchmark
test-gpu: install
	$(PY) -m pytest tests/gpu -rs
	$(VENV)/bin/gradsync bench --device cuda

# minutes-long proofs kept out of `make test` (e.g. a rank pausing 3 minutes between steps)
test-slow: install
	$(PY) -m pytest tests -m slow -s

# The suite on the newest torch of the tested range (README "Install and torch versions"); not in `make test` or CI.
# Its own venv: a CUDA build (~5.5 GB, runs on CPU), pinned on every pip line like TORCH_PIN.
TORCH_NEXT := torch==2.14.1
VENV_NEXT := .venv-torch-next

$(VENV_NEXT)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV_NEXT)
	$(VENV_NEXT)/bin/python -m pip install -q $(TORCH_NEXT)
	$(VENV_NEXT)/bin/python -m pip install -q $(TORCH_NEXT) -e '.[dev,compat]'
	touch $@

test-torch-next: $(VENV_NEXT)/.installed
	$(VENV_NEXT)/bin/python -c "import torch; print('torch', torch.__version__)"
	$(VENV_NEXT)/bin/python -m pytest tests

# sdist and wheel into dist/, checked by twine (--no-isolation: the build env would be downloaded)
dist: install
	rm -rf dist
	$(PY) -m build --no-isolation
	$(VENV)/bin/twine check --strict dist/*

bench: install
	$(VENV)/bin/gradsync bench

clean:
	rm -rf $(VENV) $(VENV_NEXT) build dist src/*.egg-info
