"""n-gram (prompt lookup) drafter: find the most recent earlier occurrence of the sequence's last n
tokens (n from prompt_lookup_max down to prompt_lookup_min) and propose the tokens that followed it."""

from __future__ import annotations


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k draft tokens for the continuation of `token_ids`; [] when no n-gram repeats."""
    if k <= 0:
        return []
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = token_ids[length - n:]
        # scan right to left so the most recent match wins; the match must end before the suffix starts
        for start in range(length - n - 1, -1, -1):
            if token_ids[start:start + n] == suffix:
                follow = token_ids[start + n:start + n + k]
                if follow:
                    return follow
    return []
