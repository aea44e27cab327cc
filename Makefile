# Two commands a new user needs: `make run` (train the default job) and `make test`.
# Each creates the virtual environment on first use. torch is pinned to the CPU build
# that this project's machines carry; elsewhere install any torch >= the floor in pyproject.toml.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
ARGS ?=

.PHONY: run test bench lint clean venv

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

run: venv
	$(VENV)/bin/disttrain train $(ARGS)

test: venv
	$(PY) -m pytest -q $(ARGS)

bench: venv
	$(VENV)/bin/disttrain bench overhead $(ARGS)

lint: venv
	$(VENV)/bin/ruff check src tests

clean:
	rm -rf $(VENV) runs .pytest_cache
