"""The reuse path of a prefill: plan (exact / spliced / compute spans), place (move stored segment KV to
its new positions), repair (the policy's passes). `ReusePath.prepare` is its entry point."""
