# Two entry points: `make demo` and `make test`. Each installs what it needs first.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install system-packages demo test

# Real human speech with transcripts (LibriVox clips) for tests and the demo.
system-packages:
	@if [ ! -d /usr/share/pocketsphinx/test/data ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pocketsphinx-testdata; \
	fi

# torch is pinned first so pip takes the CPU wheel that lies on these machines instead of a CUDA build.
install: system-packages
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev,models]'

demo: install
	$(PYTHON) -m tarq_deploy.cli demo

test: install
	$(PYTHON) -m pytest -q
