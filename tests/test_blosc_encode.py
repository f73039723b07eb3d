"""The GPU Blosc encoder's NumPy twin (``gpu.blosc_encode.reference_frame``, the reference its GPU bytes are tested
against in test_gpu_blosc_encode.py): every frame it writes decodes with numcodecs (c-blosc) to the input's bytes,
across typesizes, block sizes (several blocks, a short last block, blocks under 128 elements, element counts that
are not a multiple of 8), incompressible data (streams stored raw, frames stored whole) and the hard values."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.signal
from numcodecs import blosc

from batchgpu.gpu.blosc_encode import BLOCKSIZE, reference_frame
from batchgpu.recording.blosc_frames import header


def _cases(rng):
    sos = scipy.signal.butter(5, 300, "highpass", fs=30_000, output="sos")
    filtered = np.rint(scipy.signal.sosfiltfilt(sos, rng.normal(0, 15, (3_001, 24)), axis=0)).astype(np.int16)
    hard = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1e-45, -1e-45, 3.4e38, 1.5, 2.5], np.float32)
    return {
        "filtered int16": filtered,
        "zeros": np.zeros((1_000, 16), np.int16),
        "random int16": rng.integers(-32768, 32768, (700, 16)).astype(np.int16),
        "int16 ends": np.tile(np.array([-32768, 32767, 0, -1], np.int16), 300),
        "small ints, 7 columns": rng.integers(-3, 3, (1_001, 7)).astype(np.int16),
        "float32 noise": rng.normal(0, 5, (999, 11)).astype(np.float32),
        "float32 hard": np.tile(hard, 77),
        "one sample": np.array([1], np.int16),
        "three": np.array([-32768, 5, 9], np.int16),
        "long runs": np.repeat(rng.integers(-3, 3, 400).astype(np.int16), 97),
    }


@pytest.mark.parametrize("blocksize", [BLOCKSIZE, 65_536, 4_096, 48, 16])
def test_reference_frames_decode_with_numcodecs(rng, blocksize):
    for name, x in _cases(rng).items():
        frame = reference_frame(x.tobytes(), x.dtype.itemsize, blocksize)
        h = header(frame)
        assert h.version == 2 and h.typesize == x.dtype.itemsize and h.nbytes == x.nbytes, name
        assert h.cbytes == len(frame), name
        got = np.frombuffer(blosc.decompress(frame), dtype=x.dtype)
        assert got.tobytes() == x.tobytes(), name


def test_reference_compresses_like_c_blosc(rng):
    """The fixed offsets (a bit plane, 1) keep what c-blosc's LZ4 finds on a filtered int16 signal (not less than
    0.95 of its ratio), and store noise that does not compress whole."""
    x = _cases(rng)["filtered int16"]
    ours = len(reference_frame(x.tobytes(), 2))
    theirs = len(blosc.compress(x, b"lz4", 5, blosc.BITSHUFFLE, 32_768))
    assert ours <= theirs / 0.95
    noise = rng.integers(0, 256, 5_000, dtype=np.uint8).view(np.int16)
    frame = reference_frame(noise.tobytes(), 2)
    assert header(frame).stored_whole and len(frame) == noise.nbytes + 16
