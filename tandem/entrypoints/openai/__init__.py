"""The OpenAI-compatible HTTP server (`tandem serve`)."""
