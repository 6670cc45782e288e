"""The KV pool: every layer's keys and values for a fixed number of blocks, allocated up front.

Storage is flat by slot, slot = block * block_size + offset, so a request's KV is addressed by
slot indices computed from its block table; the bookkeeping of who holds which block is the
`BlockAllocator`'s.
"""

from __future__ import annotations

import torch

from kvsplice.errors import OutOfBlocksError
from kvsplice.kv.allocator import BlockAllocator
from kvsplice.model_config import ModelConfig


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


class KVPool:
    def __init__(
        self, cfg: ModelConfig, budget_bytes: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        num_blocks = budget_bytes // bytes_per_block(cfg, block_size, dtype)
        if num_blocks < 1:
            raise OutOfBlocksError(
                f"a KV budget of {budget_bytes} bytes holds no block of {block_size} tokens "
                f"({bytes_per_block(cfg, block_size, dtype)} bytes each for this model)"
            )
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.bytes_per_block = bytes_per_block(cfg, block_size, dtype)
        self.dtype = dtype
        self.device = device
        shape = (cfg.num_layers, num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
        # [layer, slot, kv_head, head_dim]
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.allocator = BlockAllocator(num_blocks, block_size)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def slots(self, block_table: list[int], positions: torch.Tensor) -> torch.Tensor:
        """Slot of each position of a sequence. positions: [N] int64 -> [N] int64."""
        table = torch.tensor(block_table, dtype=torch.int64, device=positions.device)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots: [N]; k, v: [N, Hkv, D]."""
        self.k[layer, slots] = k.to(self.dtype)
        self.v[layer, slots] = v.to(self.dtype)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """slots: [...] -> k, v: [..., Hkv, D]."""
        return self.k[layer, slots], self.v[layer, slots]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's KV from slots `src` to slots `dst` ([N] each)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def used_bytes(self) -> int:
        return self.allocator.num_used * self.bytes_per_block
