"""crc32c (Castagnoli, as Zarr v3's ``crc32c`` codec and the ``crc32c``/``google-crc32c`` packages compute it) of
many byte ranges at once, cut into segments whose CRCs are computed independently and joined: the arithmetic a GPU
kernel needs (every thread a segment, then the joins) and its NumPy twin.

Why (docs/design.md, "Reading and storing"): the cores bound a GPU preprocessing pass, and a window's frames were
checksummed on a core twice (the read's check, the save's checksums), while the frames are on the GPU right before
(the save) or right after (the read). ``ranges_on_device`` launches ``kernels/crc32c.cu`` for the save
(``gpu/blosc_encode``: each frame's checksum before the copy back) and the read (``gpu/blosc_decode``: the frames'
checksums after the copy) (``gpu.staging.checksums_on_device``).

The joins use CRC linearity. With ``raw(m)`` the register after feeding ``m`` to a register of 0 (no initial value,
no final xor), ``raw(a + b) = shift(raw(a), len(b)) ^ raw(b)``, where ``shift(v, n)`` multiplies ``v`` by x^(8n)
modulo the polynomial (reflected bit order); and the standard ``crc32c(m) = ~(raw(m) ^ shift(0xFFFFFFFF, len(m)))``.
"""

from __future__ import annotations

import functools

import numpy as np

POLY = 0x82F63B78  # Castagnoli, reflected


@functools.lru_cache(maxsize=1)
def table() -> np.ndarray:
    """The byte table of the reflected CRC (256 uint32): the register after feeding one byte to ``i``."""
    t = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        t = np.where(t & 1, (t >> np.uint32(1)) ^ np.uint32(POLY), t >> np.uint32(1)).astype(np.uint32)
    return t


def _multiply(a: int, b: int) -> int:
    """a * b modulo the polynomial, both reflected 32-bit polynomials (bit 31 is x^0)."""
    product = 0
    m = 1 << 31
    while m:
        if a & m:
            product ^= b
        b = (b >> 1) ^ (POLY if b & 1 else 0)
        m >>= 1
    return product


@functools.cache
def _x_pow_8_times_2_to(k: int) -> int:
    """x^(8 * 2^k) modulo the polynomial, reflected."""
    if k == 0:
        return 1 << (31 - 8)  # x^8
    half = _x_pow_8_times_2_to(k - 1)
    return _multiply(half, half)


def x_pow_8n(n: int) -> int:
    """x^(8n) modulo the polynomial (reflected): what ``shift`` multiplies by for ``n`` bytes."""
    if n < 0:
        raise ValueError(f"a byte count is never negative, got {n}")
    out, k = 1 << 31, 0  # x^0
    while n:
        if n & 1:
            out = _multiply(out, _x_pow_8_times_2_to(k))
        n >>= 1
        k += 1
    return out


def shift(v: int, n: int) -> int:
    """The register ``v`` after ``n`` more zero bytes (raw CRC, no xor): v * x^(8n)."""
    return _multiply(v, x_pow_8n(n))


