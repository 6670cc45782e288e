"""The entry format: what goes in comes out, keys separate what must never meet, and any change to
the bytes (a flipped bit, a cut, another entry's header) is refused."""

from __future__ import annotations

import hashlib
import random

import pytest
import torch

from kvsplice.tiers import CorruptEntryError, LayerKV, SegmentKV, decode_entry, encode_entry, entry_key
from kvsplice.tiers.entry import DIGEST_BYTES
from tests.test_store_support import assert_same_kv, fingerprint, random_kv, segment

FP = fingerprint()


def test_round_trip_float32_is_exact() -> None:
    tokens, kv = segment(37)
    data = encode_entry(FP, "tenant-a", tokens, kv, "float32")
    assert_same_kv(decode_entry(data, FP, "tenant-a", tokens), kv)
    # bytes (as Redis returns them) decode as well as a bytearray (as the disk tier returns them)
    assert_same_kv(decode_entry(bytes(data), FP, "tenant-a", tokens), kv)


@pytest.mark.parametrize("store_dtype", ["float16", "bfloat16"])
def test_smaller_store_dtype_halves_the_payload_and_decodes_to_the_kv_dtype(store_dtype: str) -> None:
    tokens, kv = segment(64)
    full = encode_entry(FP, "", tokens, kv, "float32")
    half = encode_entry(FP, "", tokens, kv, store_dtype)
    assert len(half) < 0.55 * len(full)
    out = decode_entry(half, FP, "", tokens)
    dtype = getattr(torch, store_dtype)
    for a, b in zip(out.layers, kv.layers, strict=True):
        assert a is not None and b is not None
        assert a.k.dtype == torch.float32
        assert torch.equal(a.k, b.k.to(dtype).float()) and torch.equal(a.v, b.v.to(dtype).float())


def test_layers_can_keep_a_token_range_or_nothing() -> None:
    k, v = random_kv(50)
    tokens = list(range(50))
    # Layer 0 full, layer 1 only its last 16 tokens (a sliding-window layer), layer 2 absent, layer 3 empty.
    kv = SegmentKV.select(k, v, [(0, 50), (34, 50), None, (50, 50)])
    out = decode_entry(encode_entry(FP, "", tokens, kv, "float32"), FP, "", tokens)
    assert_same_kv(out, kv)
    layer1 = out.layers[1]
    assert layer1 is not None and (layer1.start, layer1.end) == (34, 50)
    assert torch.equal(layer1.k, k[1, 34:50])
    assert out.layers[2] is None
    smaller = encode_entry(FP, "", tokens, kv, "float32")
    assert len(smaller) < len(encode_entry(FP, "", tokens, SegmentKV.full(k, v), "float32")) * 0.6


def test_keys_differ_for_any_change_of_model_dtype_salt_or_tokens() -> None:
    tokens = [5, 6, 7]
    base = entry_key(FP, "", tokens)
    others = [
        entry_key(fingerprint(model_hash="weights-b"), "", tokens),
        entry_key(fingerprint(tokenizer_hash="tok-b"), "", tokens),
        entry_key(fingerprint(kv_dtype="bfloat16"), "", tokens),
        entry_key(fingerprint(compute_dtype="bfloat16"), "", tokens),
        entry_key(fingerprint(num_kv_heads=1), "", tokens),
        entry_key(fingerprint(rope="full:theta=1e4"), "", tokens),
        entry_key(fingerprint(context_tokens=(2, 7, 7)), "", tokens),
        entry_key(fingerprint(segment_contexts=4), "", tokens),
        entry_key(FP, "tenant-a", tokens),
        entry_key(FP, "", [5, 6]),
        entry_key(FP, "", [5, 6, 8]),
    ]
    assert len({base, *others}) == len(others) + 1
    assert entry_key(FP, "", tokens) == base == entry_key(fingerprint(), "", (5, 6, 7))


def test_every_flipped_bit_position_class_is_detected() -> None:
    tokens, kv = segment(20)
    data = encode_entry(FP, "", tokens, kv, "float16")
    rng = random.Random(0)
    # The prefix, the header, the payload, the digest itself.
    positions = [0, 9, 12, 20, 100, len(data) // 2, len(data) - DIGEST_BYTES - 1, len(data) - 1]
    positions += rng.sample(range(len(data)), 40)
    for pos in positions:
        bad = bytearray(data)
        bad[pos] ^= 1 << rng.randrange(8)
        with pytest.raises(CorruptEntryError):
            decode_entry(bad, FP, "", tokens)


@pytest.mark.parametrize("keep", [0, 5, 13, 100, -1])
def test_truncation_is_detected(keep: int) -> None:
    tokens, kv = segment(20)
    data = encode_entry(FP, "", tokens, kv, "float32")
    with pytest.raises(CorruptEntryError):
        decode_entry(data[:keep], FP, "", tokens)


def test_an_intact_entry_of_another_model_salt_or_tokens_is_refused() -> None:
    """A forged key: a whole, valid entry stored under the key of another one."""
    tokens, kv = segment(12)
    cases = [
        (encode_entry(fingerprint(model_hash="weights-b"), "", tokens, kv, "float32"), "another model"),
        (encode_entry(fingerprint(kv_dtype="bfloat16"), "", tokens, kv, "float32"), "another model"),
        (encode_entry(FP, "tenant-b", tokens, kv, "float32"), "namespace"),
        (encode_entry(FP, "", [t + 1 for t in tokens], kv, "float32"), "token ids"),
    ]
    for data, reason in cases:
        with pytest.raises(CorruptEntryError, match=reason):
            decode_entry(data, FP, "", tokens)


def test_a_valid_digest_over_a_lying_header_is_refused() -> None:
    """Bytes with a correct digest but a payload size that disagrees with the header."""
    tokens, kv = segment(8)
    data = encode_entry(FP, "", tokens, kv, "float32")
    body = bytes(data[:-DIGEST_BYTES]) + b"\0" * 64  # 64 more payload bytes than the header says
    forged = body + hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest()
    with pytest.raises(CorruptEntryError, match="payload"):
        decode_entry(forged, FP, "", tokens)


def test_layout_mismatch_is_a_caller_bug() -> None:
    tokens = [1, 2]
    layer = LayerKV(0, torch.zeros(2, 3, 8), torch.zeros(2, 3, 8))  # 3 heads, the fingerprint says 2
    wrong_heads = SegmentKV(2, (layer,) * 4)
    with pytest.raises(AssertionError):
        encode_entry(FP, "", tokens, wrong_heads, "float32")
    with pytest.raises(AssertionError):
        encode_entry(FP, "", [1, 2, 3], segment(2)[1], "float32")
