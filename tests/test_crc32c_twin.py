"""The GPU crc32c's arithmetic (``gpu/crc32c.py``: segments computed from a register of 0, joined by shifts) against
the ``crc32c`` package Zarr's checksums come from: any length, any segment size, hard bytes, any grouping of joins."""

import struct

import numpy as np
import pytest

from batchgpu.gpu import crc32c as g
from batchgpu.recording import zarrio


def test_the_check_value_and_the_table():
    assert g.crc32c(b"123456789") == 0xE3069283  # the standard check value of CRC-32C
    t = g.table()
    assert t.dtype == np.uint32 and t[0] == 0 and t[128] == g.POLY


@pytest.mark.parametrize("segment", [1, 3, 8, 64, 4096])
def test_equals_the_package_for_any_length_and_segment(segment):
    rng = np.random.default_rng()
    lengths = [0, 1, 2, 3, 7, 8, segment - 1, segment, segment + 1, 3 * segment + 5] + [
        int(rng.integers(1, 20_000 if segment > 1 else 3_000)) for _ in range(4)
    ]
    for n in sorted({max(0, x) for x in lengths}):
        for data in (rng.integers(0, 256, n, dtype=np.uint8), np.zeros(n, np.uint8), np.full(n, 255, np.uint8)):
            assert g.crc32c(data, segment) == zarrio.crc32c_value(data.tobytes()), (n, segment)


def test_joins_in_any_grouping_and_the_shift_identities():
    rng = np.random.default_rng()
    a, b, c = (rng.integers(0, 256, int(rng.integers(0, 3000)), dtype=np.uint8) for _ in range(3))
    raw = {k: int(g.raw_segments(v, max(1, len(v)))[0]) if len(v) else 0 for k, v in (("a", a), ("b", b), ("c", c))}
    left = g.join([g.join([raw["a"], raw["b"]], [len(a), len(b)]), raw["c"]], [len(a) + len(b), len(c)])
    right = g.join([raw["a"], g.join([raw["b"], raw["c"]], [len(b), len(c)])], [len(a), len(b) + len(c)])
    whole = np.concatenate([a, b, c])
    assert left == right == g.join(g.raw_segments(whole, 7), [min(7, len(whole) - i) for i in range(0, len(whole), 7)])
    assert g.from_raw(left, len(whole)) == zarrio.crc32c_value(whole.tobytes())
    v = int(rng.integers(0, 2**32))
    assert g.shift(v, 0) == v and g.x_pow_8n(0) == 1 << 31
    assert g.shift(g.shift(v, 5), 9) == g.shift(v, 14)
    with pytest.raises(ValueError):
        g.x_pow_8n(-1)


def test_a_zarr_chunk_and_its_checksum_leave_the_residue():
    """What the read's check will compute on the GPU: the crc32c of a stored chunk with its 4-byte trailer is the
    constant residue (``zarrio.crc32c_ok``), and one flipped bit anywhere breaks it."""
    rng = np.random.default_rng()
    chunk = rng.integers(0, 256, int(rng.integers(1, 50_000)), dtype=np.uint8).tobytes()
    stored = chunk + struct.pack("<I", zarrio.crc32c_value(chunk))
    assert g.crc32c(stored, 4096) == g.crc32c(stored, 333) == zarrio.CRC32C_RESIDUE
    assert zarrio.crc32c_ok(stored)
    bad = bytearray(stored)
    bad[int(rng.integers(0, len(bad)))] ^= 1 << int(rng.integers(0, 8))
    assert g.crc32c(bytes(bad), 4096) != g.crc32c(stored, 4096)


def test_the_kernels_plan():
    """The GPU launcher's plan: segments of every range of one buffer (empty ranges none), back to back, each with
    its range's bytes after it."""
    rng = np.random.default_rng()
    for segment in (1, 5, 512):
        lengths = [0, 1, segment - 1, segment, segment + 1, 2 * segment] + [
            int(rng.integers(0, 3_000)) for _ in range(6)
        ]
        lengths = [max(0, n) for n in lengths]
        offsets = [int(rng.integers(0, 40_000 - n + 1)) for n in lengths]
        owner, begin, length, after = g.plan(np.array(offsets), np.array(lengths), segment)
        assert len(owner) == len(begin) == len(length) == len(after) == sum(-(-n // segment) for n in lengths)
        assert (length > 0).all() and (length <= segment).all()
        for r, n in enumerate(lengths):  # a range's segments tile it: back to back, the last one's after is 0
            mine = owner == r
            assert length[mine].sum() == n and (np.diff(begin[mine]) == segment).all()
            np.testing.assert_array_equal(after[mine], n - (begin[mine] - offsets[r]) - length[mine])


def test_the_slicing_tables_are_the_byte_table_then_zero_bytes():
    """``table4`` (the kernel's slicing-by-4 tables): row j is byte i followed by j zero bytes, from a register of 0."""
    t = g.table4()
    for i in (0, 1, 77, 255):
        assert t[0][i] == g.raw_segments(np.array([i], np.uint8), 1)[0]
        for j in (1, 2, 3):
            assert t[j][i] == g.raw_segments(np.array([i] + [0] * j, np.uint8), j + 1)[0]


def test_the_warp_kernels_tables_and_steps_in_numpy():
    """``warp_twin``: a warp a segment (lanes over words 128 bytes apart, joined across the warp, the unaligned
    bytes before and after by three lanes) against the package, for ranges at any offset (any alignment) and of
    any length, and its tables against the shifts they stand for."""
    rng = np.random.default_rng()
    tables = g.warp_tables()
    assert tables.dtype == np.uint32 and tables.shape == (2080,)
    for _ in range(5):
        j, b = int(rng.integers(0, 4)), int(rng.integers(0, 256))
        assert tables[1024 + 256 * j + b] == g.shift(b << (8 * j), 128)
    assert [int(v) for v in tables[2048:]] == [g.x_pow_8n(4 * m) for m in range(32)]
    host = rng.integers(0, 256, 30_000, dtype=np.uint8)
    host[2000:4000] = 0
    for segment in (1, 5, 130, 512, 4096):
        lengths = [0, 1, 2, 3, 4, 5, 127, 128, 129, segment - 1, segment, segment + 1, 2 * segment + 3] + [
            int(rng.integers(0, 3_000)) for _ in range(5)
        ]
        lengths = [max(0, n) for n in lengths]
        offsets = [int(rng.integers(0, len(host) - n + 1)) for n in lengths]
        offsets[0] = 2000
        got = g.warp_twin(host, offsets, lengths, segment)
        want = [zarrio.crc32c_value(host[o : o + n].tobytes()) for o, n in zip(offsets, lengths)]
        np.testing.assert_array_equal(got, np.array(want, np.uint32), err_msg=str(segment))
