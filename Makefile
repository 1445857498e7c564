# The two set-up commands: `make demo` and `make test`. Both create .venv from scratch when needed.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PLUGINS := models flashinfer cutedsl mhc cp tbo lora
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test lint test-full test-matrix env clean

env: $(STAMP)

$(STAMP): pyproject.toml $(foreach p,$(PLUGINS),plugins/$(p)/pyproject.toml)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]" $(foreach p,$(PLUGINS),-e plugins/$(p))
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/layer-boundary run --model qwen3 --tp 2 --check hf

# The linter, the whole suite with every plugin, then the install matrix: the core alone and
# each plugin alone on top of it (environments are reused between runs; see scripts/test_matrix.py).
test: lint test-full test-matrix

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test-full: $(STAMP)
	LAYER_BOUNDARY_STRICT_PLUGINS=1 $(PY) -m pytest -q

test-matrix: $(STAMP)
	$(PY) scripts/test_matrix.py

clean:
	rm -rf $(VENV) .venv-core .venv-plugin-*
