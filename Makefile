# Two entry points: `make demo` and `make test`. Each installs what it needs first.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install system-packages demo test

# Debian packages: real human speech with transcripts (LibriVox clips, pocketsphinx-testdata), and the offline
# rare-word speech corpus: festival + the CMU ARCTIC SLT HTS voice, public-domain text (World English Bible, the
# Devil's Dictionary) and WordNet example sentences.
APT_PACKAGES := pocketsphinx-testdata festival festvox-us-slt-hts sword-text-web wordnet-base dict-devil

system-packages:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

# torch is pinned first so pip takes the CPU wheel that lies on these machines instead of a CUDA build.
install: system-packages
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev,models]'

demo: install
	$(PYTHON) -m tarq_deploy.cli demo

test: install
	$(PYTHON) -m pytest -q
