# Two entry points: `make demo` and `make test`. Each installs what it needs first, into the project's own virtual
# environment (.venv), from this repository's files alone: nothing installed by hand elsewhere on the machine is seen.
VENV ?= .venv
PYTHON := $(VENV)/bin/python
PIP := $(PYTHON) -m pip

.PHONY: install system-packages venv demo test clean-venv peers-venv

# Debian packages: real human speech with transcripts (LibriVox clips, pocketsphinx-testdata), and the offline
# rare-word speech corpus: festival + the CMU ARCTIC SLT HTS voice (calibration, dev) and the KAL diphone voice
# (held-out test voice), public-domain text (World English Bible, the Devil's Dictionary) and WordNet examples;
# espeak-ng speaks the German clip of the language tests (tests/test_corpus_sources.py).
APT_PACKAGES := pocketsphinx-testdata festival festvox-us-slt-hts festvox-kallpc16k sword-text-web wordnet-base dict-devil espeak-ng

system-packages:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

# A plain venv (no system site-packages): the test run proves that the project's own files install everything.
$(PYTHON):
	python3 -m venv $(VENV)

venv: $(PYTHON)

# torch is pinned first so pip takes the CPU wheel that lies on these machines instead of a CUDA build. pip byte-
# compiles what it installs one file at a time (52 s of a 101 s install from nothing, 2-core Intel Xeon); compiled
# afterwards on every core it takes 27 s. The bytecode must exist: these machines set PYTHONDONTWRITEBYTECODE, so a
# module without it is compiled again by every process that imports it. A file that does not compile under this
# Python (torch ships one written for 3.12) is left as pip leaves it.
install: system-packages venv
	$(PIP) install --quiet --no-compile torch==2.13.0
	$(PIP) install --quiet --no-compile -e '.[dev,models,sweep]'
	$(PYTHON) -c "import compileall, sysconfig; compileall.compile_dir(sysconfig.get_paths()['purelib'], quiet=2, workers=0)"

demo: install
	$(PYTHON) -m tarq_deploy.cli demo

# pytest-xdist workers, one per core of CI's 2: whole modules per worker, so a module's fixtures are made once; the slow
# modules first (tests/conftest.py: SLOW_MODULES_FIRST). A third worker did not help: the suite still got 177 % of the
# 200 % (2026-12-06, Intel Xeon). TEST_WORKERS=0 runs the suite in this process alone.
TEST_WORKERS ?= 2
test: install
	$(PYTHON) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

clean-venv:
	rm -rf $(VENV)

# llm-compressor for `python -m tarq_deploy.bench.peers`, in an environment of its own (its pins differ from .venv's);
# the requirement is the [peers] extra of pyproject.toml, read from there so that it is written once.
PEERS_VENV ?= .venv-peers
peers-venv: venv
	python3 -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(PEERS_VENV)/bin/python -m pip install --quiet $$($(PYTHON) -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['peers']))")
