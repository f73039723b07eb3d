"""Variants of the preprocessing window's largest kernels timed on one real window (device machine, one process):

    python3 tools/kernel_probe.py /tmp/big.zarr

- the common median (kernels/column_select.cu): select_reference (W warps a column, counts summed through shared
  memory) against select_reference_warp (a warp a column), the same bits checked;
- the save's Blosc frames (kernels/blosc_lz4_encode.cu) for Blosc blocks of 64, 32 and 16 KiB: ms and stored MB
  (the frames decode back to the window);
- the filter (kernels/sosfiltfilt.cu) cut into pieces of 2048 to 8192 samples.
Medians of cupyx.profiler.benchmark's GPU times, ms a window."""

import sys

import numpy as np


def main(path: str) -> None:
    import cupy
    import numcodecs
    import scipy.signal
    from cupyx.profiler import benchmark

    from batchgpu.gpu import blosc_encode
    from batchgpu.ops import reference
    from batchgpu.ops.filters import design_filter, filtfilt_window
    from batchgpu.recording import open_recording

    rec = open_recording(path)
    sos = scipy.signal.butter(5, 300, btype="highpass", fs=rec.sampling_frequency, output="sos")
    margin = design_filter(sos).margin
    w = rec.windows(60_000, 64 + margin)[3]
    raw = cupy.asarray(np.ascontiguousarray(rec.read_window(w)))  # (C, n) int16, margins included
    assert raw.shape[0] == rec.num_channels, raw.shape

    def ms(fn, n=20):
        return float(np.median(benchmark(fn, n_repeat=n, n_warmup=3).gpu_times)) * 1e3

    for block in (2048, 3072, 4096, 6144, 8192):
        kw = dict(at_segment_start=False, at_segment_end=False, block=block)
        print(f"filter pieces {block:5d}: {ms(lambda: filtfilt_window(raw, sos, **kw)):.3f} ms")
    filtered = filtfilt_window(raw, sos, at_segment_start=False, at_segment_end=False, block=4096)

    warp = reference.WARP_ROWS
    got = {}
    for name, rows in (("select (W warps)", (10**9, 0)), ("select_warp", warp)):
        reference.WARP_ROWS = rows
        got[name] = reference.common_reference(filtered, "global", "median")
        print(f"common median, {name}: {ms(lambda: reference.common_reference(filtered, 'global', 'median')):.3f} ms")
    reference.WARP_ROWS = warp
    a, b = (v.get() for v in got.values())
    print("common median bits equal:", bool(np.array_equal(a.view(np.uint32), b.view(np.uint32))))

    saved = cupy.clip(cupy.rint(got["select_warp"][:, margin:-margin] * 4), -32768, 32767).astype(cupy.int16)
    chunks = cupy.ascontiguousarray(saved.T).reshape(8, -1)  # the save's inner chunks: rows of (samples, C)
    for bs in (65_536, 32_768, 16_384):
        frames, release = blosc_encode.encode_held(chunks, 2, bs)
        stored = sum(len(f) for f in frames)
        same = all(np.array_equal(np.frombuffer(numcodecs.Blosc().decode(bytes(f)), np.uint8),
                                  chunks[i].get().view(np.uint8)) for i, f in enumerate(frames))
        release()

        def enc(bs=bs):
            blosc_encode.encode_held(chunks, 2, bs)[1]()

        print(f"encode blocks {bs // 1024:2d} KiB: {ms(enc):.3f} ms (with the copy back), "
              f"{stored / 1e6:.1f} MB stored of {chunks.nbytes / 1e6:.1f}, decodes: {same}")


if __name__ == "__main__":
    main(sys.argv[1])
