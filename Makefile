# `make demo` runs a small simulated multi-node job; `make test` runs the test suite.
# Both install what they need first: the demo torch 2.13.0 CPU (from the local wheel
# cache) and this package; the tests also its test extras, Debian's etcd-server for the
# etcd rendezvous tests, and Debian's Slurm and munge for the Slurm example's test.
PYTHON ?= python3
STAMP := .install.stamp
DEMO_STAMP := .demo.stamp

.PHONY: install etcd slurm demo test bench

SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)

$(STAMP): pyproject.toml
	@command -v etcd >/dev/null || $(MAKE) --no-print-directory etcd
	@command -v slurmd >/dev/null && command -v slurmctld >/dev/null && command -v munged >/dev/null \
	    && command -v sbatch >/dev/null || $(MAKE) --no-print-directory slurm
	$(PYTHON) -m pip install --quiet torch==2.13.0
	$(PYTHON) -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

install: $(STAMP)

$(DEMO_STAMP): pyproject.toml
	$(PYTHON) -m pip install --quiet torch==2.13.0
	$(PYTHON) -m pip install --quiet -e .
	@touch $(DEMO_STAMP)

# a real etcd server for the etcd rendezvous tests (Debian's etcd-server package)
etcd:
	$(SUDO) apt-get install -y -q etcd-server || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q etcd-server; }

# a real Slurm for the Slurm example's test (it starts munged, slurmctld and one slurmd
# per simulated node itself, with their own configuration: nothing is started here)
SLURM_PACKAGES := munge slurmctld slurmd slurm-client
slurm:
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(SLURM_PACKAGES) \
	    || { $(SUDO) apt-get update -q && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(SLURM_PACKAGES); }

demo: $(DEMO_STAMP)
	$(PYTHON) examples/demo.py

# two workers (pytest-xdist): the suite waits on processes and timers more than it
# computes; then, one at a time, the tests that bound round trips under a flood
# (marked solo). `$(PYTHON) -m pytest -q` runs every test one at a time.
test: $(STAMP)
	$(PYTHON) -m pytest -q -n 2 -m "not solo"
	$(PYTHON) -m pytest -q -m solo

# each benchmark writes its figures under docs/ (docs/benchmarks.md, docs/bench/)
bench: $(STAMP)
	$(PYTHON) -m pip install --quiet -e '.[bench]'
	cd bench && $(PYTHON) store_ops.py && $(PYTHON) launch.py && $(PYTHON) wireup.py \
	    && $(PYTHON) wireup.py --traffic gloo --sizes 16x8 32x8 && $(PYTHON) heartbeat.py \
	    && $(PYTHON) heartbeat.py --idle
