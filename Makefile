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

# pytest on 3 workers, file by file, in collection order (tests/conftest.py: the slowest
# files first); mypy runs
# beside it, on the cores the ranks' start-up leaves idle, and reports after it
test: $(STAMP)
	$(BIN)/ruff check hybridpar tests examples scripts
	$(BIN)/mypy hybridpar > $(VENV)/mypy.log 2>&1 & mypy=$$!; \
	$(BIN)/python -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder; tests=$$?; \
	wait $$mypy; types=$$?; cat $(VENV)/mypy.log; \
	[ $$tests -eq 0 ] && [ $$types -eq 0 ]

# the long runs of tests/tiers.py (examples, `hybridpar run` end to end, measurements): CI
# runs them after the suite
campaign: $(STAMP)
	$(BIN)/python -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder --tier campaign

lint: $(STAMP)
	$(BIN)/ruff check hybridpar tests examples scripts
	$(BIN)/mypy hybridpar

clean:
	rm -rf $(VENV) build *.egg-info
