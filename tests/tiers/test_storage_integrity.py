"""What a stored page is keyed by, and that nothing but a verified page of the same key is read:
another model, page size, dtype, scales, layout, TP, layers, namespace or format is a miss; a
torn entry, a flipped byte, or an entry moved under another name is refused, counted, deleted."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvjax.tiers.storage import StorageTier, page_hashes
from kvjax.tiers.storage_entry import HEADER_BYTES, REJECT_REASONS, decode_entry, encode_entry
from kvjax.tiers.storage_key import FORMAT_VERSION, StorageKey

PAGE = (2, 4, 2, 8)  # layers, page_size, 2 * kv_heads, head_dim
KEY = StorageKey(model="ckpt-a", page_shape=PAGE, store_dtype="uint16", kv_dtype="bfloat16")
HASHES = page_hashes(list(range(16)), 4)


def _pages(n: int, shape=PAGE, dtype=np.uint16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**8, (n, *shape)).astype(dtype)


def _written(location, key: StorageKey = KEY) -> tuple[StorageTier, np.ndarray]:
    tier = StorageTier(location, key=key)
    pages = _pages(len(HASHES), key.page_shape, key.store_dtype)
    assert tier.backup(HASHES, pages).wait() == len(HASHES)
    return tier, pages


VARIANTS = {
    "model": dict(model="ckpt-b"),
    "page size": dict(page_shape=(2, 8, 2, 8)),
    "store dtype": dict(store_dtype="uint8", kv_dtype="float8_e4m3fn"),
    "kv dtype": dict(kv_dtype="float16"),
    "scales": dict(kv_scales=(1.0, 2.0, 1.0, 1.0)),
    "layout": dict(layout="mla/page_first"),
    "tp rank": dict(tp_rank=1, tp_size=2),
    "tp size": dict(tp_size=2),
    "layers": dict(layers=(2, 3)),
    "namespace": dict(namespace="tenant-b"),
    "format": dict(version=FORMAT_VERSION + 1),
}


def test_every_field_of_the_key_changes_its_digest_and_equal_keys_agree():
    digests = {name: dataclasses.replace(KEY, **change).digest for name, change in VARIANTS.items()}
    assert len(set(digests.values())) == len(VARIANTS) and KEY.digest not in digests.values()
    same = StorageKey(model="ckpt-a", page_shape=[2, 4, 2, 8], store_dtype=np.uint16, kv_dtype="bfloat16")
    assert same == KEY and same.digest == KEY.digest and len(KEY.digest) == 32
    assert KEY.layers == (0, 1) and KEY.page_size == 4 and KEY.page_bytes == 2 * 4 * 2 * 8 * 2
    assert KEY.to_dict()["page_shape"] == [2, 4, 2, 8]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_a_store_written_under_another_key_is_never_read(tmp_path, name):
    _written(str(tmp_path))
    key = dataclasses.replace(KEY, **VARIANTS[name])
    other = StorageTier(str(tmp_path), key=key)
    assert other.leading_hits(HASHES) == 0 and not other.contains(HASHES[0])
    assert other.get(HASHES).shape == (0, *key.page_shape)
    assert other.rejected_entries == 0  # nothing of another key is even looked at


def test_the_same_key_reads_its_pages_back_and_records_the_key(tmp_path):
    _, pages = _written(str(tmp_path))
    again = StorageTier(str(tmp_path), key=KEY)
    np.testing.assert_array_equal(again.get(HASHES), pages)
    assert (tmp_path / KEY.digest / "key.json").is_file()


def test_a_truncated_entry_is_a_miss_counted_warned_once_and_deleted(tmp_path, caplog):
    tier, pages = _written(str(tmp_path))
    for h in HASHES[1:3]:
        path = tmp_path / tier.key(h)
        path.write_bytes(path.read_bytes()[:-5])
    reader = StorageTier(str(tmp_path), key=KEY)
    with caplog.at_level("WARNING", logger="kvjax.tiers.storage"):
        assert reader.leading_hits(HASHES) == 1
        assert reader.leading_hits(HASHES[2:]) == 0
    assert reader.rejected == {"torn": 2}
    assert sum("refused entry" in r.message for r in caplog.records) == 1
    reader.flush()
    assert not (tmp_path / tier.key(HASHES[1])).exists()  # deleted: the next backup rewrites it
    assert reader.backup(HASHES, pages).wait() == 2
    np.testing.assert_array_equal(reader.get(HASHES), pages)


def test_a_flipped_byte_is_caught_when_the_page_is_taken(tmp_path):
    tier, pages = _written(str(tmp_path))
    path = tmp_path / tier.key(HASHES[2])
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES + 100] ^= 0x01
    path.write_bytes(bytes(data))
    reader = StorageTier(str(tmp_path), key=KEY)
    assert reader.leading_hits(HASHES) == 4  # the header is intact
    got = reader.get(HASHES)
    np.testing.assert_array_equal(got, pages[:2])  # the run ends before the damaged page
    assert reader.rejected == {"checksum": 1} and reader.pages_read == 2


def test_an_entry_moved_under_another_name_or_format_is_refused(tmp_path):
    tier, _ = _written(str(tmp_path))
    first = (tmp_path / tier.key(HASHES[0])).read_bytes()
    (tmp_path / tier.key(HASHES[1])).write_bytes(first)  # page 0's entry under page 1's name
    other = dataclasses.replace(KEY, model="ckpt-b")
    (tmp_path / other.digest).mkdir()
    (tmp_path / other.digest / tier.key(HASHES[0]).split("/")[1]).write_bytes(first)  # into another key
    old = bytearray(first)
    old[6] ^= 0xFF  # the version field
    (tmp_path / tier.key(HASHES[2])).write_bytes(bytes(old))
    reader = StorageTier(str(tmp_path), key=KEY)
    assert reader.contains(HASHES[0]) and not reader.contains(HASHES[1]) and not reader.contains(HASHES[2])
    assert not StorageTier(str(tmp_path), key=other).contains(HASHES[0])
    assert reader.rejected == {"other page": 1, "format": 1}


def test_decode_refuses_every_kind_of_damage_by_name_and_never_raises():
    payload = _pages(1).tobytes()
    entry = encode_entry(FORMAT_VERSION, KEY.digest, 7, payload)
    args = (FORMAT_VERSION, KEY.digest, 7, len(payload))
    assert bytes(decode_entry(entry, *args)[0]) == payload
    cases = {
        b"": "torn",
        entry[:-1]: "torn",
        entry + b"\0": "torn",
        b"XXXXXX" + entry[6:]: "format",
        entry[: 6 + 2] + bytes(16) + entry[24:]: "other key",
    }
    for raw, reason in cases.items():
        assert decode_entry(raw, *args) == (None, reason)
    assert decode_entry(entry, FORMAT_VERSION, KEY.digest, 8, len(payload)) == (None, "other page")
    for i in range(0, len(entry), 37):  # one flipped bit anywhere is refused
        damaged = bytearray(entry)
        damaged[i] ^= 0x04
        page, reason = decode_entry(bytes(damaged), *args)
        assert page is None and reason in REJECT_REASONS
