# asrflow: `make run` trains and evaluates on the default corpus; `make test` runs the tests.
# Both create .venv and install everything on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export GIT_PYTHON_REFRESH := quiet

.PHONY: setup run test test-fast bench bench-test lint mlflow-ui clean system-packages

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt "torch==2.14.1" "torchaudio==2.11.0" -e ".[dev]"
	$(BIN)/pip check
	touch $(STAMP)

run: $(STAMP)
	. $(BIN)/activate && snakemake --cores all
	@. $(BIN)/activate && python -c "import json; m = json.load(open('exp/eval/metrics.json')); print(f\"test WER {100 * m['wer']:.2f}%  CER {100 * m['cer']:.2f}%\")"
	@echo "Browse every run: . $(BIN)/activate && mlflow ui --backend-store-uri sqlite:///mlflow.db  (then open http://127.0.0.1:5000)"

test: $(STAMP)
	. $(BIN)/activate && .ci/install-slurm
	. $(BIN)/activate && ruff check . && ruff format --check . && .ci/pytest

# System packages the tests use, installed here when make runs as root with apt (else install them yourself;
# without them the spoken-corpus tests skip, and the train stage keeps glibc's malloc): espeak-ng speaks the
# generated corpora, fortunes and fortunes-min hold the real sentences they can speak (asrflow.generate.sentences),
# libjemalloc2 is the malloc the train stage preloads (run.allocator; README: Install).
SYSTEM_PACKAGES := espeak-ng libjemalloc2 fortunes fortunes-min
test: system-packages
system-packages:
	@missing=$$(for package in $(SYSTEM_PACKAGES); do dpkg -s $$package >/dev/null 2>&1 || echo $$package; done); \
	[ -z "$$missing" ] || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get install -y -q $$missing >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q $$missing >/dev/null; }; }; } || \
		echo "could not install" $$missing "(README: Install): without espeak-ng the spoken-corpus tests skip; without libjemalloc2 the train stage uses glibc's malloc"

bench-test: $(STAMP)
	. $(BIN)/activate && python -m pytest -q -m bench

# make test-fast: the quick lane while developing (goal: under 5 minutes on 2 cores; RESULTS.md#test-suite). It
# leaves out the end-to-end runs (pipeline, serve), the Slurm and benchmark tests, and the tests marked slow
# (training runs, processes killed and resumed, the stages' memory). make test runs them all.

test-fast: $(STAMP)
	. $(BIN)/activate && python -m pytest -q -m "not pipeline and not serve and not slurm and not bench and not slow" \
		--durations=15

bench: $(STAMP)
	. $(BIN)/activate && python -m bench.run_all

lint: $(STAMP)
	. $(BIN)/activate && ruff check . && ruff format --check . && snakemake --lint

mlflow-ui: $(STAMP)
	. $(BIN)/activate && mlflow ui --backend-store-uri sqlite:///mlflow.db --host 127.0.0.1

clean:
	rm -rf data/manifests data/fbank data/lang exp logs .snakemake mlflow.db mlartifacts
