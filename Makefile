# make demo   -> installs pinned dependencies into .venv, then trains on the generated sample
# make test   -> installs (if needed), then runs the test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-gpu bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt -c constraints.txt
	touch $@

demo: setup
	$(PY) bin/driver.py --config configs/demo.toml

test: setup
	$(PY) -m pytest -n 2 --dist loadfile

test-gpu: setup
	$(PY) -m pytest -m gpu

# make bench BENCH="loader --dataset sample_bench": any bin/bench.py sub-command and its flags
BENCH ?= sync
bench: setup
	$(PY) bin/bench.py $(BENCH)

clean:
	rm -rf runs .pytest_cache .hypothesis
