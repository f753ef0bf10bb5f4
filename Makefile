# Two commands a newcomer needs:  make train  (the main job)  and  make test.
# Each creates .venv and installs what it needs (CPU-only machines included).
VENV ?= .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# pin torch first: an unpinned torch would pull a multi-GB CUDA build on CPU machines
	$(PY) -m pip install -q torch==2.13.0 triton==3.6.0 "numpy<2.4"
	$(PY) -m pip install -q --no-deps recbole==1.2.1   # MovieLens-100k ships inside this wheel
	$(PY) -m pip install -q -e ".[test]"
	touch $@

.PHONY: setup train test plots
setup: $(VENV)/.installed

train: setup   ## train the CTR model (six detached subarchitectures) on MovieLens-100k with ERASE
	$(VENV)/bin/erase-triton train $(ARGS)

test: setup    ## plain pytest (not python -m pytest: see README)
	$(VENV)/bin/pytest -q -p no:cacheprovider

plots: setup   ## redraw the figures of the committed H200 results into runs/plots (the tree stays clean)
	$(VENV)/bin/erase-triton plot benchmarks/results/*.csv --out runs/plots
