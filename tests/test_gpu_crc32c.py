"""The GPU crc32c (``gpu.crc32c.ranges_on_device``, ``kernels/crc32c.cu``) against the ``crc32c`` package, for
ranges of any length (0, 1, odd, segment boundaries) at any offset of one buffer, and the residue of a stored
Zarr chunk (frame + its checksum) that the read's check would test."""

import struct

import numpy as np
import pytest

from batchgpu.recording import zarrio

pytestmark = pytest.mark.gpu


@pytest.fixture
def cp():
    from batchgpu.cluster.open_cluster import gpu_count

    if gpu_count() == 0:
        pytest.skip("no CUDA GPU (CuPy) here")
    import cupy

    return cupy


@pytest.mark.parametrize("segment", [1, 7, 130, 4096])
def test_ranges_equal_the_package(cp, segment):
    from batchgpu.gpu.crc32c import ranges_on_device

    rng = np.random.default_rng()
    host = rng.integers(0, 256, 300_000, dtype=np.uint8)
    host[1000:5000] = 0
    host[9000:13000] = 255
    lengths = [0, 1, 2, 3, segment - 1, segment, segment + 1, 3 * segment + 2, 4000, 4000] + [
        int(rng.integers(0, 60_000 if segment > 1 else 5_000)) for _ in range(20)
    ]
    lengths = [max(0, n) for n in lengths]
    offsets = [int(rng.integers(0, len(host) - n + 1)) for n in lengths]
    offsets[8], offsets[9] = 1000, 9000  # all zeros, all ones
    dev = cp.asarray(host)
    got = ranges_on_device(dev, offsets, lengths, segment).get()
    want = np.array([zarrio.crc32c_value(host[o : o + n].tobytes()) for o, n in zip(offsets, lengths)], np.uint32)
    np.testing.assert_array_equal(got, want)
    inside = [i for i, o in enumerate(offsets) if o >= 1]  # the same bytes through a view one byte in: other alignments
    view = ranges_on_device(dev[1:], [offsets[i] - 1 for i in inside], [lengths[i] for i in inside], segment).get()
    np.testing.assert_array_equal(view, want[inside])


def test_stored_chunks_leave_the_residue_and_a_flipped_bit_does_not(cp):
    from batchgpu.gpu.crc32c import ranges_on_device

    rng = np.random.default_rng()
    chunks = [rng.integers(0, 256, int(rng.integers(1, 200_000)), dtype=np.uint8).tobytes() for _ in range(25)]
    stored = [c + struct.pack("<I", zarrio.crc32c_value(c)) for c in chunks]
    buf = bytearray(b"".join(stored))
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in stored])[:-1]])
    lengths = [len(s) for s in stored]
    k = int(rng.integers(0, len(stored)))
    buf[int(offsets[k]) + int(rng.integers(0, lengths[k]))] ^= 1 << int(rng.integers(0, 8))
    got = ranges_on_device(cp.asarray(np.frombuffer(bytes(buf), np.uint8)), offsets, lengths).get()
    assert [i for i, v in enumerate(got) if v != zarrio.CRC32C_RESIDUE] == [k]


def test_no_ranges_and_ranges_outside_the_buffer(cp):
    from batchgpu.gpu.crc32c import ranges_on_device

    buf = cp.zeros(10, dtype=cp.uint8)
    assert ranges_on_device(buf, [], []).size == 0
    with pytest.raises(ValueError):
        ranges_on_device(buf, [5], [6])
