# Two set-up commands: `make demo` and `make test`. Both build .venv on first use.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
# The CPU wheel of torch lies on disk on our machines; installing it first keeps pip
# from pulling a multi-GB CUDA build to satisfy the bare `torch` requirement.
TORCH   ?= torch==2.13.0

.PHONY: demo test venv clean

$(BIN)/klotski: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[test,bench]"
	touch $(BIN)/klotski

venv: $(BIN)/klotski

demo: venv
	$(BIN)/klotski generate jobs/wikitext.jsonl -o out/wikitext.out.jsonl --report out/wikitext.report.json
	@echo "output: out/wikitext.out.jsonl   report: out/wikitext.report.json"

test: venv
	$(BIN)/python -m pytest tests

clean:
	rm -rf $(VENV) out .pytest_cache
