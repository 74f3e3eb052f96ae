"""Paged KV block accounting with automatic prefix caching.

Blocks have reference counts. A *full* block whose K/V are computed gets a chained hash
hash(parent hash, its token ids, namespace) and enters the prefix table; later requests whose
prompts start with the same tokens reuse it instead of recomputing. Freed blocks keep their
hash and wait in an LRU free list (OrderedDict: O(1) push, pop and removal): plain blocks go to
the front (reused first, nothing to lose), cached ones to the back, and a request's blocks are
freed tail-first so a shared head outlives its tails. A cached block is evicted only when the
free list hands it out again.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Sequence as Seq

from .sequence import Sequence


class Block:
    __slots__ = ("id", "ref", "hash", "parent", "tokens", "namespace")

    def __init__(self, block_id: int):
        self.id = block_id
        self.ref = 0
        self.hash: int | None = None
        # The parent's hash, the tokens and the namespace are kept to reject hash collisions: a
        # cached block is reused only where it holds the same tokens after the same prefix, for the
        # same tenant (prefix-cache isolation must not rest on a 64-bit hash alone).
        self.parent: int | None = None
        self.tokens: tuple[int, ...] | None = None
        self.namespace: Hashable = None


    def holds(self, parent: int | None, tokens: tuple[int, ...], namespace: Hashable) -> bool:
        return self.tokens == tokens and self.parent == parent and self.namespace == namespace


def block_hash(parent: int | None, tokens: tuple[int, ...], namespace: Hashable = None) -> int:
    return hash((parent, tokens, namespace))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = True):
        if num_blocks <= 0:
            raise ValueError("the KV pool needs at least one block")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.table: dict[int, int] = {}         # hash -> block id
        self.num_cached_free = 0                # free blocks that still hold a cached prefix
        self.prefix_cache = prefix_cache
        self.queried_tokens = 0                 # prompt tokens looked up in the prefix table
        self.hit_tokens = 0

    # ---- counts ---------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks with no owner (some of them still cached): what allocation can use."""
        return len(self.free)

    @property
    def num_used(self) -> int:
        return len(self.blocks) - len(self.free)

    @property
    def hit_rate(self) -> float | None:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else None

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ---------------------------------------------------------------------
    def set_prefix_cache(self, enabled: bool) -> None:
        if not enabled:
            for b in self.blocks:
                b.hash = b.parent = b.tokens = b.namespace = None
            self.table.clear()
            self.num_cached_free = 0
        self.prefix_cache = enabled

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks covering the head of seq's tokens; return the tokens covered.

        Never the last token: something must be computed to get logits.
        """
        assert not seq.block_table, "prefix matching happens before any allocation"
        tokens = seq.token_ids
        if not self.prefix_cache:
            return 0
        bs = self.block_size
        parent = None
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = block_hash(parent, chunk, seq.namespace)
            bid = self.table.get(h)
            if bid is None or not self.blocks[bid].holds(parent, chunk, seq.namespace):
                break
            self._take(self.blocks[bid])
            seq.block_table.append(bid)
            seq.block_hashes.append(h)
            parent = h
        return len(seq.block_table) * bs

    def record_lookup(self, queried: int, hit: int) -> None:
        self.queried_tokens += queried
        self.hit_tokens += hit

    def commit(self, seq: Sequence, num_verified_tokens: int) -> None:
        """Enter seq's full, computed and verified blocks into the prefix table."""
        if not self.prefix_cache:
            return
        bs = self.block_size
        for i in range(len(seq.block_hashes), num_verified_tokens // bs):
            chunk = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = block_hash(parent, chunk, seq.namespace)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.table:
                block.hash, block.parent, block.tokens, block.namespace = h, parent, chunk, seq.namespace
                self.table[h] = block.id

    # ---- allocation -----------------------------------------------------------------------
    def ensure_capacity(self, seq: Sequence, num_tokens: int) -> bool:
        """Give seq enough blocks to hold num_tokens tokens; False (nothing taken) if the pool can't."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need > len(self.free):
            return False
        for _ in range(need):
            bid = next(iter(self.free))
            block = self.blocks[bid]
            if block.hash is not None:            # reuse evicts the cached prefix it held
                if self.table.get(block.hash) == bid:
                    del self.table[block.hash]
                block.hash = block.parent = block.tokens = block.namespace = None
                self.num_cached_free -= 1
            self._take(block)
            seq.block_table.append(bid)
        return True

    def free_seq(self, seq: Sequence) -> None:
        """Release all of seq's blocks, tail first."""
        self._release(reversed(seq.block_table))
        seq.block_table.clear()
        seq.block_hashes.clear()

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep only the blocks needed for num_tokens tokens (rollback of unverified tokens)."""
        keep = self.blocks_for(num_tokens)
        tail = seq.block_table[keep:]
        del seq.block_table[keep:]
        del seq.block_hashes[num_tokens // self.block_size:]
        self._release(reversed(tail))

    def _take(self, block: Block) -> None:
        if block.ref == 0:
            del self.free[block.id]
            if block.hash is not None:
                self.num_cached_free -= 1
        block.ref += 1

    def _release(self, block_ids: Seq[int]) -> None:
        for bid in block_ids:
            block = self.blocks[bid]
            block.ref -= 1
            assert block.ref >= 0, f"block {bid} freed twice"
            if block.ref == 0:
                self.free[bid] = None
                if block.hash is not None:
                    self.num_cached_free += 1      # back of the LRU: evicted last
                else:
                    self.free.move_to_end(bid, last=False)
