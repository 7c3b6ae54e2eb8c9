# cube-serve. `make demo` and `make test` work on a fresh machine: they create .venv and
# install what they need (torch from the CPU wheel `torch==2.13.0`).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= a round wooden table
DEMO_WEIGHTS ?= weights/tiny

.PHONY: install test demo weights clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q

$(DEMO_WEIGHTS)/config.yaml: | install
	$(VENV)/bin/cubeserve weights init --config tiny --seed 0 --out $(DEMO_WEIGHTS)

weights: $(DEMO_WEIGHTS)/config.yaml

# Until the Triton model lands, the demo runs the engine in process.
demo: install weights
	mkdir -p outputs
	$(VENV)/bin/cubeserve generate "$(PROMPT)" --weights $(DEMO_WEIGHTS) --resolution 6 \
		--out outputs/demo.glb --preview outputs/demo.png --save-tokens outputs/demo_tokens.json

clean:
	rm -rf outputs weights
