# Two commands a new user needs: `make run` (train the default job) and `make test`.
# Each creates the virtual environment on first use. torch is pinned to the CPU build
# that this project's machines carry; elsewhere install any torch >= the floor in pyproject.toml.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
ARGS ?=

.PHONY: run test bench lint clean venv

venv: $(VENV)/.installed-dev

# `make run` installs what the default job needs (torch, numpy, safetensors); `make test` adds the dev extra
# (pytest, and the optional integrations the suite runs for real: transformers, DeepSpeed, Ray, ...).
$(VENV)/.installed-run: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed-run
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

run: $(VENV)/.installed-run
	$(VENV)/bin/disttrain train $(ARGS)

test: $(VENV)/.installed-dev
	$(PY) -m pytest -q $(ARGS)

bench: $(VENV)/.installed-dev
	$(VENV)/bin/disttrain bench overhead $(ARGS)

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check src tests

clean:
	rm -rf $(VENV) runs .pytest_cache
