# pgq developer commands. On a fresh machine `make test` creates the
# virtualenv, installs everything and runs the whole suite.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Spark's PostgreSQL JDBC driver (Debian package; Maven Central is not used).
JDBC_JAR ?= /usr/share/java/postgresql.jar

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
	$(BIN)/python -m pip install --quiet -e ".[test,bench,spark]"
	touch $(STAMP)

# The Spark tests need the JDBC driver jar: install Debian's package when it
# is missing (as root), or say what to do.
$(JDBC_JAR):
	@if [ -n "$$PGQ_JDBC_JAR" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && apt-get install -y -qq libpostgresql-jdbc-java >/dev/null; \
	else \
		echo "install the PostgreSQL JDBC driver (apt-get install libpostgresql-jdbc-java)" \
		     "or set PGQ_JDBC_JAR=/path/to/postgresql.jar" >&2; exit 1; \
	fi

install: $(STAMP) $(JDBC_JAR)

test: install
	$(BIN)/python -m pytest

demo: install
	$(BIN)/python -m pgq.demo

bench: install
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
