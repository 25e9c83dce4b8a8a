# make demo   -> installs pinned dependencies into .venv, then trains on the generated sample
# make test   -> installs (if needed), then runs the test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-gpu bench clean peer-fastai

setup: $(VENV)/.installed

# uv installs the same pins as pip, in a third of pip's time: it unpacks the wheels and
# byte-compiles them on every core. It reads none of pip's settings, so what pip is set to
# read from on this machine (a mirror, a folder of wheels: `pip config list`) is handed over.
$(VENV)/.installed: requirements.txt constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check uv==0.13.9
	$(VENV)/bin/uv pip install --quiet --python $(PY) --index-strategy unsafe-best-match \
		--compile-bytecode $$($(PY) -c "$$PIP_SOURCES_AS_UV_FLAGS") -r requirements.txt -c constraints.txt
	touch $@

# pip's index, extra indexes, find-links folders and constraints as uv's flags; the variables
# (PIP_INDEX_URL, ...) win over the files, as they do for pip
define PIP_SOURCES_AS_UV_FLAGS
import shlex, subprocess, sys
flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url",
         "find-links": "--find-links", "constraint": "--constraint"}
listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                        capture_output=True, text=True).stdout.splitlines()
chosen = {}
for line in sorted(listed, key=lambda line: line.startswith(":env:")):
    name, _, value = line.partition("=")
    key = name.rpartition(".")[2]
    if key in flags:
        chosen[key] = shlex.split(value)[0].split() if value else []
print(" ".join(f"{flags[key]} {shlex.quote(value)}" for key in flags for value in chosen.get(key, [])))
endef
export PIP_SOURCES_AS_UV_FLAGS

# fastai, for `bin/bench.py peers --trainers fastai`: in a folder of its own that only its
# runs put on their path, never in the product's venv. uv resolves nothing (--no-deps): the
# file pins what fastai's vision training imports beyond the venv's packages.
FASTAI_SITE := .peers/fastai
peer-fastai: $(FASTAI_SITE)/.installed

$(FASTAI_SITE)/.installed: requirements-fastai.txt $(VENV)/.installed
	rm -rf $(FASTAI_SITE)
	$(VENV)/bin/uv pip install --quiet --python $(PY) --target $(FASTAI_SITE) --no-deps \
		--index-strategy unsafe-best-match --compile-bytecode \
		$$($(PY) -c "$$PIP_SOURCES_AS_UV_FLAGS") -r requirements-fastai.txt
	touch $@

demo: setup
	$(PY) bin/driver.py --config configs/demo.toml

# The suite starts hundreds of Python processes; where PYTHONDONTWRITEBYTECODE is set (CI
# images often do) each would compile app/ anew: compiled once here instead.
test: setup peer-fastai
	$(PY) -m compileall -q -j 0 app bin
	$(PY) -m pytest -n 2 --dist loadfile

test-gpu: setup
	$(PY) -m pytest -m gpu

# make bench BENCH="loader --dataset sample_bench": any bin/bench.py sub-command and its flags
BENCH ?= sync
bench: setup
	$(PY) bin/bench.py $(BENCH)

clean:
	rm -rf runs .pytest_cache .hypothesis
