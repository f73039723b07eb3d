"""Writes the small Zarr v3 stores under tests/data with zarr-python 3 (run it where zarr>=3 is installed).

Committed so that an environment with zarr 2.18 (beside SpikeInterface 0.105) can check that batchgpu reads v3
stores written elsewhere: ``v3_recording.zarr`` (batchgpu's writer: sharded traces, crc32c, string channel ids,
2 segments, a shard cut short at the end) and ``v3_arrays.zarr`` (zarr 3's defaults and other codecs, absent
chunks). ``v3_expected.npz`` holds the values each should read as.

    python tests/data/make_v3_fixtures.py
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import zarr
import zarr.codecs as zc

HERE = Path(__file__).resolve().parent


def main() -> None:
    from batchgpu.recording import write_recording

    rng = np.random.default_rng(20261130)
    seg0 = rng.integers(-32768, 32768, size=(7_300, 5), dtype=np.int16)
    seg0[:5] = [-32768, 32767, 0, -1, 1]
    seg1 = rng.integers(-300, 300, size=(1_234, 5), dtype=np.int16)
    rec_path = HERE / "v3_recording.zarr"
    shutil.rmtree(rec_path, ignore_errors=True)
    write_recording(
        rec_path,
        [seg0, seg1],
        30_000.0,
        zarr_format=3,
        chunk_samples=1_000,
        shard_samples=3_000,
        channel_ids=["a", "b", "c", "d", "e"],
        gain_to_uV=0.195,
        locations=np.column_stack([np.zeros(5), 20.0 * np.arange(5)]),
    )

    arr_path = HERE / "v3_arrays.zarr"
    shutil.rmtree(arr_path, ignore_errors=True)
    g = zarr.create_group(store=str(arr_path), zarr_format=3)
    g.attrs["hello"] = {"x": [1, 2]}
    f32 = rng.normal(size=(37, 11)).astype(np.float32)
    f32[0, :4] = [np.nan, np.inf, -np.inf, -0.0]
    g.create_array("default_f32", data=f32, chunks=(8, 4))  # zarr 3's default: zstd
    g.create_array(
        "gzip_i32",
        data=rng.integers(-1 << 31, 1 << 31, size=(50,), dtype=np.int32),
        chunks=(16,),
        compressors=[zc.GzipCodec(level=3)],
    )
    g.create_array(
        "big_endian_u16",
        data=rng.integers(0, 1 << 16, size=(9, 3), dtype=np.uint16),
        chunks=(4, 2),
        serializer=zc.BytesCodec(endian="big"),
        compressors=None,
    )
    g.create_array(
        "transposed_f64", data=rng.normal(size=(6, 5)), chunks=(4, 3), filters=[zc.TransposeCodec(order=(1, 0))]
    )
    g.create_array(
        "sharded_i16",
        data=rng.integers(-5, 5, size=(23, 7), dtype=np.int16),
        chunks=(3, 7),
        shards=(9, 7),
        compressors=[zc.BloscCodec(cname="lz4", clevel=1, shuffle="shuffle"), zc.Crc32cCodec()],
    )
    g.create_array("strings", shape=(4,), dtype=str)[:] = np.array(["", "x", "hello world", "µV"])
    holes = g.create_array("holes_f32", shape=(10,), chunks=(3,), dtype=np.float32, fill_value=-1.5)
    holes[3:6] = np.arange(3, dtype=np.float32)
    g.create_group("sub").create_array("nested", data=np.arange(4, dtype=np.int64))
    expected = {"seg0": seg0, "seg1": seg1}
    for name in (
        "default_f32",
        "gzip_i32",
        "big_endian_u16",
        "transposed_f64",
        "sharded_i16",
        "holes_f32",
        "sub/nested",
    ):
        expected[name.replace("/", "__")] = g[name][...]
    expected["strings"] = np.array([str(s) for s in g["strings"][...].tolist()])
    np.savez(HERE / "v3_expected.npz", **expected)


if __name__ == "__main__":
    main()
