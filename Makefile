# Every target bootstraps the virtual environment it needs (CPU torch; nothing else to install first).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_MODEL := runs/demo-model

.PHONY: demo test proto lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# A CPU build of torch: the file lies on these machines; elsewhere pip takes it from the index.
	$(PY) -m pip install -q "torch==2.13.0" || $(PY) -m pip install -q --index-url https://download.pytorch.org/whl/cpu torch
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

$(DEMO_MODEL)/config.json: | $(STAMP)
	$(VENV)/bin/rolefleet tiny-model $(DEMO_MODEL) --task addition --warm-start-steps 150

demo: $(STAMP) $(DEMO_MODEL)/config.json
	$(VENV)/bin/rolefleet up configs/demo.yaml

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check services tests scripts

proto: $(STAMP)
	$(PY) scripts/gen_protos.py

clean:
	rm -rf runs $(VENV)
