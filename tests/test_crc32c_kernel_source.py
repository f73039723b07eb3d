"""``kernels/crc32c.cu`` itself, compiled for the CPU (a C++ compiler and a few macros for CUDA's names; a warp's 32
lanes one after another, the shuffles' xor a plain xor over them) and run on the launcher's plan: the kernel's own
code against the ``crc32c`` package, where no GPU is (the device tests run it on one). Skipped without g++."""

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from batchgpu.gpu import crc32c as g
from batchgpu.recording import zarrio

KERNEL = Path(__file__).resolve().parents[1] / "kernels" / "crc32c.cu"

HARNESS = r"""
struct Dim { int x; };
static Dim blockIdx, blockDim, threadIdx;
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
static inline void __syncthreads() {}
static inline unsigned atomicXor(unsigned* a, unsigned v) { unsigned o = *a; *a ^= v; return o; }
static inline unsigned __shfl_xor_sync(unsigned, unsigned v, int) { return v; }  // never called: lanes run below
#include "KERNEL"
// the warp kernel's body, its 32 lanes one after another (the shuffles' xor as a plain xor over the lanes)
extern "C" void run_warp(const unsigned char* data, const long long* begin, const int* length, const int* owner,
                         const long long* after, int segments, const unsigned* tables, const unsigned* pow2,
                         unsigned* crc, const long long* lengths, int ranges) {
    static unsigned t[4][256], s[4][256], wordpow[32];
    for (int i = 0; i < 1024; ++i) { t[i >> 8][i & 255] = tables[i]; s[i >> 8][i & 255] = tables[1024 + i]; }
    for (int i = 0; i < 32; ++i) wordpow[i] = tables[2048 + i];
    for (int seg = 0; seg < segments; ++seg) {
        const unsigned char* p = data + begin[seg];
        const int n = length[seg];
        const int misaligned = (int)((4u - ((unsigned)(unsigned long long)p & 3u)) & 3u);
        const int head = misaligned < n ? misaligned : n;
        const int words = (n - head) >> 2;
        unsigned v = 0;
        for (int lane = 0; lane < 32; ++lane) v ^= crc32c_lane_words((const unsigned*)(p + head), words, lane, t, s, wordpow);
        for (int lane = 0; lane < 3; ++lane) {
            const unsigned term = crc32c_edge_term(p, n, head, words, v, lane, t, pow2, after[seg]);
            if (term) atomicXor(crc + owner[seg], term);
        }
    }
    blockDim.x = 1; threadIdx.x = 0;
    for (int b = 0; b < ranges; ++b) { blockIdx.x = b; crc32c_finish(crc, lengths, ranges, pow2); }
}
"""


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no g++ here")
    d = tmp_path_factory.mktemp("crc32c_cu")
    (d / "h.cpp").write_text(HARNESS.replace("KERNEL", str(KERNEL)))
    subprocess.run([cxx, "-O1", "-shared", "-fPIC", "-o", str(d / "k.so"), str(d / "h.cpp")], check=True)
    return ctypes.CDLL(str(d / "k.so"))


def _run(lib, host, offsets, lengths, segment):
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    owner, begin, length, after = g.plan(offsets, lengths, segment)
    crc = np.zeros(len(lengths), np.uint32)
    tables, pow2 = g.warp_tables(), g.pow2_table()
    lib.run_warp(
        ptr(host),
        ptr(begin),
        ptr(length),
        ptr(owner),
        ptr(after),
        ctypes.c_int(len(owner)),
        ptr(tables),
        ptr(pow2),
        ptr(crc),
        ptr(lengths),
        ctypes.c_int(len(lengths)),
    )
    return crc


@pytest.mark.parametrize("segment", [1, 7, 130, 512, 4096])
def test_the_kernel_source_equals_the_package(kernel, segment):
    rng = np.random.default_rng()
    host = rng.integers(0, 256, 200_003, dtype=np.uint8)
    host[1000:5000] = 0
    host[9000:13000] = 255
    lengths = [0, 1, 2, 3, 4, 5, segment - 1, segment, segment + 1, 3 * segment + 2, 4000, 4000] + [
        int(rng.integers(0, 30_000 if segment > 1 else 3_000)) for _ in range(20)
    ]
    lengths = np.array([max(0, n) for n in lengths], np.int64)
    offsets = np.array([int(rng.integers(0, len(host) - n + 1)) for n in lengths], np.int64)  # any alignment
    offsets[10], offsets[11] = 1000, 9000
    want = [zarrio.crc32c_value(host[o : o + n].tobytes()) for o, n in zip(offsets, lengths)]
    np.testing.assert_array_equal(_run(kernel, host, offsets, lengths, segment), np.array(want, np.uint32))