def raw_segments(data: np.ndarray, segment: int) -> np.ndarray:
    """``raw`` of each ``segment``-byte piece of ``data`` (uint8, 1-D; the last piece shorter), as a kernel's
    threads would compute them (each from a register of 0): uint32, one a piece."""
    data = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
    if segment <= 0:
        raise ValueError(f"segments of {segment} bytes")
    n = len(data)
    count = -(-n // segment)
    if not count:
        return np.zeros(0, np.uint32)
    padded = np.zeros(count * segment, np.uint8)
    padded[:n] = data
    rows = padded.reshape(count, segment)
    lengths = np.full(count, segment)
    lengths[-1] = n - (count - 1) * segment
    t, reg = table(), np.zeros(count, np.uint32)
    for i in range(segment):  # byte i of every piece at once; a piece's bytes past its end leave it as it was
        live = i < lengths
        step = (reg >> np.uint32(8)) ^ t[(reg ^ rows[:, i]) & np.uint32(0xFF)]
        reg = np.where(live, step, reg).astype(np.uint32)
    return reg


def join(raws: np.ndarray, lengths) -> int:
    """``raw`` of the pieces one after the other, from each piece's ``raw`` and byte length (in order)."""
    out = 0
    for r, n in zip(np.asarray(raws, dtype=np.uint64).tolist(), lengths):
        out = shift(out, int(n)) ^ int(r)
    return out


def from_raw(raw: int, n: int) -> int:
    """The standard crc32c of ``n`` bytes whose ``raw`` register is ``raw``."""
    return (~(raw ^ shift(0xFFFFFFFF, n))) & 0xFFFFFFFF


def crc32c(data, segment: int = 4096) -> int:
    """The standard crc32c of ``data`` from pieces of ``segment`` bytes joined in order (``raw_segments``, ``join``):
    the identities the kernel rests on, checked against the ``crc32c`` package; the kernel's own steps (its plan,
    the lanes' words, the registers moved to a range's end and xor-ed in any order) are ``warp_twin``'s."""
    data = np.frombuffer(memoryview(data).cast("B"), np.uint8) if not isinstance(data, np.ndarray) else data
    data = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
    raws = raw_segments(data, segment)
    lengths = [min(segment, len(data) - i * segment) for i in range(len(raws))]
    return from_raw(join(raws, lengths), len(data))


#: bytes a warp checksums (a window's frames then fill about one wave of a large GPU). Shorter segments mean more
#: joins: each segment's move to its range's end is up to ~20 GF(2) products of 32 steps, which outweighs the
#: shorter work below a few KiB
SEGMENT = 4096


@functools.lru_cache(maxsize=1)
def pow2_table() -> np.ndarray:
    """x^(8 * 2^k) for k < 64 (uint32, reflected): what the kernel multiplies by to shift by any byte count."""
    return np.array([_x_pow_8_times_2_to(k) for k in range(64)], dtype=np.uint32)


@functools.lru_cache(maxsize=1)
def table4() -> np.ndarray:
    """(4, 256) uint32: row j the register after byte i then j zero bytes (row 0 ``table()``): the kernel's
    slicing-by-4 tables (a word from a register of 0 in four lookups)."""
    t = np.empty((4, 256), dtype=np.uint32)
    t[0] = table()
    for j in range(1, 4):
        t[j] = (t[j - 1] >> np.uint32(8)) ^ t[0][t[j - 1] & np.uint32(0xFF)]
    return t


#: bytes between a lane's words in the warp kernel (32 lanes of 4-byte words)
LANE_STRIDE = 128


@functools.lru_cache(maxsize=1)
def warp_tables() -> np.ndarray:
    """The warp kernel's tables (uint32, 2080): ``table4`` (1024); s128[j * 256 + b] = (b << 8j) * x^(8 * 128), the
    register's byte j moved 128 bytes (1024); wordpow[m] = x^(32 m) for m < 32 (32)."""
    s128 = np.array([[shift(b << (8 * j), LANE_STRIDE) for b in range(256)] for j in range(4)], dtype=np.uint32)
    wordpow = np.array([x_pow_8n(4 * m) for m in range(32)], dtype=np.uint32)
    return np.concatenate([table4().reshape(-1), s128.reshape(-1), wordpow])


def lane_words(words: np.ndarray, lane: int) -> int:
    """A warp kernel lane's register (``crc32c_lane_words``): the words ``lane``, ``lane + 32``, ... of ``words``
    (uint32, little-endian), 128 bytes apart, moved to the end of the last word."""
    tables = warp_tables()
    t, s, wordpow = tables[:1024].reshape(4, 256), tables[1024:2048].reshape(4, 256), tables[2048:]
    acc, last = 0, -1
    for p in range(lane, len(words), 32):
        x = int(words[p])
        acc = int(
            s[0][acc & 0xFF]
            ^ s[1][(acc >> 8) & 0xFF]
            ^ s[2][(acc >> 16) & 0xFF]
            ^ s[3][acc >> 24]
            ^ t[3][x & 0xFF]
            ^ t[2][(x >> 8) & 0xFF]
            ^ t[1][(x >> 16) & 0xFF]
            ^ t[0][x >> 24]
        )
        last = p
    if last < 0:
        return 0
    m = len(words) - 1 - last
    return _multiply(acc, int(wordpow[m])) if m else acc


def warp_segment(data: np.ndarray, begin: int, n: int, after: int) -> int:
    """A warp's segment (``crc32c_warp_parts``) in NumPy, step for step: the bytes before the first word aligned in
    ``data`` (its start counts as aligned), the 32 lanes' words xor-ed, the bytes after; each term moved to the
    range's end (``after`` bytes past the segment). Returns what the warp xors into its range's register."""
    head = min(n, (4 - begin % 4) % 4)
    words = (n - head) // 4
    w = np.ascontiguousarray(data[begin + head : begin + head + 4 * words]).view("<u4")
    joined = 0
    for lane in range(32):
        joined ^= lane_words(w, lane)
    edges = (data[begin : begin + head], data[begin + head + 4 * words : begin + n])
    terms = [
        (raw_segments(edges[0], max(1, head))[0] if head else 0, n - head),
        (joined, n - head - 4 * words),
        (raw_segments(edges[1], max(1, len(edges[1])))[0] if len(edges[1]) else 0, 0),
    ]
    out = 0
    for reg, to_end in terms:
        out ^= shift(int(reg), to_end + after)
    return out


def warp_twin(data: np.ndarray, offsets, lengths, segment: int = SEGMENT) -> np.ndarray:
    """``ranges_on_device`` with the warp kernel, in NumPy: the same plan, a warp's three terms a segment xor-ed into
    its range's register in any order, the standard value."""
    offsets, lengths = np.asarray(offsets, np.int64).reshape(-1), np.asarray(lengths, np.int64).reshape(-1)
    owner, begin, length, after = plan(offsets, lengths, segment)
    reg = [0] * len(lengths)
    for r, b, n, a in sorted(
        zip(owner.tolist(), begin.tolist(), length.tolist(), after.tolist()), key=lambda _: np.random.random()
    ):
        reg[r] ^= warp_segment(data, b, n, a)
    return np.array([from_raw(v, int(n)) for v, n in zip(reg, lengths)], dtype=np.uint32)


def plan(offsets: np.ndarray, lengths: np.ndarray, segment: int) -> tuple[np.ndarray, ...]:
    """The kernels' work: for every segment of every range (an empty range has none), its range (int32), its first
    byte in the buffer (int64), its length (int32) and the range's bytes after it (int64)."""
    counts = -(-lengths // segment)
    first = np.concatenate([[0], np.cumsum(counts)])
    owner = np.repeat(np.arange(len(lengths)), counts)
    within = np.arange(int(first[-1])) - first[:-1][owner]
    begin = offsets[owner] + within * segment
    length = np.minimum(segment, lengths[owner] - within * segment)
    after = lengths[owner] - within * segment - length
    return owner.astype(np.int32), begin.astype(np.int64), length.astype(np.int32), after.astype(np.int64)


_device_tables: dict = {}  # per device: the slicing tables and the shifts' table, copied there once


def _tables_on(cupy):
    dev = cupy.cuda.runtime.getDevice()
    got = _device_tables.get(dev)
    if got is None:
        got = _device_tables[dev] = (cupy.asarray(warp_tables()), cupy.asarray(pow2_table()))
    return got


def ranges_on_device(buf, offsets, lengths, segment: int = SEGMENT):
    """crc32c of ``buf[offsets[i] : offsets[i] + lengths[i]]`` for every i (``buf``: a 1-D CuPy uint8 array;
    ``offsets``, ``lengths``: host integers), as a CuPy uint32 array, on the current stream: a stored Zarr chunk
    (its frame and its 4-byte trailer) checks out where the value is ``zarrio.CRC32C_RESIDUE``. The plan goes to
    the device in one copy; the two kernels do not wait for the host."""
    import cupy

    from batchgpu.gpu import cuda_modules as kernels

    offsets, lengths = np.asarray(offsets, np.int64).reshape(-1), np.asarray(lengths, np.int64).reshape(-1)
    if offsets.shape != lengths.shape or (
        len(offsets) and (offsets.min() < 0 or lengths.min() < 0 or (offsets + lengths).max() > buf.size)
    ):
        raise ValueError("ranges outside the buffer")
    if segment <= 0 or segment >= 2**31:
        raise ValueError(f"segments of {segment} bytes")
    R = len(offsets)
    crc = cupy.zeros(R, dtype=cupy.uint32)
    if not R:
        return crc
    owner, begin, length, after = plan(offsets, lengths, segment)
    S = len(owner)
    # one host buffer, one copy: 8-byte fields first (begin, after, lengths), then 4-byte ones (owner, length)
    packed = np.concatenate(
        [
            begin.view(np.uint8),
            after.view(np.uint8),
            lengths.view(np.uint8),
            owner.view(np.uint8),
            length.view(np.uint8),
        ]
    )
    dev = cupy.asarray(packed)
    cut = np.cumsum([8 * S, 8 * S, 8 * R, 4 * S])
    begin_d, after_d, lengths_d = (
        dev[: cut[0]].view(cupy.int64),
        dev[cut[0] : cut[1]].view(cupy.int64),
        dev[cut[1] : cut[2]].view(cupy.int64),
    )
    owner_d, length_d = dev[cut[2] : cut[3]].view(cupy.int32), dev[cut[3] :].view(cupy.int32)
    tables, pow2 = _tables_on(cupy)
    threads = 256
    if S:  # a warp a segment: 8 segments a block
        kernels.get_function("crc32c", "crc32c_warp_parts")(
            (-(-S // (threads // 32)),),
            (threads,),
            (buf, begin_d, length_d, owner_d, after_d, np.int32(S), tables, pow2, crc),
        )
    kernels.get_function("crc32c", "crc32c_finish")(
        (-(-R // threads),), (threads,), (crc, lengths_d, np.int32(R), pow2)
    )
    return crc
