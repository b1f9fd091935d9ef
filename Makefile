# asrflow: `make run` trains and evaluates on the default corpus; `make test` runs the tests.
# Both create .venv and install everything on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export GIT_PYTHON_REFRESH := quiet

.PHONY: setup run test test-fast bench lint mlflow-ui clean espeak-ng

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.14.1" "torchaudio==2.11.0" -e ".[dev]"
	touch $(STAMP)

run: $(STAMP)
	. $(BIN)/activate && snakemake --cores all
	@. $(BIN)/activate && python -c "import json; m = json.load(open('exp/eval/metrics.json')); print(f\"test WER {100 * m['wer']:.2f}%  CER {100 * m['cer']:.2f}%\")"
	@echo "Browse every run: . $(BIN)/activate && mlflow ui --backend-store-uri sqlite:///mlflow.db  (then open http://127.0.0.1:5000)"

test: $(STAMP)
	. $(BIN)/activate && .ci/install-slurm
	. $(BIN)/activate && ruff check . && ruff format --check . && .ci/pytest

# The spoken-corpus tests need espeak-ng: installed here when make runs as root with apt, else they skip.
test: espeak-ng
espeak-ng:
	@command -v espeak-ng >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get install -y -q espeak-ng >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q espeak-ng >/dev/null; }; }; } || \
		echo "espeak-ng could not be installed: the spoken-corpus tests will skip (README: Developing asrflow)"

test-fast: $(STAMP)
	. $(BIN)/activate && python -m pytest -q -m "not pipeline and not serve"

bench: $(STAMP)
	. $(BIN)/activate && python -m bench.run_all

lint: $(STAMP)
	. $(BIN)/activate && ruff check . && ruff format --check . && snakemake --lint

mlflow-ui: $(STAMP)
	. $(BIN)/activate && mlflow ui --backend-store-uri sqlite:///mlflow.db --host 127.0.0.1

clean:
	rm -rf data/manifests data/fbank data/lang exp logs .snakemake mlflow.db mlartifacts
