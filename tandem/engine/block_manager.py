"""Paged KV block allocation with reference counts and hash-based prefix caching.

A full block's hash chains its parent's hash with its token ids (with an MTP drafter, and the token after it), so
equal hashes mean equal prefixes. Freed blocks keep their hash and go to the back of the free queue: they can be revived
by a later prefix hit until they are handed out again (then their hash is forgotten).

With owner-sharded PCP KV (`num_pools` = P) the pool is P per-rank pools: global block id b is local block
b // P of rank b % P (tandem/attention/kv_ownership.py), and a request's j-th block comes from pool j % P, so a request
of n blocks takes ceil(n / P) from the fullest rank; an allocation fails (and the scheduler preempts) when any
pool it needs is short. With one pool this is the plain allocator.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tandem.attention.kv_ownership import block_pool, owner_rank
from tandem.engine.request import Request


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = field(default_factory=tuple)


def chain_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 key_next_token: bool = False, num_pools: int = 1):
        if num_pools < 1 or num_blocks % num_pools:
            raise ValueError(f"num_blocks={num_blocks} must be a positive multiple of num_pools={num_pools}")
        self.block_size = block_size
        self.num_pools = num_pools
        self.enable_prefix_caching = enable_prefix_caching
        # An MTP layer's cache entry at position p was computed from token p + 1, so a block's entries depend on
        # the token after it too: with an MTP drafter a block's key is its tokens plus the next one, and a block
        # is registered once that token is known. A hit then reuses only entries computed from the same tokens
        # (vLLM instead recomputes the whole last hit block for EAGLE/MTP: ~16 tokens a request for one entry).
        self.key_next_token = key_next_token
        self.blocks = [Block(i) for i in range(num_blocks)]
        # per pool, its free global ids (pool p holds ids p, p + P, p + 2P, ...)
        self.free_ids: list[deque[int]] = [deque(range(p, num_blocks, num_pools)) for p in range(num_pools)]
        self.hash_to_block: dict[int, int] = {}
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return sum(len(q) for q in self.free_ids)

    def pool_free_blocks(self) -> list[int]:
        return [len(q) for q in self.free_ids]

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, req: Request, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(req.block_ids))

    def match_prefix(self, req: Request) -> int:
        """Attach cached blocks for the longest cached prefix; returns the number of tokens hit.

        At least one token is left to compute, because the step must produce logits for it.
        """
        if not self.enable_prefix_caching:
            return 0
        tokens = req.all_token_ids
        bs, parent = self.block_size, None
        max_blocks = (len(tokens) - 1) // bs
        extra = 1 if self.key_next_token else 0
        for i in range(max_blocks):  # block i < max_blocks: the token after it exists
            chunk = tuple(tokens[i * bs:(i + 1) * bs + extra])
            h = chain_hash(parent, chunk)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            self._acquire(block_id)
            req.block_ids.append(block_id)
            req.block_hashes.append(h)
            parent = h
        return len(req.block_ids) * bs

    def record_prefix_query(self, num_tokens: int, num_hit: int) -> None:
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit

    def _acquire(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.free_ids[owner_rank(block_id, self.num_pools)].remove(block_id)
        block.ref_count += 1

    def allocate(self, req: Request, num_tokens: int) -> bool:
        """Grow req.block_ids to hold num_tokens slots; False (nothing changed) if a pool is short."""
        need = self.blocks_needed(req, num_tokens)
        first = len(req.block_ids)
        pools = [block_pool(j, self.num_pools) for j in range(first, first + need)]
        counts = [pools.count(p) for p in range(self.num_pools)]
        if any(n > len(q) for n, q in zip(counts, self.free_ids, strict=True)):
            return False
        # The popped ids are sorted: freed requests return their blocks tail first, so the queue holds them in
        # descending runs, and ascending ids put a request's keys back to back in the pool, where attention
        # reads them in place (tandem/attention/backends/prefix.py) instead of gathering them.
        taken = [sorted(q.popleft() for _ in range(n)) for n, q in zip(counts, self.free_ids, strict=True)]
        for pool in pools:
            block = self.blocks[taken[pool].pop(0)]
            if block.hash is not None and self.hash_to_block.get(block.hash) == block.block_id:
                del self.hash_to_block[block.hash]
            block.hash, block.token_ids, block.ref_count = None, (), 1
            req.block_ids.append(block.block_id)
        return True

    def cache_full_blocks(self, req: Request, num_tokens: int | None = None) -> None:
        """Register the hashes of the blocks full within the first `num_tokens` tokens (default: the computed
        ones). The scheduler registers a step's blocks as it schedules them, so a request admitted later in
        the same step hits them: every layer writes the whole batch's K/V before any row attends, so the
        keys are in place when the later request reads them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        # accepted drafts are computed before they are appended to the request's tokens
        done = req.num_computed_tokens if num_tokens is None else num_tokens
        num_full = min(min(done, req.num_tokens) // bs, len(req.block_ids))
        extra = 1 if self.key_next_token else 0
        if extra:  # a block waits for the token after it (a decode's is sampled by the step that fills the block)
            num_full = min(num_full, (req.num_tokens - 1) // bs)
        for i in range(len(req.block_hashes), num_full):  # only the newly full blocks' tokens are read
            chunk = tuple(req.token_slice(i * bs, (i + 1) * bs + extra))
            h = chain_hash(req.block_hashes[-1] if req.block_hashes else None, chunk)
            block = self.blocks[req.block_ids[i]]
            block.hash, block.token_ids = h, chunk
            self.hash_to_block.setdefault(h, block.block_id)
            req.block_hashes.append(h)

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_ids[owner_rank(block_id, self.num_pools)].append(block_id)

    def free(self, req: Request) -> None:
        # Tail blocks first, so the least reusable part of a prefix is evicted first.
        for block_id in reversed(req.block_ids):
            self._release(block_id)
        req.block_ids, req.block_hashes = [], []
