# One-command set-up: every target makes the virtual environment it needs.
# TORCH picks the torch build; the default is the CPU build that lies on this kind of machine.
# On a GPU machine: make TORCH="torch" test   (or install your CUDA build into .venv first).
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin

.PHONY: setup train test doctor clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(BIN)/python -m pip install -q --disable-pip-version-check -e ".[dev]"
	touch $@

train: setup
	$(BIN)/shardwise train

doctor: setup
	$(BIN)/shardwise doctor --nproc 2

test: setup
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
