# Two entry points: `make demo` and `make test`. Each installs what it needs first.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install demo test

# torch is pinned first so pip takes the CPU wheel that lies on these machines instead of a CUDA build.
install:
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev,models]'

demo: install
	$(PYTHON) -m tarq_deploy.cli demo

test: install
	$(PYTHON) -m pytest -q
