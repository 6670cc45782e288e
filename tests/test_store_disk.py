"""The disk tier, alone and behind a TieredStore: atomic writes, LRU under its byte budget, clear
errors at start-up, counted errors (never exceptions) at run time, and corrupt files never served."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest

import kvsplice.tiers.disk as disk_module
from kvsplice.errors import ConfigError
from kvsplice.tiers import DiskTier, TieredStore, encode_entry, entry_key
from tests.test_store_support import assert_same_kv, fingerprint, segment

FP = fingerprint()


def store_on(tier: DiskTier) -> TieredStore:
    return TieredStore(FP, [tier])


def test_round_trip_through_the_store_and_across_a_restart(tmp_path: Path) -> None:
    tokens, kv = segment(30)
    store = store_on(DiskTier(tmp_path, 10**7))
    assert store.get("", tokens) is None
    store.put("", tokens, kv)
    assert store.flush()
    hit = store.get("", tokens)
    assert hit is not None and hit.tier == "disk" and hit.nbytes > kv.nbytes
    assert_same_kv(hit.kv, kv)
    store.close()
    # A new process (a new tier on the same directory) finds it.
    again = store_on(DiskTier(tmp_path, 10**7))
    hit = again.get("", tokens)
    assert hit is not None
    assert_same_kv(hit.kv, kv)
    s = again.stats()["disk"]
    assert (s.hits, s.misses, s.corrupt, s.errors) == (1, 0, 0, 0)
    assert s.bytes_read == hit.nbytes and s.load_seconds > 0


def test_salts_never_cross(tmp_path: Path) -> None:
    tokens, kv = segment(10)
    store = store_on(DiskTier(tmp_path, 10**7))
    store.put("tenant-a", tokens, kv)
    assert store.flush()
    assert store.get("tenant-b", tokens) is None
    assert store.get("", tokens) is None
    assert store.get("tenant-a", tokens) is not None


def test_least_recently_used_entries_go_first_and_the_budget_holds(tmp_path: Path) -> None:
    entries = [segment(16, seed) for seed in range(4)]
    size = len(encode_entry(FP, "", entries[0][0], entries[0][1], "float32"))
    tier = DiskTier(tmp_path, 3 * size + size // 2)  # room for three
    store = store_on(tier)
    for tokens, kv in entries[:3]:
        store.put("", tokens, kv)
        assert store.flush()
    assert store.get("", entries[0][0]) is not None  # 0 is now more recent than 1
    store.put("", *entries[3])
    assert store.flush()
    assert tier.used_bytes <= tier.budget_bytes
    assert store.get("", entries[1][0]) is None
    for i in (0, 2, 3):
        assert store.get("", entries[i][0]) is not None
    assert store.stats()["disk"].evictions == 1
    assert len(list(tmp_path.glob("*.kv"))) == 3


def test_a_restart_evicts_by_last_access_and_honours_a_smaller_budget(tmp_path: Path) -> None:
    entries = [segment(16, seed) for seed in range(3)]
    size = len(encode_entry(FP, "", entries[0][0], entries[0][1], "float32"))
    store = store_on(DiskTier(tmp_path, 10 * size))
    for tokens, kv in entries:
        store.put("", tokens, kv)
    assert store.flush()
    # Last access: entry 1 oldest, then 2, then 0.
    for i, t in ((1, 1000), (2, 2000), (0, 3000)):
        os.utime(tmp_path / (entry_key(FP, "", entries[i][0]) + ".kv"), (t, t))
    tier = DiskTier(tmp_path, 2 * size)  # the budget shrank: one must go at start-up
    assert tier.used_bytes == 2 * size
    assert not (tmp_path / (entry_key(FP, "", entries[1][0]) + ".kv")).exists()


def test_an_entry_over_the_budget_is_dropped_not_written(tmp_path: Path) -> None:
    tokens, kv = segment(64)
    store = store_on(DiskTier(tmp_path, 1000))
    store.put("", tokens, kv)
    assert store.flush()
    s = store.stats()["disk"]
    assert (s.writes, s.dropped_writes) == (0, 1)
    assert list(tmp_path.iterdir()) == []


def test_truncated_and_bit_flipped_files_are_deleted_counted_and_missed(tmp_path: Path) -> None:
    store = store_on(DiskTier(tmp_path, 10**7))
    cut_tokens, cut_kv = segment(20, 1)
    flip_tokens, flip_kv = segment(20, 2)
    store.put("", cut_tokens, cut_kv)
    store.put("", flip_tokens, flip_kv)
    assert store.flush()
    cut = tmp_path / (entry_key(FP, "", cut_tokens) + ".kv")
    flip = tmp_path / (entry_key(FP, "", flip_tokens) + ".kv")
    os.truncate(cut, cut.stat().st_size // 2)  # a crash mid-write without fsync looks like this
    data = bytearray(flip.read_bytes())
    data[len(data) // 3] ^= 0x10
    flip.write_bytes(data)
    assert store.get("", cut_tokens) is None
    assert store.get("", flip_tokens) is None
    assert not cut.exists() and not flip.exists()
    s = store.stats()["disk"]
    assert (s.corrupt, s.misses, s.hits) == (2, 2, 0)
    # The next write puts a good copy back.
    store.put("", cut_tokens, cut_kv)
    assert store.flush()
    assert store.get("", cut_tokens) is not None


def test_a_forged_file_is_refused(tmp_path: Path) -> None:
    """Another model's valid entry copied under this model's key."""
    tokens, kv = segment(12)
    other = fingerprint(model_hash="weights-b")
    forged = encode_entry(other, "", tokens, kv, "float32")
    (tmp_path / (entry_key(FP, "", tokens) + ".kv")).write_bytes(forged)
    store = store_on(DiskTier(tmp_path, 10**7))
    assert store.get("", tokens) is None
    assert store.stats()["disk"].corrupt == 1
    assert list(tmp_path.glob("*.kv")) == []


def test_two_writers_of_one_key_leave_one_whole_entry_and_readers_never_see_a_part(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 10**8)
    versions = [bytes([i]) * 300_000 for i in range(2)]
    key = "ab" * 32
    seen: set[bytes] = set()
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            data = tier.get(key)
            if data is not None:
                seen.add(bytes(data[:1]) + bytes([len(set(data))]) + len(data).to_bytes(4, "big"))

    def write(i: int) -> None:
        for _ in range(30):
            assert tier.put(key, versions[i])

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(i,)) for i in range(2)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    reader.join()
    final = tier.get(key)
    assert final is not None and bytes(final) in versions
    # Every read saw one version whole: one distinct byte value, full length.
    assert seen <= {bytes([i, 1]) + (300_000).to_bytes(4, "big") for i in range(2)}
    assert [p.name for p in tmp_path.iterdir()] == [key + ".kv"]  # no temporary file left behind
    assert tier.used_bytes == 300_000


def test_directory_that_cannot_be_created_or_written_is_a_start_up_error(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match="store_dir"):
        DiskTier(a_file / "store", 10**6)
    with pytest.raises(ConfigError, match="store_dir"):
        DiskTier(a_file, 10**6)
    # Exists, is a directory, but refuses new files, even to root.
    with pytest.raises(ConfigError, match="cannot be created or written"):
        DiskTier("/proc/self/fdinfo", 10**6)
    if os.geteuid() != 0:  # root ignores permission bits
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ConfigError):
            DiskTier(locked, 10**6)


def test_a_full_disk_at_run_time_is_counted_and_the_store_keeps_working(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens, kv = segment(10, 1)
    store = store_on(DiskTier(tmp_path, 10**7))
    store.put("", tokens, kv)
    assert store.flush()
    real_open = open

    def full_disk(path: object, mode: str = "r", *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        if "w" in mode:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(disk_module, "open", full_disk, raising=False)
    other_tokens, other_kv = segment(10, 2)
    store.put("", other_tokens, other_kv)  # no exception here, nor in the writer
    assert store.flush()
    assert store.get("", other_tokens) is None
    assert store.get("", tokens) is not None  # what is there is still served
    s = store.stats()["disk"]
    assert (s.errors, s.writes, s.hits) == (1, 1, 1)
    assert [p.suffix for p in tmp_path.iterdir()] == [".kv"]  # the failed temporary file is gone
