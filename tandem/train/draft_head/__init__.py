"""EAGLE-3 draft-head training for a Llama / Qwen3 checkpoint by self-distillation on a CPU
(`tandem train draft-head`); writes the head folder vLLM's `llama_eagle3.py` reads."""
