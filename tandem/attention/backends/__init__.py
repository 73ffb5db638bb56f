"""Built-in backends; importing this package registers them."""

from tandem.attention.backends import contiguous, paged_mla, paged_sdpa  # noqa: F401
