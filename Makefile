# The two commands a newcomer runs (README): `make demo` and `make test`.
# Both install missing Debian packages first, then build with CMake.
BUILD  ?= build
PYTHON ?= /usr/bin/python3
VENV   ?= .venv
JOBS   ?= 2
CMAKE_FLAGS ?=
GPT3 = --layers 96 --hidden 12288 --heads 96 --seq 2048 --vocab 51200 --global-batch 1536

export PIP_DISABLE_PIP_VERSION_CHECK = 1
export PIP_NO_INDEX = 1

.PHONY: all deps configure build test test-cpp test-python python demo bench format clean

all: build

deps:
	bash scripts/install_deps.sh

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

configure: deps $(BUILD)/CMakeCache.txt

build: configure
	cmake --build $(BUILD) --parallel $(JOBS)

test-cpp: build
	cd $(BUILD) && ctest --output-on-failure --parallel $(JOBS)

# The Python package is installed the way users install it (pip, no build isolation: no
# PyPI here) into a venv that sees Debian's packages, and tested from outside the tree.
python: deps
	test -x $(VENV)/bin/python || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(VENV)/bin/python -m pip install --no-build-isolation --no-deps --quiet .

test-python: python
	cd test/python && ../../$(VENV)/bin/python -m pytest -q

test: test-cpp test-python

demo: build
	@echo "== GPT-3 175B on 1024 A100-80GB: planner's choice =="
	$(BUILD)/bin/monarch-plan transformer $(GPT3) --gpus 1024 --cluster a100-80gb -o $(BUILD)/gpt3-175b-1024.plan.json
	@echo
	@echo "== the same plan, loaded back from JSON and validated =="
	$(BUILD)/bin/monarch-plan validate $(BUILD)/gpt3-175b-1024.plan.json

bench: build python
	$(BUILD)/bin/bench_planner bench/results/planner.json
	$(VENV)/bin/python bench/bench_data_parallel.py --out bench/results/data_parallel.json
	$(VENV)/bin/python bench/bench_parallel.py --out bench/results/parallel.json

format:
	clang-format -i $$(git ls-files '*.h' '*.cpp' '*.cu')

clean:
	rm -rf $(BUILD) $(VENV)
