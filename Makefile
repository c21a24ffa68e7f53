# `make demo` runs a small simulated multi-node job; `make test` runs the test suite.
# Both install what they need first (torch 2.13.0 CPU from the local wheel cache).
PYTHON ?= python3
STAMP := .install.stamp

.PHONY: install demo test bench

$(STAMP): pyproject.toml
	$(PYTHON) -m pip install --quiet torch==2.13.0
	$(PYTHON) -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PYTHON) examples/demo.py

test: $(STAMP)
	$(PYTHON) -m pytest -q

bench: $(STAMP)
	$(PYTHON) bench/store_ops.py
