"""The trust gate's samples in the tiers below the pool (repair/gate.py says what they are).

Read when the engine starts, so a restarted engine does not calibrate again; merged with what the tiers
hold and written back every SYNC_S seconds while the gate learns, and at close. Replicas that share a
Redis share one record per model and KV format: each merges the others' samples into its own before it
writes, so a prompt shape calibrates once for all of them, not once per replica. Two replicas that
write at once may each drop the other's newest samples from the record; each writes again while the
record lacks some of its own, so none is lost for long. A tier that is down costs the sharing, never a
request: reads answer nothing and writes are dropped (tiers/tier.py).
"""

from __future__ import annotations

import time

from kvsplice.repair.gate import TrustGate
from kvsplice.tiers.tiered import TieredStore

# Seconds between merges while the engine runs: a calibrating replica picks up another's samples
# within a few requests, and a record of a few KiB read and written that often costs nothing.
SYNC_S = 10.0


class GateSync:
    def __init__(self, gate: TrustGate, store: TieredStore) -> None:
        self.gate = gate
        self.store = store
        # One record per model and KV format: samples of another model would mean nothing here.
        self.key = f"gate-{store.fingerprint.digest.hex()}"
        self._synced_at = time.monotonic()
        self._taken = gate.taken
        for data in store.blobs(self.key):
            gate.merge(data)

    def tick(self) -> None:
        """Merge and write back, at most every SYNC_S seconds."""
        if time.monotonic() - self._synced_at >= SYNC_S:
            self.sync()

    def sync(self) -> None:
        """Take the samples the tiers hold that the gate lacks, and write the gate's back where they
        lack some of its own (or it took new ones since the last write)."""
        self._synced_at = time.monotonic()
        records = self.store.blobs(self.key)
        missing = not records
        for data in records:
            missing |= self.gate.merge(data).missing > 0
        if missing or self.gate.taken != self._taken:
            self._taken = self.gate.taken
            self.store.put_blob(self.key, self.gate.to_bytes())
