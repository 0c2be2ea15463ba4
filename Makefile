# The two entry points of the README. Both bootstrap the virtualenv first (quick when up to date).
VENV ?= $(or $(RLEP_VENV),.venv)
export RLEP_VENV := $(VENV)

.PHONY: demo test lint bootstrap

bootstrap:
	scripts/bootstrap.sh

demo: bootstrap
	$(VENV)/bin/rlep demo

test: bootstrap
	scripts/system-deps.sh
	$(VENV)/bin/python -m pytest

lint: bootstrap
	$(VENV)/bin/ruff check .
