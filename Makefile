# The two commands of the README. Both create (or update) .venv in the repo root with the system python3.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test studies lint format clean

# pip writes no bytecode at install (half of the install's time: ~100 packages, most never imported here); Python
# writes a module's on its first import instead, only for what runs. An environment that turns that off
# (PYTHONDONTWRITEBYTECODE) would make every process compile its imports anew: not for the commands of this file.
unexport PYTHONDONTWRITEBYTECODE

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --no-compile -e '.[test]'
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/asgd-jax ablate --quick --model cnn --lr 0.2 --epochs 10 --out results/demo --overwrite

# The house rules first (seconds), then the suite.
test: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -n 2 --dist loadgroup --durations=15 --nbmake tests notebooks

STUDIES := dcasgd_table1 dcasgd_lambda_sweep staleness_curve gpu_asgd_nsync speedup_model heterogeneous_workers \
	heterogeneous_data communication_bound \
	staleness_leaderboard optimal_time

# Every study's quick form, the report, and each study's final plot copied to docs/results/ (what the README shows).
studies: $(STAMP)
	for s in $(STUDIES); do $(BIN)/asgd-jax run $$s --quick --overwrite --out results/studies/$$s || exit 1; done
	$(BIN)/asgd-jax report results/studies
	mkdir -p docs/results && for s in $(STUDIES); do \
		cp results/studies/$$s/final.png docs/results/$$s.png; \
		for f in results/studies/$$s/final_*.png; do [ ! -e "$$f" ] || cp "$$f" "docs/results/$${s}_$${f##*/final_}"; done; \
	done

lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) results .pytest_cache
