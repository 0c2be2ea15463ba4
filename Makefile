# The two entry points of the README. Both bootstrap the virtualenv first (quick when up to date).
VENV ?= $(or $(RLEP_VENV),.venv)
export RLEP_VENV := $(VENV)

.PHONY: demo test lint bootstrap gpu-wheels

bootstrap:
	scripts/bootstrap.sh

demo: bootstrap
	$(VENV)/bin/rlep demo

# Two pytest workers: most of the suite waits on servers and engines starting, so two files at a time fit on 2 cores
# (1,538 s serial, 1,078 s with two on the same machine). A whole file goes to one worker (--dist loadfile): a
# module's shared stack (vLLM replicas, a learner) is started once, as in a serial run. Files go out longest first
# (tests/conftest.py's LONGEST_FILES_FIRST): xdist's own order (most tests first) sent the one-test 180 s
# `test_newcomer_path` out last, to run alone at the end; --no-loadscope-reorder keeps ours.
TEST_WORKERS ?= 2

test: bootstrap
	scripts/system-deps.sh
	$(VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

lint: bootstrap
	$(VENV)/bin/ruff check .

# Wheels for scripts/gpu-check.sh on a GPU machine without network (docs/gpu.md): what it lacks, for its Python.
GPU_PYTHON ?= 3.12

gpu-wheels: bootstrap
	scripts/gpu-wheels.sh --python-version $(GPU_PYTHON) gpu-wheels
