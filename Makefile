# `make demo` runs a small simulated multi-node job; `make test` runs the test suite.
# Both install what they need first (torch 2.13.0 CPU from the local wheel cache, and
# Debian's etcd-server for the etcd rendezvous tests).
PYTHON ?= python3
STAMP := .install.stamp

.PHONY: install etcd demo test bench

SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)

$(STAMP): pyproject.toml
	@command -v etcd >/dev/null || $(MAKE) --no-print-directory etcd
	$(PYTHON) -m pip install --quiet torch==2.13.0
	$(PYTHON) -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

install: $(STAMP)

# a real etcd server for the etcd rendezvous tests (Debian's etcd-server package)
etcd:
	$(SUDO) apt-get install -y -q etcd-server || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q etcd-server; }

demo: $(STAMP)
	$(PYTHON) examples/demo.py

test: $(STAMP)
	$(PYTHON) -m pytest -q

# each benchmark writes its figures under docs/ (docs/benchmarks.md, docs/bench/)
bench: $(STAMP)
	$(PYTHON) -m pip install --quiet -e '.[bench]'
	cd bench && $(PYTHON) store_ops.py && $(PYTHON) launch.py && $(PYTHON) wireup.py \
	    && $(PYTHON) wireup.py --traffic gloo --sizes 16x8 32x8 && $(PYTHON) heartbeat.py \
	    && $(PYTHON) heartbeat.py --idle
