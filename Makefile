# Two entry points, both doing their own set-up on a fresh machine (Python 3.11 on PATH as python3):
#   make demo   compress the bundled sample data and inspect the result
#   make test   run the whole test suite (also under Python 3.12 + the newest zarr, for the cross-version test)
PYTHON ?= python3
PYTHON312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
VENV := .venv
VENV312 := .venv312

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e ".[test,torch,dask,plot]"
	touch $@

# Triton's interpreter runs the CUDA decode kernels on the CPU in the tests (CUDA torch builds ship Triton;
# the CPU build does not, and the demo does not need it)
$(VENV)/.triton: $(VENV)/.installed
	$(VENV)/bin/python -m pip install -q "triton==3.9.0"
	touch $@

$(VENV312)/.installed: pyproject.toml
	$(PYTHON312) -m venv $(VENV312)
	$(VENV312)/bin/python -m pip install -q --upgrade pip
	$(VENV312)/bin/python -m pip install -q -e . "zarr>=3.2"
	touch $@

.PHONY: demo test
demo: $(VENV)/.installed
	rm -rf out && mkdir -p out
	$(VENV)/bin/dctchop compress sample_data/images.h5 out/images.zarr
	$(VENV)/bin/dctchop compress sample_data/field.npy out/field.zarr
	$(VENV)/bin/dctchop inspect out/images.zarr
	$(VENV)/bin/dctchop inspect out/field.zarr

test: $(VENV)/.installed $(VENV)/.triton $(VENV312)/.installed
	DCTCHOP_OTHER_PYTHON=$(CURDIR)/$(VENV312)/bin/python $(VENV)/bin/python -m pytest
