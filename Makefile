# One-command set-up: every target makes the virtual environment it needs.
# TORCH picks the torch build; the default is the CPU build that lies on this kind of machine.
# On a GPU machine: make TORCH="torch" test   (or install your CUDA build into .venv first).
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
# pytest-xdist options for the test targets: two tests at a time, each file on one worker (its
# shared pools and fixtures built once) except what carries a group of its own (each documented
# command), the longest groups first (tests/suite_order.py). XDIST= runs them one at a time.
XDIST  ?= -n 2 --dist loadgroup --no-loadscope-reorder

.PHONY: setup train test test-fast test-profile doctor clean

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

# The whole suite (what CI runs).
test: setup
	$(BIN)/python -m pytest -q $(XDIST)

# Where the time goes: CPU-seconds and wall seconds per test file, into test-profile.md (and
# tests/profile.json, the measured order of the groups); see README, Development.
test-profile: setup
	$(BIN)/python -m pytest -q $(XDIST) --profile-out=test-profile.md

# The edit-test loop (under 2 minutes on 2 idle cores): the unit tests and the quick
# multi-process ones (real Gloo process groups: the pool, the runtime, Trainer and TP parity), and
# one parity check of each other layout: ZeRO stages, a pipeline, context and expert parallel, and
# the 2-D compositions (dp x tp, fsdp x tp).
FAST := tests/unit tests/distributed/test_harness.py tests/distributed/test_runtime.py \
        tests/distributed/test_trainer_parity.py tests/distributed/test_tp.py \
        tests/distributed/test_fsdp.py::test_zero_stages_on_2 \
        tests/distributed/test_pipeline.py::test_pp2_explicit_split_points \
        tests/distributed/test_context_expert_parallel.py::test_cp_and_ep_on_2 \
        tests/distributed/test_combos.py::test_dp_tp_and_fsdp_tp_on_4
test-fast: setup
	$(BIN)/python -m pytest -q $(XDIST) $(FAST)

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
