# lowmem: the two commands of the README do all set-up on a fresh machine.
#   make demo   - create .venv, install, run the main job (a short real training demo)
#   make test   - create .venv, install with test extras (PyTorch CPU for comparisons), run the tests
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q

.PHONY: demo test venv install install-test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

install: $(PY)
	$(PIP) install -e ".[fast]"

install-test: $(PY)
	$(PIP) install -e ".[test,compare,fast,images,safetensors,onnx,mpi,plot]"

demo: install
	$(PY) demos/main_job.py

test: install-test
	$(PY) -m pytest -q

bench: install-test
	$(PY) benchmarks/compare_torch.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
