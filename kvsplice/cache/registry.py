"""Prefix caches by name: `off`, `hash` (vLLM's hash chain), `radix` (SGLang's radix tree)."""

from __future__ import annotations

from kvsplice.cache.base import NoPrefixCache, PrefixCache
from kvsplice.cache.hash_chain import HashChainCache
from kvsplice.cache.radix import RadixCache
from kvsplice.kv.allocator import BlockAllocator

PREFIX_CACHES: dict[str, type[PrefixCache]] = {
    cls.name: cls for cls in (NoPrefixCache, HashChainCache, RadixCache)
}
PREFIX_CACHE_NAMES = tuple(PREFIX_CACHES)


def make_prefix_cache(name: str, allocator: BlockAllocator) -> PrefixCache:
    if name not in PREFIX_CACHES:
        raise ValueError(f"unknown prefix cache {name!r}; choose one of {PREFIX_CACHE_NAMES}")
    return PREFIX_CACHES[name](allocator)
