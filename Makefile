# Two entry points, each doing all set-up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test campaign lint install clean

$(STAMP): setup.cfg pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	PIP_CONSTRAINT=$(CURDIR)/constraints.txt $(BIN)/python -m pip install -q -e '.[dev,plot,hf,data,log]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/hybridpar run configs/quickstart.toml

# lint and types first (a type error fails in a minute), then pytest on 3 workers, file by
# file, in collection order (tests/conftest.py: the slowest files first). mypy used to run
# beside pytest, but the ranks keep both cores busy (measured: 99% of the suite's time), so it
# only slowed the tests by its own CPU
test: $(STAMP)
	$(BIN)/ruff check hybridpar tests examples scripts
	$(BIN)/mypy hybridpar
	$(BIN)/python -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder

# the long runs of tests/tiers.py (examples, `hybridpar run` end to end, measurements): CI
# runs them after the suite
campaign: $(STAMP)
	$(BIN)/python -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder --tier campaign

lint: $(STAMP)
	$(BIN)/ruff check hybridpar tests examples scripts
	$(BIN)/mypy hybridpar

clean:
	rm -rf $(VENV) build *.egg-info
