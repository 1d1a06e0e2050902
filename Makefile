# pgq developer commands. On a fresh machine `make test` creates the
# virtualenv, installs everything and runs the whole suite.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Spark's PostgreSQL JDBC driver (Debian package; Maven Central is not used).
JDBC_JAR ?= /usr/share/java/postgresql.jar

.PHONY: test demo install bench chaos lint clean help

help:
	@echo "make test   - create .venv, install pgq with its test extras, run the suite"
	@echo "make demo   - set up and run the pgq demo (the README's main job)"
	@echo "make bench  - full benchmark run (writes bench/results/)"
	@echo "make chaos  - 10 minutes of faults on a 5-node cluster (writes chaos-results/)"
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

# The chaos test partitions nodes with nftables and skews clocks with
# libfaketime: install Debian's packages when root (without them, or
# without root, those fault kinds are left out and the test says so).
CHAOS_TOOLS := /usr/sbin/nft /usr/bin/faketime
$(CHAOS_TOOLS):
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get install -y -qq nftables faketime >/dev/null 2>&1 || \
		 (apt-get update -qq && apt-get install -y -qq nftables faketime >/dev/null)); \
	else \
		echo "note: without nftables and faketime (apt-get install nftables faketime, as root)" \
		     "the chaos test runs no partitions and no clock faults" >&2; \
	fi

# The dashboard's browser tests drive Debian's chromium headless (Playwright
# with its executable_path: no browser download): install it when root
# (without it, or without root, those tests are skipped and say why).
CHROMIUM := /usr/bin/chromium
$(CHROMIUM):
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get install -y -qq --no-install-recommends chromium fonts-liberation >/dev/null 2>&1 || \
		 (apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium fonts-liberation >/dev/null)); \
	else \
		echo "note: without Debian's chromium (apt-get install chromium, as root)" \
		     "the dashboard's browser tests are skipped" >&2; \
	fi

install: $(STAMP) $(JDBC_JAR) $(CHAOS_TOOLS) $(CHROMIUM)

# The suite runs on two workers (pytest-xdist: most tests wait on servers and
# processes, not on a core), then the tests marked "serial" run alone (they
# saturate the cores, or time a claim). Both parts always run; either failing
# fails the target.
test: install
	$(BIN)/ruff check .
	$(BIN)/python -m mypy pgq
	$(BIN)/python -m pytest -n 2 --dist worksteal -m "not serial"; parallel=$$?; \
	$(BIN)/python -m pytest -m serial; serial=$$?; \
	test $$parallel -eq 0 && test $$serial -eq 0

demo: install
	$(BIN)/python -m pgq.demo

bench: install
	$(BIN)/python -m bench

chaos: install
	$(BIN)/python -m tests.chaos --nodes 5 --minutes 10 --out chaos-results

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

lint: install
	$(BIN)/ruff check .
	$(BIN)/python -m mypy pgq
