"""torch.compile for tandem's models: opaque custom ops at the split points and the compiled-forward wrapper."""
