# pgq developer commands. On a fresh machine `make test` creates the
# virtualenv, installs everything and runs the whole suite.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: test demo install bench lint clean help

help:
	@echo "make test   - create .venv, install pgq with its test extras, run the suite"
	@echo "make demo   - set up and run the pgq demo (the README's main job)"
	@echo "make bench  - full benchmark run (writes bench/results/)"
	@echo "make clean  - remove the virtualenv and caches"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test,bench]"
	touch $(STAMP)

install: $(STAMP)

test: install
	$(BIN)/python -m pytest

demo: install
	$(BIN)/python -m pgq.demo

bench: install
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
