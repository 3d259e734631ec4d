# The README's two commands: `make run` and `make test`. Both build the local
# virtual environment from requirements.lock on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run run-partitioned test bench bench-cluster bench-http bench-structured bench-quantization bench-routing bench-gateway bench-llama-cpp bench-kv-cache bench-gpu experiments gpu-check lock protos clean

# Installed without pip's byte-compiling (one file at a time), then compiled on every core: where
# PYTHONDONTWRITEBYTECODE is set (as on CI) the processes the tests and the cluster start write no .pyc
# themselves. One of torch's test helpers is Python 3.12 syntax and left out; a failure to compile is
# printed and, as under pip, does not stop the install.
$(STAMP): requirements.lock pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-compile -r requirements.lock
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	$(PY) -m compileall -q -j 0 -x py312_intrinsics \
		"$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || true
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/honcho start

# Two gateways, each with a worker of its own, on gRPC ports 50051 and 50052 (Procfile.partitioned).
run-partitioned: $(STAMP)
	$(VENV)/bin/honcho start -f Procfile.partitioned

# Regenerate protos/*_pb2*.py after editing a .proto (tests/test_protos.py checks they are current).
protos: $(STAMP)
	$(PY) -m tools.gen_protos

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m bench.engine_throughput

# The cluster against the in-process engine, and priority queues against FIFO (~3.5 min).
bench-cluster: $(STAMP)
	$(PY) -m bench.cluster_vs_engine

# The OpenAI HTTP API against gRPC (fake and real workers) and against llama-server (~7 min).
bench-http: $(STAMP)
	$(PY) -m bench.http_vs_grpc

# Structured output's cost: W1 with a quarter of it constrained, masks at 32 rows, compile times (~2 min).
bench-structured: $(STAMP)
	$(PY) -m bench.structured_output

# Quantization and loading modes on models/default, then on bench-small (~5 + ~10 min).
bench-quantization: $(STAMP)
	$(PY) -m bench.quantization
	$(PY) -m bench.quantization --model bench-small

# Cache-aware routing against least-loaded and round-robin: 8 and 32 fake workers, 2 real ones (~18 min).
bench-routing: $(STAMP)
	$(PY) -m bench.routing

# One gateway's ceiling: tokens/s relayed to gRPC streams from 8, 32 and 128 fake workers over tcp:// (~10 min).
bench-gateway: $(STAMP)
	$(PY) -m bench.gateway_ceiling --wait-quiet 30

# Our float32 / INT8 / INT4 against llama.cpp's f32 / q8_0 / q4_0, one stream and batched, on bench-small and
# on a random model of TinyLlama-1.1B's shape (built once, 4.4 GB; ~30 min; needs ../shared/tools/build-llama-cpp).
bench-llama-cpp: $(STAMP)
	$(PY) -m bench.vs_llama_cpp --model bench-small
	$(PY) -m bench.vs_llama_cpp --model tinyllama-shape

# float16 and bfloat16 KV pools against float32 on bench-small: greedy agreement, teacher-forced logits, decode
# tok/s after a 1500-token prompt, one stream and eight (~2 min).
bench-kv-cache: $(STAMP)
	$(PY) -m bench.kv_cache_dtype

# On a GPU host: one stream, a batch of 32 and the per-step overhead, ours (with and without decode
# graphs) beside transformers on TinyLlama's shape in bfloat16 (~3 min, most of it making the checkpoint).
bench-gpu: $(STAMP)
	$(PY) -m bench.gpu_decode

# The CUDA paths the CPU test suite cannot reach, on a GPU host (`--device cpu` dry-runs it here).
gpu-check: $(STAMP)
	$(PY) -m tools.gpu_check

# The seed experiments of docs/experiments.md: JSON in bench/results/experiments/, figures in
# docs/figures/ (~20 min; `python -m bench.experiments --quick` is the short version).
experiments: $(STAMP)
	$(PY) -m bench.experiments

# Regenerate the lock from pyproject.toml. torch is pinned to the CPU build
# that CI installs; the project's own requirement stays a range.
lock:
	$(PY) -m pip install --quiet pip-tools
	$(VENV)/bin/pip-compile --quiet --extra dev --extra ray --strip-extras \
		-c .ci/torch-constraint.txt -o requirements.lock.tmp pyproject.toml
	grep -vE '^--(extra-index-url|find-links)' requirements.lock.tmp \
		| sed 's/^torch==\([0-9.]*\)+cpu/torch==\1/' > requirements.lock
	rm -f requirements.lock.tmp

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
