# namazu: every entry point creates .venv on first use and installs the pinned dependencies.
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build of torch on machines without a GPU (the pinned wheel is available offline there).
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed
# C++/CUDA kernel sources: editing one rebuilds the extension (pip install -e . runs build_ext).
CSRC := $(wildcard namazu/csrc/*.cu namazu/csrc/*.h namazu/csrc/*/*.cpp namazu/csrc/*/*.h)

.PHONY: install test lint run bench bench-serve bench-structured bench-instances bench-tools bench-nvfp4 bench-kernels gpu-check gpu-check-dry tiny-model drafter-model drafter-refresh clean

$(STAMP): requirements.txt requirements-dev.txt setup.py $(CSRC)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

install: $(STAMP)

# --tb=native: pytest's own traceback format parses each frame's source with ast, which Python 3.11.7 can
# break mid-report ("SystemError: AST constructor recursion depth mismatch"), turning one failed test into an
# INTERNALERROR that ends the whole run without its summary.
test: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(PY) -m pytest -q -p no:cacheprovider --tb=native tests

# The OpenAI-compatible server on the embedded default model; extra flags via ARGS="--api-key ...".
HOST ?= 127.0.0.1
PORT ?= 8000
run: $(STAMP)
	$(PY) -m namazu.server --host $(HOST) --port $(PORT) $(ARGS)

# Offline throughput: namazu vs transformers' generate(), same checkpoint and prompts (writes bench/RESULTS.md).
bench: $(STAMP)
	$(PY) bench/throughput.py --write $(ARGS)

# Online serving benchmark (Poisson arrivals, shared-prefix multi-turn + random workloads).
bench-serve: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(PY) bench/serve.py $(ARGS)

# Structured output: constrained vs free decoding, speculation off/on, mask time, compile time (ARGS="--write").
bench-structured: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(PY) bench/structured.py $(ARGS)

# JSONSchemaBench test instances through namazu's, xgrammar's and llguidance's JSON-schema compilers.
bench-instances: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) bench/structured.py --instances bench/data/jsonschemabench $(ARGS)

# Tool calls through the API on held-out schemas (trigger rate, schema-valid arguments, streaming check).
bench-tools: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(PY) bench/tool_calls.py $(ARGS)

# NVFP4 acceptance table (calibration variants vs BF16 with CIs) + resident memory of packed experts.
bench-nvfp4: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(PY) bench/nvfp4_acceptance.py $(ARGS)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(PY) bench/nvfp4_memory.py

# The embedded default model namazu-tiny, from fixed seeds: tokenizer; stage 1 (corpus + chat, <= 50 min on
# 2 CPU cores); stage 2 (tool-call tuning over procedurally composed schemas, <= 10 min); routing-bias
# calibration on corpus text (bias update only, ~1 min); evaluation + MODEL_CARD.md. Each stage stops at
# its step count or time budget. Corpus: NAMAZU_CORPUS or ../shared/corpus beside the repository.
TINY_DIR ?= namazu/assets/namazu-tiny
TINY_STAGE1 ?= build/namazu-tiny-stage1
tiny-model: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(PY) -m namazu.tiny.tokenizer --out $(TINY_DIR)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(PY) -m namazu.tiny.train --config namazu/tiny/configs/namazu-tiny.json --tokenizer $(TINY_DIR) --out $(TINY_STAGE1)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(PY) -m namazu.tiny.train --config namazu/tiny/configs/namazu-tiny-tools.json --init $(TINY_STAGE1) --out $(TINY_DIR)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(PY) -m namazu.tiny.balance --model $(TINY_DIR)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(PY) -m namazu.tiny.evaluate --model $(TINY_DIR)

# The shipped DFlash2 drafter of namazu-tiny, from scratch: serve namazu-tiny with --capture-dir and replay a
# held-out prompt set (corpus valid split) and three training prompt sets (Japanese/English chat, tool calls,
# JSON answers; greedy, T=0.7 top-p 0.9, T=1; seeds 0, 2, 3), four servers of one thread each at once on the
# two cores, then train on the captured token ids (the target's outputs per sequence computed once and kept in
# memory). Block 7 (6 drafts, what is served), 32 selector candidates, most of the block loss and of the
# selector's loss against the target's own next-token distribution (at T > 0 the selector's softmax is the q
# the lossless rule sees), a draft vocabulary of the DRAFTER_VOCAB commonest output tokens (trained and served
# over those lm_head rows), fp32 (bf16 autocast was slower per step on this CPU). Three prompt sets rather than
# one: on 1,500 captured answers (52k output tokens) the drafter's training loss fell to 2.3 against 3.0
# held out, and 4,500 lifted acceptance more than training longer on fewer. Then q's sampling temperature per
# draft position is fitted on 500 of the training requests (config.json's q_temperature_scale; weights
# untouched; see docs/speculative.md). Time, end to end on the 2-core machine (bench/RESULTS.md, round 8):
# 38.6 min: the four captures 13.6 min, training 24 min by its budget (1,979 steps), the held-out evaluation
# and the calibration on 500 requests 1 min together. That run had 16 selector candidates; 32, trained on its
# captures, lifted T=0.7 from 2.15 to 2.33 and T=0 from 3.49 to 3.57 (the shipped drafter), and changes
# neither the captures nor the training budget.
DRAFTER_BUILD ?= build/drafter
DRAFTER_SEEDS = 0 2 3
DRAFTER_VOCAB = 2048
DRAFTER_TRAIN = --block-size 7 --anchors 128 --batch 8 --soft-weight 0.8 --selector-soft-weight 0.8 --selector-k 32 \
	--hidden-cache memory --eval-every 200 --draft-vocab $(DRAFTER_VOCAB) --eval-k 6 --no-bf16 --steps 20000 --time-budget 24
DRAFTER_CALIBRATE = --temperatures 0.7 1.0 --limit 500
DRAFTER_DATA = $(foreach s,$(DRAFTER_SEEDS),$(DRAFTER_BUILD)/capture-train-$(s))
drafter-model: $(STAMP)
	rm -rf $(DRAFTER_BUILD)/capture-*
	set -e; pids=""; for s in $(DRAFTER_SEEDS); do \
	  OMP_NUM_THREADS=1 $(PY) -m namazu.spec.training.traffic --out $(DRAFTER_BUILD)/train_requests_$$s.jsonl -n 1500 --seed $$s \
	    --capture-dir $(DRAFTER_BUILD)/capture-train-$$s & pids="$$pids $$!"; done; \
	OMP_NUM_THREADS=1 $(PY) -m namazu.spec.training.traffic --out $(DRAFTER_BUILD)/heldout_requests.jsonl -n 250 --split valid --seed 1 \
	  --capture-dir $(DRAFTER_BUILD)/capture-heldout; \
	for p in $$pids; do wait $$p; done
	OMP_NUM_THREADS=1 $(PY) -m namazu.spec.training.train --data $(DRAFTER_DATA) --heldout $(DRAFTER_BUILD)/capture-heldout --out $(TINY_DIR)/drafter $(DRAFTER_TRAIN)
	OMP_NUM_THREADS=1 $(PY) -m namazu.spec.training.calibrate --drafter $(TINY_DIR)/drafter --data $(DRAFTER_DATA) $(DRAFTER_CALIBRATE)

# A drafter that keeps up with the traffic (docs/speculative.md, "Refreshing the drafter"): capture a replayed
# mix unlike the shipped drafter's in content (calls of freshly composed tools, JSON answers under a json_schema
# response format, document continuations, none of them in its traffic; 60% English; a fifth of the requests
# seeded), then `namazu.spec.refresh` against the shipped drafter: fine-tune on the capture (its draft vocabulary
# extended by the 256 commonest new output tokens; the weights then blended 30% back towards the shipped ones,
# which keeps its greedy prose: bench/RESULTS.md, round 2; 20 minutes of it: 1.105x, round 3), calibrate, replay the
# newest 15% of it through both drafters,
# gate (also on the shipped drafter's own held-out capture from `make drafter-model` when it exists, or
# REFRESH_GUARD=DIR: the old mix may not get worse beyond the margin). Resumable: a finished
# capture is kept (its .done stamp), the refresh resumes its stages. The candidate is written to
# $(REFRESH_BUILD)/out/candidate, never over the shipped drafter; REFRESH_ARGS="--server URL --admin-key KEY"
# hot-swaps a promoted one into a running server.
REFRESH_BUILD ?= build/refresh
REFRESH_N ?= 1200
REFRESH_MIX = --english-share 0.6 --qa-weight 1 --tool-weight 0.6 --copy-weight 0.3 --call-weight 1.2 \
	--json-weight 0.8 --continue-weight 0.3 --seed-share 0.2
REFRESH_TRAIN = --anchors 128 --batch 8 --soft-weight 0.8 --selector-soft-weight 0.8 --hidden-cache memory --no-bf16 \
	--steps 20000 --time-budget 20 --lr 1e-3 --eval-k 6 --draft-vocab-extend 256 --blend-init 0.3
REFRESH_GUARD ?= $(wildcard $(DRAFTER_BUILD)/capture-heldout)
REFRESH_ARGS ?=
drafter-refresh: $(STAMP)
	test -f $(REFRESH_BUILD)/capture.done || { rm -rf $(REFRESH_BUILD)/capture && \
	  OMP_NUM_THREADS=1 $(PY) -m namazu.spec.training.traffic --out $(REFRESH_BUILD)/requests.jsonl -n $(REFRESH_N) \
	    --seed 11 $(REFRESH_MIX) --capture-dir $(REFRESH_BUILD)/capture && touch $(REFRESH_BUILD)/capture.done; }
	OMP_NUM_THREADS=1 $(PY) -m namazu.spec.refresh --capture $(REFRESH_BUILD)/capture --base $(TINY_DIR)/drafter \
	  --out $(REFRESH_BUILD)/out --train-args "$(REFRESH_TRAIN)" \
	  $(if $(REFRESH_GUARD),--guard $(REFRESH_GUARD) --replay-limit 250) $(REFRESH_ARGS)

# MoE kernel microbenchmark: every backend, BF16 and NVFP4, vs a roofline measured in the same run
# (ARGS="--write" updates bench/RESULTS.md; on a GPU machine it runs the Kimi-K2 and namazu-tiny shapes).
bench-kernels: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(PY) bench/kernels.py $(ARGS)

# On a lent GPU machine: uses that machine's own python3 (no .venv, no installs), builds the CUDA
# extension, runs the GPU kernel tests, then bench-kernels; staged, under 8 minutes, short final table.
gpu-check:
	bash bench/gpu_check.sh

# On a CPU machine, a dry run of the above: PYTHON=<a python with a CUDA build of torch> make gpu-check-dry.
# Runs on an exported copy of HEAD (the build writes extensions in place, for that python's torch); the
# CUDA extension must build and import, the GPU tests must fail (not skip), nothing after them runs.
gpu-check-dry:
	rm -rf build/gpu-check-dry && mkdir -p build/gpu-check-dry
	git archive HEAD | tar -x -C build/gpu-check-dry
	cd build/gpu-check-dry && GPU_CHECK_DRY_RUN=1 OUT=$${OUT:-gpu-check-out} bash bench/gpu_check.sh; \
	  test -f $${OUT:-gpu-check-out}/build.txt && grep -q "built and imported: namazu._nvfp4_cuda" $${OUT:-gpu-check-out}/build.txt

lint: $(STAMP)
	$(VENV)/bin/ruff check namazu server tests bench

clean:
	rm -rf build *.egg-info
