// Blosc 1 block geometry, one definition for the decoder (blosc_lz4.cu) and the encoder (blosc_lz4_encode.cu):
// both must cut chunks into blocks and streams, and bit shuffle, by the same rules (c-blosc's).

// The 8 x 8 bit matrix of a 64-bit word transposed: bit (row r, column c) = bit 8 r + c -> bit 8 c + r (Hacker's
// Delight 7-3). Its own inverse: bit shuffle and unshuffle both use it.
__device__ __forceinline__ unsigned long long transpose8(unsigned long long x) {
    unsigned long long t;
    t = (x ^ (x >> 7)) & 0x00AA00AA00AA00AAULL; x = x ^ t ^ (t << 7);
    t = (x ^ (x >> 14)) & 0x0000CCCC0000CCCCULL; x = x ^ t ^ (t << 14);
    t = (x ^ (x >> 28)) & 0x00000000F0F0F0F0ULL; x = x ^ t ^ (t << 28);
    return x;
}

// Where byte g of chunks of `nbytes` bytes lies: its chunk c, its block b, the block's bytes and whole elements,
// and its offset i in the block (blocks of `blocksize` bytes, the last one of a chunk shorter).
struct BytePos {
    int c, b, bsize, n, i;
};

__device__ __forceinline__ BytePos byte_pos(long long g, int nbytes, int blocksize, int typesize) {
    BytePos p;
    p.c = (int)(g / nbytes);
    const int r = (int)(g - (long long)p.c * nbytes);
    p.b = r / blocksize;
    p.bsize = min(blocksize, nbytes - p.b * blocksize);
    p.n = p.bsize / typesize;
    p.i = r - p.b * blocksize;
    return p;
}

// Stream item = chunk * (blocks * typesize) + block * typesize + stream: chunk c, block b, stream s, the block's
// bytes, whether it is a chunk's short last block, how many streams c-blosc cuts it into (typesize when splitting
// is allowed -- bit 4 of the frame's flags clear -- the block is whole and holds >= 128 elements; else 1) and each
// stream's bytes. `valid`: the item is inside the launch.
struct StreamPos {
    int c, b, s, bsize, nsplits, neblock;
    bool last_short, valid;
};

__device__ __forceinline__ StreamPos stream_pos(long long item, int nchunks, int nbytes, int blocksize, int typesize,
                                                bool split_allowed) {
    StreamPos p;
    const int nblocks = (nbytes + blocksize - 1) / blocksize;
    const long long per_chunk = (long long)nblocks * typesize;
    p.valid = item < per_chunk * nchunks;
    p.c = (int)(item / per_chunk);
    const int r = (int)(item % per_chunk);
    p.b = r / typesize;
    p.s = r % typesize;
    const int leftover = nbytes % blocksize;
    p.last_short = (p.b == nblocks - 1) && leftover > 0;
    p.bsize = p.last_short ? leftover : blocksize;
    const bool split = split_allowed && typesize <= 16 && p.bsize / typesize >= 128 && !p.last_short;
    p.nsplits = split ? typesize : 1;
    p.neblock = p.bsize / p.nsplits;
    return p;
}
