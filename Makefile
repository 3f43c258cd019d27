# The two commands a newcomer runs (README): `make demo` and `make test`.
# Both install missing Debian packages first, make .venv with the pinned Python packages
# (requirements.txt: torch among them), then build with CMake against that venv's torch.
BUILD  ?= build
PYTHON ?= python3
VENV   ?= .venv
JOBS   ?= 2
CMAKE_FLAGS ?=
VENV_PYTHON := $(abspath $(VENV))/bin/python

export PIP_DISABLE_PIP_VERSION_CHECK = 1

.PHONY: all deps venv configure build test test-cpp test-python python demo bench format clean

all: build

deps:
	bash scripts/install_deps.sh

# The venv and its pinned packages; made again only when requirements.txt changes.
$(VENV)/.requirements: requirements.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet -r requirements.txt
	cp requirements.txt $@

venv: $(VENV)/.requirements

# LibTorch and pybind11 are the venv's (cmake/monarch_torch.cmake asks its interpreter).
$(BUILD)/CMakeCache.txt: | $(VENV)/.requirements
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE=$(VENV_PYTHON) $(CMAKE_FLAGS)

configure: deps venv $(BUILD)/CMakeCache.txt

build: configure
	cmake --build $(BUILD) --parallel $(JOBS)

test-cpp: build
	cd $(BUILD) && ctest --output-on-failure --parallel $(JOBS)

# The Python package is installed the way users install it next to the torch they have (pip,
# no build isolation: it builds against the venv's torch), and tested from outside the tree.
python: deps venv
	$(VENV)/bin/python -m pip install --no-build-isolation --no-deps --quiet .

test-python: python
	cd test/python && ../../$(VENV)/bin/python -m pytest -q

test: test-cpp test-python

# The demo needs only the planner's command line tool (and the Python package): it does not
# wait for the test binaries to build.
demo: configure python
	cmake --build $(BUILD) --parallel $(JOBS) --target monarch-plan
	@echo "== GPT-3 175B (built on the meta device, read from its nn.Module) on 1024 A100-80GB: the planner's choice =="
	$(VENV)/bin/python -m torch_monarch plan examples/models.py:gpt3_175b --seq 2048 --global-batch 1536 \
		--gpus 1024 --cluster a100-80gb -o $(BUILD)/gpt3-175b-1024.plan.json
	@echo
	@echo "== the same plan, loaded back from JSON and validated =="
	$(BUILD)/bin/monarch-plan validate $(BUILD)/gpt3-175b-1024.plan.json
	@echo
	@echo "== a small GPT on this machine: 4 CPU ranks through the launcher, the planner's layout =="
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --nproc-per-node 4 examples/python/train_gpt.py

bench: build python
	$(BUILD)/bin/bench_planner bench/results/planner.json
	$(VENV)/bin/python bench/bench_read_model.py --out bench/results/read_model.json
	$(VENV)/bin/python bench/recompute_memory.py --out bench/results/recompute_memory.json
	$(VENV)/bin/python bench/bench_data_parallel.py --out bench/results/data_parallel.json
	$(VENV)/bin/python bench/dp_reduction_cpu.py --out bench/results/dp_reduction_cpu.json
	$(VENV)/bin/python bench/bench_parallel.py --out bench/results/parallel.json
	$(VENV)/bin/python bench/traffic.py --out bench/results/traffic.json
	$(VENV)/bin/python bench/fuzz.py --out bench/results/fuzz.json
	$(VENV)/bin/python bench/zero_bubble.py --out bench/results/zero_bubble.json
	$(VENV)/bin/python bench/layouts.py --out bench/results/layouts.json
	$(VENV)/bin/python bench/dlrm.py --out bench/results/dlrm.json
	$(VENV)/bin/python bench/context_parallel.py --out bench/results/context_parallel.json
	$(VENV)/bin/python bench/experts.py --out bench/results/experts.json
	$(VENV)/bin/python bench/generate.py --out bench/results/generate.json
	$(VENV)/bin/python bench/checkpoint.py --out bench/results/checkpoint.json
	$(VENV)/bin/python bench/peers.py --out bench/results/peers.json
	$(VENV)/bin/python bench/memory_prediction.py --out bench/results/memory_prediction.json
	$(VENV)/bin/python bench/compile.py --out bench/results/compile.json

format:
	clang-format -i $$(git ls-files '*.h' '*.cpp' '*.cu')

clean:
	rm -rf $(BUILD) $(VENV)
