"""Training of the bundled default model: tokenizer, DeepSeek-V3 target with a jointly trained MTP layer, and
the DSpark drafter distilled from it (`python -m tandem.train`, docs/bundled_model.md)."""
