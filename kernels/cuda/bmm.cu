// Batched decode matmuls: Y[m] = W · x[m] for the B sequences of a decode step (B a
// multiple of 8, up to 64), each weight read from memory once for all of them, the
// products on int8 tensor cores (mma.sync m16n8k32; m16n8k16 for the types with a scale per
// 16 values: Q6_K, Q3_K, Q2_K).
//
// Compiled after gemv.cu in the same module, so the device layout (`W`, `Traits`,
// `block_offsets`) and the K-quant scale unpacking are the GEMVs' own.
//
// Activations arrive packed by `act_pack` (norm.cu): per sequence and 32-value chunk, 64
// bytes laid out so that lane t of a quad loads its mma B fragment in one 16-byte load:
// [q(4t..4t+3) | q(16+4t..16+4t+3) | lo(4t..) | lo(16+4t..)] for t = 0..3, where q is the
// Q8_1 value and lo the rounding residual at 1/254 of its step (the GEMVs' 15-bit `A_Q16`
// activations), and per chunk and sequence (dx, sx): dx = d / 254 and sx the chunk's exact
// sum of the quantised values, stored chunk-major so a lane loads the pair of sequences its
// accumulators hold in one 16-byte load.
//
// Weights: lane (g, t) of a warp (g = lane / 4) loads, for rows g and g + 8 of the warp's
// 16, the 4 weight values at k = 4t..4t+3 and 4t+16..4t+19 of the chunk: exactly the mma A
// fragment, and for every 32-value block format in ggml's nibble order a single u32 load
// (value j and j + 16 share byte j). Each weight value is w = a·q + b for an integer q
// (a, b per row and chunk), so W·x over a chunk is a·dx·Σ q·(254·qx + lo) + b·sx: the
// integer sum on the tensor cores (two mma: the Q8_1 plane and the residual plane, combined
// exactly in int32), the rest in f32 per chunk.
//
// Grid (ceil(rows / 128), splits): a block of 8 warps owns 128 rows, warp w rows
// 16w..16w+15, and walks its split chunk by chunk (64 sequences: BMM_TILE chunks at a
// time, the activations staged in shared memory by the whole block). grid.y splits the row
// length, each split writing its partial sums to
// part[split][m][row] (row stride `ldp`); `bmm_finish` adds the splits in a fixed order
// (bit-reproducible) and applies the epilogue.

#define BMM_WARPS 8

// The mma A fragment of one row (values at k = 4t.. and 16 + 4t.. of a chunk) and its
// scale: w = a0·q (k < 16), a1·q (k ≥ 16), + b.
struct BFrag {
    u32 lo, hi;
    float a0, a1, b;
    float b1;  // Q2_K: the second half's offset (its min); b is the first half's
};

// Formats with a scale per 16 values: the batched walk multiplies each half on its own.
template <int T> static constexpr __host__ __device__ bool bmm_halves() {
    return T == T_Q6_K || T == T_Q3_K || T == T_Q2_K || grid_halves(T);
}

// Integer values are unsigned (0..63) for every format but Q8_0, Q6_K, Q3_K and the
// level-table types' levels (the I-quants', MXFP4's) and the grid types' values, which are
// signed.
template <int T> static constexpr __host__ __device__ bool bmm_signed() {
    return T == T_Q8_0 || T == T_Q6_K || T == T_Q3_K || levels4_type(T) || grid_type(T);
}

// The A fragment of chunk j (0..7) of the K-quant super-block at `blk` (global or shared
// memory); `d6` is Q6_K's super-block scale, which its device layout keeps apart.
template <int T, bool Q6_SIGNED = true>
static __device__ __forceinline__ BFrag kq_frag(const u8* blk, float d6, int j, int t) {
    BFrag f;
    if constexpr (T == T_Q4_K || T == T_Q5_K) {
        const int p = j >> 1;
        const uint4 head = *(const uint4*)blk;  // d, dmin, scales[12]
        int sc, m;
        k4_scale_min_w(head.y, head.z, head.w, j, sc, m);
        const u8* qs = blk + (T == T_Q4_K ? 16 : 48) + 32 * p;
        const int shift = 4 * (j & 1);
        f.lo = (*(const u32*)(qs + 4 * t) >> shift) & 0x0f0f0f0f;
        f.hi = (*(const u32*)(qs + 16 + 4 * t) >> shift) & 0x0f0f0f0f;
        if constexpr (T == T_Q5_K) {
            // Bit j of qh byte l is the fifth bit of value l of sub-block j.
            f.lo |= ((*(const u32*)(blk + 16 + 4 * t) >> j) & 0x01010101) << 4;
            f.hi |= ((*(const u32*)(blk + 32 + 4 * t) >> j) & 0x01010101) << 4;
        }
        f.a0 = f.a1 = h2f(head.x & 0xffff) * (float)sc;
        f.b = -h2f(head.x >> 16) * (float)m;
    } else {  // Q6_K: 6-bit values minus 32 as signed bytes; a scale per 16 values
        // The device layout (see dot_chunk in gemv.cu): values 4t.. in the low nibbles of
        // bytes 4t.. of the chunk's 16, values 16 + 4t.. in their high nibbles; their high
        // 2-bit parts at bit 2t of qh words 0 and 1.
        const u32 ql = *(const u32*)(blk + 16 * j + 4 * t);
        const uint2 qh = *(const uint2*)(blk + 128 + 8 * j);
        u32 v0 = (ql & 0x0f0f0f0f) | (((qh.x >> (2 * t)) & 0x03030303) << 4);
        u32 v1 = ((ql >> 4) & 0x0f0f0f0f) | (((qh.y >> (2 * t)) & 0x03030303) << 4);
        if constexpr (Q6_SIGNED) {
            // q - 32 for q in 0..63: flip bit 5, then copy it (the sign of a 6-bit value)
            // into bits 6 and 7 of each byte.
            v0 ^= 0x20202020;
            v1 ^= 0x20202020;
            v0 |= ((v0 & 0x20202020) << 1) | ((v0 & 0x20202020) << 2);
            v1 |= ((v1 & 0x20202020) << 1) | ((v1 & 0x20202020) << 2);
        }
        f.lo = v0;
        f.hi = v1;
        const u32 scales = *(const u16*)(blk + 192 + 2 * j);
        f.a0 = d6 * (float)(i8)(scales & 255);
        f.a1 = d6 * (float)(i8)(scales >> 8);
        f.b = 0.0f;
    }
    return f;
}

// The f16 walk's scale word of one row and chunk: f16x2 (a, b) with w = a·q + b (Q4_K,
// Q5_K), or (a0, a1) for Q6_K's two 16-value halves (w = a·(q − 32)).
template <int T>
static __device__ __forceinline__ u32 kq_hscale(const u8* blk, float d6, int j) {
    const BFrag f = kq_frag<T, false>(blk, d6, j, 0);
    return T == T_Q6_K ? pack_h2(f.a0, f.a1) : pack_h2(f.a0, f.b);
}

// The f16 walk's A fragment of one row and chunk: the weights at k = 4t..4t+3 and
// 16 + 4t..16 + 4t + 3 dequantised to four f16x2 words, in the order the m16n8k16 mma
// takes them when its k slots (2t, 2t+1, 2t+8, 2t+9) stand for k = 4t..4t+3 (the
// activations are packed in the same order, norm.cu `act_pack`). A byte q becomes 1024 + q
// by `prmt` beside 0x64 (the f16 exponent of 1024), exactly q by subtracting 1024 (Q6_K:
// 1056, its offset of 32 too), then a·q + b by one f16x2 FMA: llama.cpp's dequantised f16.
// `scale` is the row and chunk's word from `kq_hscale` (the values' own scale decode is
// dead code here and compiled away).
template <int T>
static __device__ __forceinline__ void kq_hfrag(const u8* blk, u32 scale, int j, int t, u32 (&h)[4]) {
    const BFrag f = kq_frag<T, false>(blk, 0.0f, j, t);
    const u32 magic = 0x64646464u, bias = T == T_Q6_K ? 0x64206420u : 0x64006400u;
    // Each half of the scale word broadcast to both halves.
    const u32 lo2 = __byte_perm(scale, 0, 0x1010), hi2 = __byte_perm(scale, 0, 0x3232);
    const u32 s0 = lo2, s1 = T == T_Q6_K ? hi2 : lo2, b = T == T_Q6_K ? 0u : hi2;
    const u32 q[4] = {__byte_perm(f.lo, magic, 0x4140), __byte_perm(f.lo, magic, 0x4342),
                      __byte_perm(f.hi, magic, 0x4140), __byte_perm(f.hi, magic, 0x4342)};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        u32 v;
        asm("sub.f16x2 %0, %1, %2;" : "=r"(v) : "r"(q[i]), "r"(bias));
        asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(h[i]) : "r"(v), "r"(i < 2 ? s0 : s1), "r"(b));
    }
}

template <int T>
static __device__ __forceinline__ BFrag bmm_frag(const W& w, size_t row, int K, int c, int t) {
    typedef Traits<T> Tr;
    BFrag f;
    if constexpr (q4_0_values(T) || T == T_Q4_1 || T == T_Q5_0 || T == T_Q5_1) {
        const size_t nblk = (size_t)K / 32;
        size_t body_at, sc_at;
        block_offsets<T>(row, nblk, c, body_at, sc_at);
        const u32 q = *(const u32*)(w.body + body_at + 4 * t);
        f.lo = q & 0x0f0f0f0f;
        f.hi = (q >> 4) & 0x0f0f0f0f;
        if constexpr (T == T_Q5_0 || T == T_Q5_1) {
            const u32 qh = w.qh[row * nblk + c];
            f.lo |= spread4(qh >> (4 * t));
            f.hi |= spread4(qh >> (16 + 4 * t));
        }
        if constexpr (T == T_Q4_1 || T == T_Q5_1) {
            const u32 dm = *(const u32*)(w.sc + (row * nblk + c) * 4);
            f.a0 = h2f(dm & 0xffff);
            f.b = h2f(dm >> 16);
        } else {
            f.a0 = ld_h(w.sc + sc_at);
            f.b = -(q4_0_values(T) ? 8.0f : 16.0f) * f.a0;
        }
        f.a1 = f.a0;
    } else if constexpr (T == T_Q8_0) {
        const size_t b = row * ((size_t)K / 32) + c;
        const u8* p = w.body + b * 32;
        f.lo = *(const u32*)(p + 4 * t);
        f.hi = *(const u32*)(p + 16 + 4 * t);
        f.a0 = f.a1 = ld_h(w.sc + b * 2);
        f.b = 0.0f;
    } else if constexpr (T == T_Q2_K || T == T_Q3_K) {
        // The fragment's k = 4t..4t+3 and 16 + 4t.. are the chunk's code words t and 4 + t;
        // Q3_K's codes less 4 as signed bytes (no byte borrows: each code is 0..7).
        const size_t b = row * ((size_t)K / 256) + (c >> 3);
        const K23Codes k = k23_codes<T>(w, b, c & 7);
        float d, s0, s1, m0, m1;
        k23_scales<T>(w, b, c & 7, d, s0, s1, m0, m1);
        f.lo = k23_word<T>(k, t);
        f.hi = k23_word<T>(k, 4 + t);
        if constexpr (T == T_Q3_K) {
            f.lo = __vsub4(f.lo, 0x04040404u);
            f.hi = __vsub4(f.hi, 0x04040404u);
        }
        f.a0 = d * s0;
        f.a1 = d * s1;
        f.b = -m0;
        f.b1 = -m1;
    } else if constexpr (grid_type(T)) {
        // The chunk's signed values (k = 4t.. and 16 + 4t..) and its halves' scales.
        int q[8];
        grid_chunk<T>(w, row, K, c, q, f.a0, f.a1);
        f.lo = (u32)q[t];
        f.hi = (u32)q[4 + t];
        f.b = f.b1 = 0.0f;
    } else if constexpr (levels4_type(T)) {
        // The chunk's codes: value 4t.. in the low nibbles of code bytes 4t.., 16 + 4t.. in
        // their high nibbles (the Q4_0 order), each mapped to its signed level.
        const u8* codes = levels4_codes<T>(w, row, K, c, f.a0);
        const u32 q = *(const u32*)(codes + 4 * t);
        f.lo = levels4<T>(q & 0x0f0f0f0f);
        f.hi = levels4<T>((q >> 4) & 0x0f0f0f0f);
        f.a1 = f.a0;
        f.b = 0.0f;
    } else if constexpr (T == T_Q4_K || T == T_Q5_K) {
        return kq_frag<T>(w.body + (row * ((size_t)K / 256) + (c >> 3)) * Tr::BODY, 0.0f, c & 7, t);
    } else {  // Q6_K
        const size_t b = row * ((size_t)K / 256) + (c >> 3);
        return kq_frag<T>(w.body + b * Tr::BODY, ld_h(w.sc + b * 2), c & 7, t);
    }
    return f;
}

// D = A·B + 0 for a 16x32 int8 A (rows g, g + 8 of the fragment) and a 32x8 int8 B.
template <bool SIGNED>
static __device__ __forceinline__ void mma_k32(const BFrag& r0, const BFrag& r8, u32 b0, u32 b1, int (&d)[4]) {
    if constexpr (SIGNED) {
        asm(
            "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};"
            : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
            : "r"(r0.lo), "r"(r8.lo), "r"(r0.hi), "r"(r8.hi), "r"(b0), "r"(b1), "r"(0));
    } else {
        asm(
            "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};"
            : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
            : "r"(r0.lo), "r"(r8.lo), "r"(r0.hi), "r"(r8.hi), "r"(b0), "r"(b1), "r"(0));
    }
}

// D = A·B for a 16x16 signed int8 A (one k-half of the fragment) and a 16x8 B.
static __device__ __forceinline__ void mma_k16(u32 a0, u32 a1, u32 b, int (&d)[4]) {
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%7,%7,%7};"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(a0), "r"(a1), "r"(b), "r"(0));
}

// Accumulates one chunk of rows (g, g + 8) of `w` against n-tile `nt` of the activations.
template <int T>
static __device__ __forceinline__ void bmm_tile(const BFrag& f0, const BFrag& f8, const uint4 x, const float4 s,
                                                float (&acc)[4]) {
    // s = (dx, sx) of the two sequences (columns 2t, 2t + 1) this lane accumulates.
    if constexpr (bmm_halves<T>()) {
        int h0[4], l0[4], h1[4], l1[4];
        mma_k16(f0.lo, f8.lo, x.x, h0);
        mma_k16(f0.lo, f8.lo, x.z, l0);
        mma_k16(f0.hi, f8.hi, x.y, h1);
        mma_k16(f0.hi, f8.hi, x.w, l1);
        // Q2_K's mins multiply each half's activation sum: the first half's from the same
        // mma with every weight 1, the second's as the chunk's sum less it.
        int sh[4] = {0, 0, 0, 0}, sl[4] = {0, 0, 0, 0};
        if constexpr (T == T_Q2_K) {
            mma_k16(0x01010101u, 0x01010101u, x.x, sh);
            mma_k16(0x01010101u, 0x01010101u, x.z, sl);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const BFrag& f = i < 2 ? f0 : f8;
            const float dx = (i & 1) ? s.z : s.x;
            acc[i] += dx * (f.a0 * (float)(h0[i] * 254 + l0[i]) + f.a1 * (float)(h1[i] * 254 + l1[i]));
            if constexpr (T == T_Q2_K) {
                const float sx = (i & 1) ? s.w : s.y, first = dx * (float)(sh[i] * 254 + sl[i]);
                acc[i] += f.b * first + f.b1 * (sx - first);
            }
        }
    } else {
        int hi[4], lo[4];
        mma_k32<bmm_signed<T>()>(f0, f8, x.x, x.y, hi);
        mma_k32<bmm_signed<T>()>(f0, f8, x.z, x.w, lo);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const BFrag& f = i < 2 ? f0 : f8;
            const float dx = (i & 1) ? s.z : s.x, sx = (i & 1) ? s.w : s.y;
            acc[i] += f.a0 * dx * (float)(hi[i] * 254 + lo[i]) + f.b * sx;
        }
    }
}

// The packed activations of B sequences (see the top of this file).
struct BAct {
    const uint4* __restrict__ x;   // [B][chunks][4] (lane t's 16 bytes)
    const float2* __restrict__ s;  // [chunks][B] (dx, sx)
};

// The walks read a matmul's B sequences through one of these: `x(m, c, q)` is quad lane
// q's 16 bytes of sequence m's chunk c, `s2(c, m)` its (dx, sx), and `s4(c, m)` the pairs
// of sequences m and m + 1 (m even).
//
// The dense step's B sequences are the packed rows themselves.
template <int B>
struct DenseActs {
    BAct a;
    int nchunks;
    __device__ __forceinline__ uint4 x(int m, int c, int q) const { return a.x[((size_t)m * nchunks + c) * 4 + q]; }
    __device__ __forceinline__ float2 s2(int c, int m) const { return a.s[(size_t)c * B + m]; }
    __device__ __forceinline__ float4 s4(int c, int m) const { return *(const float4*)&a.s[(size_t)c * B + m]; }
};

// A grouped matmul's B sequences are packed rows picked by `src` (shared memory): sequence
// m is packed row src[m] of the `rows` packed.
struct GatheredActs {
    BAct a;
    int nchunks, rows;
    const int* src;
    __device__ __forceinline__ uint4 x(int m, int c, int q) const {
        return a.x[((size_t)src[m] * nchunks + c) * 4 + q];
    }
    __device__ __forceinline__ float2 s2(int c, int m) const { return a.s[(size_t)c * rows + src[m]]; }
    __device__ __forceinline__ float4 s4(int c, int m) const {
        const float2 p = s2(c, m), q = s2(c, m + 1);
        return make_float4(p.x, p.y, q.x, q.y);
    }
};

// Chunks whose activations a block stages in shared memory at a time (64 sequences), and
// whose weight fragments each warp loads before using any.
#define BMM_TILE 4

// Accumulates chunks c0..c1 reading the activation fragments straight from global memory
// (L2): the faster walk up to 32 sequences on the H200. (Loading BMM_TILE chunks' weight
// fragments before using any, as the staged walk does, measured 5-15% slower here: more
// registers, fewer warps per SM; docs/log/2026-11-to-12.md.)
template <int T, int NT, bool SWIGLU, class Acts>
static __device__ __forceinline__ void bmm_chunks_direct(const W& w, const W& w2, const Acts& a, size_t ra, size_t rb,
                                                         int g, int t, int K, int c0, int c1, float (&acc)[NT][4],
                                                         float (&acc2)[SWIGLU ? NT : 1][4]) {
    for (int c = c0; c < c1; ++c) {
        const BFrag f0 = bmm_frag<T>(w, ra, K, c, t), f8 = bmm_frag<T>(w, rb, K, c, t);
        BFrag u0, u8;
        if constexpr (SWIGLU) {
            u0 = bmm_frag<T>(w2, ra, K, c, t);
            u8 = bmm_frag<T>(w2, rb, K, c, t);
        }
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const uint4 x = a.x(n * 8 + g, c, t);
            const float4 s = a.s4(c, n * 8 + 2 * t);
            bmm_tile<T>(f0, f8, x, s, acc[n]);
            if constexpr (SWIGLU) bmm_tile<T>(u0, u8, x, s, acc2[n]);
        }
    }
}

// Accumulates chunks c0..c1 BMM_TILE at a time, the block's 8 warps sharing the
// activations through shared memory: at 64 sequences each warp reading them from L2 costs
// 14× the weights' traffic. Every warp of the block must call it (it holds barriers);
// `active` is false for a warp past the last row, which helps stage and computes nothing.
template <int T, int NT, bool SWIGLU, class Acts>
static __device__ __forceinline__ void bmm_chunks_staged(const W& w, const W& w2, const Acts& a, size_t ra, size_t rb,
                                                         bool active, int g, int t, int K, int c0, int c1,
                                                         float (&acc)[NT][4], float (&acc2)[SWIGLU ? NT : 1][4]) {
    constexpr int B = NT * 8;
    // [chunk][sequence][4 × 16 bytes] (a quad's 64 bytes contiguous, so a warp's loads hit
    // distinct banks) and the (dx, sx) pairs [chunk][sequence].
    __shared__ uint4 sx[BMM_TILE * B * 4];
    __shared__ __align__(16) float2 ss[BMM_TILE * B];
    for (int c = c0; c < c1; c += BMM_TILE) {
        const int tile = min(BMM_TILE, c1 - c);
        // This tile's weights first: their loads are in flight while the block stages.
        BFrag f0[BMM_TILE], f8[BMM_TILE], u0[SWIGLU ? BMM_TILE : 1], u8[SWIGLU ? BMM_TILE : 1];
#pragma unroll
        for (int j = 0; j < BMM_TILE; ++j) {
            if (active && j < tile) {
                f0[j] = bmm_frag<T>(w, ra, K, c + j, t);
                f8[j] = bmm_frag<T>(w, rb, K, c + j, t);
                if constexpr (SWIGLU) {
                    u0[j] = bmm_frag<T>(w2, ra, K, c + j, t);
                    u8[j] = bmm_frag<T>(w2, rb, K, c + j, t);
                }
            }
        }
        __syncthreads();  // the previous tile's readers are done
        for (int i = threadIdx.x; i < tile * B * 4; i += BMM_WARPS * 32) {
            const int q = i & 3, m = (i >> 2) % B, j = (i >> 2) / B;
            sx[i] = a.x(m, c + j, q);
        }
        for (int i = threadIdx.x; i < tile * B; i += BMM_WARPS * 32) ss[i] = a.s2(c + i / B, i % B);
        __syncthreads();
        if (!active) continue;
#pragma unroll
        for (int j = 0; j < BMM_TILE; ++j) {
            if (j < tile) {
#pragma unroll
                for (int n = 0; n < NT; ++n) {
                    const uint4 x = sx[(j * B + n * 8 + g) * 4 + t];
                    const float4 sc = *(const float4*)&ss[j * B + n * 8 + 2 * t];
                    bmm_tile<T>(f0[j], f8[j], x, sc, acc[n]);
                    if constexpr (SWIGLU) bmm_tile<T>(u0[j], u8[j], x, sc, acc2[n]);
                }
            }
        }
    }
}

template <int NT, bool SWIGLU>
static __device__ __forceinline__ void bmm_zero(float (&acc)[NT][4], float (&acc2)[SWIGLU ? NT : 1][4]) {
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            acc[n][i] = 0.0f;
            acc2[SWIGLU ? n : 0][i] = 0.0f;
        }
}

// A warp's sums over chunks c0..c1 of rows ra and rb (and SwiGLU's second weight), from
// zero: 64 sequences (NT 8) take the staged walk, which every warp of the block must call
// (it holds barriers; `active` false for a warp past the last row), fewer the direct one.
template <int T, int NT, bool SWIGLU, class Acts>
static __device__ __forceinline__ void bmm_walk(const W& w, const W& w2, const Acts& a, size_t ra, size_t rb,
                                                bool active, int g, int t, int K, int c0, int c1,
                                                float (&acc)[NT][4], float (&acc2)[SWIGLU ? NT : 1][4]) {
    bmm_zero<NT, SWIGLU>(acc, acc2);
    if constexpr (NT == 8) {
        bmm_chunks_staged<T, NT, SWIGLU>(w, w2, a, ra, rb, active, g, t, K, c0, c1, acc, acc2);
    } else if (active) {
        bmm_chunks_direct<T, NT, SWIGLU>(w, w2, a, ra, rb, g, t, K, c0, c1, acc, acc2);
    }
}

// Writes a warp's sums (rows row0 + g and row0 + g + 8, the sequences of its lane) to its
// split's partial sums `out` ([m][row], stride ldp; SwiGLU's up products nrows further on).
template <int NT, bool SWIGLU>
static __device__ __forceinline__ void bmm_store(float* __restrict__ out, int ldp, int nrows, int row0, int g, int t,
                                                 const float (&acc)[NT][4], const float (&acc2)[SWIGLU ? NT : 1][4]) {
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = row0 + g + (i < 2 ? 0 : 8);
            const int m = n * 8 + 2 * t + (i & 1);
            if (row < nrows) {
                out[(size_t)m * ldp + row] = acc[n][i];
                if constexpr (SWIGLU) out[(size_t)m * ldp + nrows + row] = acc2[n][i];
            }
        }
}

template <int T, int NT, bool SWIGLU>
static __device__ __forceinline__ void bmm(W w, W w2, const BAct a, float* __restrict__ part, int ldp, int nrows,
                                           int K, int per_split) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    constexpr int B = NT * 8;
    const int row0 = blockIdx.x * (BMM_WARPS * 16) + warp * 16;
    const bool active = row0 < nrows;
    // Rows past the end read the last row (in bounds) and are not written.
    const size_t ra = min(row0 + g, nrows - 1), rb = min(row0 + g + 8, nrows - 1);
    const int nchunks = K / 32;
    const int c0 = blockIdx.y * per_split, c1 = min(nchunks, c0 + per_split);
    float acc[NT][4], acc2[SWIGLU ? NT : 1][4];
    bmm_walk<T, NT, SWIGLU>(w, w2, DenseActs<B>{a, nchunks}, ra, rb, active, g, t, K, c0, c1, acc, acc2);
    if (!active) return;
    bmm_store<NT, SWIGLU>(part + (size_t)blockIdx.y * NT * 8 * ldp, ldp, nrows, row0, g, t, acc, acc2);
}

// A grouped matmul (Mixture of Experts): the weight stacks `count` experts of `width` rows
// each (expert e's rows from e·width), and each expert multiplies the slots routed to it:
// slots order[starts[e]] .. order[starts[e + 1] - 1] (the routing's slots sorted by expert,
// `moe_order`), slot s reading packed row s / slots_per_input of `rows` packed rows and
// writing y[s·ldy + r] for r < width. Block (bx, e) owns rows 128·bx.. of expert e and
// walks that expert's slots B = 8·NT at a time over the whole row length (an expert with
// no slot returns at once): each expert's rows are read once per B of its tokens, not
// once a token. Epilogue: + bias[e·width + r]; gated, glu(gate + bg, up + bu) with the
// biases (optional) an expert's gate rows' then its up rows' from bias[2·e·width].
template <int T, int NT, bool SWIGLU>
static __device__ __forceinline__ void bmm_grouped(W w, W w2, const BAct a, int rows, const int* __restrict__ order,
                                                   const int* __restrict__ starts, int slots_per_input,
                                                   float* __restrict__ y, int ldy, int width, int K,
                                                   const float* __restrict__ bias, int act, float alpha,
                                                   float limit) {
    constexpr int B = NT * 8;
    __shared__ int src[B], dst[B];
    const int e = blockIdx.y, first = starts[e], end = starts[e + 1];
    if (first >= end) return;  // the whole block: no barrier is skipped by part of it
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.x * (BMM_WARPS * 16) + warp * 16;
    const bool active = row0 < width;
    // Rows past the expert's end read its last row (in bounds) and are not written.
    const size_t base = (size_t)e * width;
    const size_t ra = base + min(row0 + g, width - 1), rb = base + min(row0 + g + 8, width - 1);
    const GatheredActs acts = {a, K / 32, rows, src};
    for (int at = first; at < end; at += B) {
        const int n = min(B, end - at);
        __syncthreads();  // the previous tile's readers of src and dst are done
        // Past the tile's last slot, sequences repeat it (in bounds) and are not written.
        for (int i = threadIdx.x; i < B; i += blockDim.x) {
            const int slot = order[at + min(i, n - 1)];
            src[i] = slot / slots_per_input;
            dst[i] = i < n ? slot : -1;
        }
        __syncthreads();
        float acc[NT][4], acc2[SWIGLU ? NT : 1][4];
        bmm_walk<T, NT, SWIGLU>(w, w2, acts, ra, rb, active, g, t, K, 0, K / 32, acc, acc2);
        if (!active) continue;
#pragma unroll
        for (int n_ = 0; n_ < NT; ++n_)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = row0 + g + (i < 2 ? 0 : 8), slot = dst[n_ * 8 + 2 * t + (i & 1)];
                if (r >= width || slot < 0) continue;
                float v;
                if constexpr (SWIGLU) {
                    float g = acc[n_][i], u = acc2[n_][i];
                    if (bias) {
                        g += bias[2 * base + r];
                        u += bias[2 * base + width + r];
                    }
                    v = glu(g, u, act, alpha, limit);
                } else {
                    v = acc[n_][i];
                    if (bias) v += bias[base + r];
                }
                y[(size_t)slot * ldy + r] = v;
            }
    }
}

// The pipelined walk, for K-quant weights (bmmh_*). A block owns 128 rows as above and a
// split of the row length in 256-value super-blocks. A stage is one super-block column: the
// block's 128 rows of it (and SwiGLU's second weight's), Q6_K's scales, and the packed f16
// activations of its 8 chunks for every sequence (64 bytes a chunk and sequence), all copied
// into shared memory by cp.async, `stages` deep (2–4; the host runs 2): while the warps
// multiply one stage the next ones are in flight, and no weight byte waits in a register
// (the register walk above holds a stage's fragments in registers, which caps the bytes in
// flight at a few hundred a warp: docs/log/2026-11-to-12.md). Each weight is dequantised
// once to f16 (`kq_hfrag`) for m16n8k16 f16 mma with f32 accumulators that run over the
// whole split: no per-chunk scale epilogue for every 8 sequences, which is what an int8
// form of this walk spent its instructions on from 16 sequences up (it measured slower and
// left main: docs/architecture.md). A row stride of 144, 176 or 208 bytes puts the eight
// rows a warp's lanes read in distinct banks.
#define BMMP_ROWS (BMM_WARPS * 16)

template <int T, int NT, bool SWIGLU>
struct BmmpStage {
    static constexpr int B = NT * 8, NW = SWIGLU ? 2 : 1, BODY = Traits<T>::BODY;
    static constexpr int WBYTES = NW * BMMP_ROWS * BODY;              // [weight][row][BODY]
    static constexpr int DBYTES = T == T_Q6_K ? NW * BMMP_ROWS * 4 : 0;  // [weight][row] u32
    static constexpr int XBYTES = 8 * B * 64;                          // [chunk][seq][4 × 16 B]
    static constexpr int BYTES = WBYTES + DBYTES + XBYTES;             // kernels/src/batch.rs
    // After the stages: each warp's scale words of one stage [weight][row][chunk].
    static constexpr int HBYTES = BMM_WARPS * NW * 16 * 8 * 4;
};

template <int T, int NT, bool SWIGLU>
static __device__ __forceinline__ void bmmp(W w, W w2, const BAct a, float* __restrict__ part, int ldp, int nrows,
                                            int K, int sb_per_split, int stages) {
    typedef BmmpStage<T, NT, SWIGLU> St;
    constexpr int B = St::B, BODY = St::BODY, THREADS = BMM_WARPS * 32;
    extern __shared__ __align__(16) u8 bmmp_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int block_row0 = blockIdx.x * BMMP_ROWS, row0 = block_row0 + warp * 16;
    const bool active = row0 < nrows;
    const size_t nsb = (size_t)K / 256;
    const int nchunks = K / 32;
    const int sb0 = blockIdx.y * sb_per_split, n = min((int)nsb, sb0 + sb_per_split) - sb0;
    auto stage = [&](int s) { return bmmp_smem + (size_t)(s % stages) * St::BYTES; };
    u32* hscale_smem = (u32*)(bmmp_smem + (size_t)stages * St::BYTES);

    // Rows past the end copy the last row (in bounds) and are not written.
    auto issue_weights = [&](int s) {
        const u32 dst = smem_u32(stage(s));
        const size_t sb = sb0 + s;
        constexpr int V = BODY / 16;
        for (int i = threadIdx.x; i < St::NW * BMMP_ROWS * V; i += THREADS) {
            const int v = i % V, r = (i / V) % BMMP_ROWS, which = i / (V * BMMP_ROWS);
            const size_t row = min(block_row0 + r, nrows - 1);
            cp_async16(dst + (which * BMMP_ROWS + r) * BODY + 16 * v,
                       (which ? w2.body : w.body) + (row * nsb + sb) * BODY + 16 * v);
        }
        if constexpr (T == T_Q6_K) {
            // Each 2-byte scale as the aligned word around it (the planes are padded to whole
            // words at upload); the compute picks the half.
            for (int i = threadIdx.x; i < St::NW * BMMP_ROWS; i += THREADS) {
                const size_t row = min(block_row0 + i % BMMP_ROWS, nrows - 1);
                const size_t b = row * nsb + sb;
                cp_async4(dst + St::WBYTES + 4 * i, (i >= BMMP_ROWS ? w2.sc : w.sc) + ((2 * b) & ~(size_t)3));
            }
        }
    };
    auto issue_acts = [&](int s) {
        const u32 dst = smem_u32(stage(s) + St::WBYTES + St::DBYTES);
        const int c0 = (sb0 + s) * 8;
        // Consecutive threads read consecutive 16 bytes: a sequence's 8 chunks are 512
        // contiguous bytes of the packed activation.
        for (int i = threadIdx.x; i < 8 * B * 4; i += THREADS) {
            const int q = i & 3, j = (i >> 2) & 7, m = i >> 5;
            cp_async16(dst + ((j * B + m) * 4 + q) * 16, a.x + ((size_t)m * nchunks + c0 + j) * 4 + q);
        }
    };

    // The weights do not depend on the previous kernel: the first stages' are asked for
    // before waiting for it; the activations after.
    for (int s = 0; s < stages - 1 && s < n; ++s) issue_weights(s);
    grid_dependency_wait();
    for (int s = 0; s < stages - 1; ++s) {
        if (s < n) issue_acts(s);
        cp_async_commit();
    }

    float acc[NT][4], acc2[SWIGLU ? NT : 1][4];
    bmm_zero<NT, SWIGLU>(acc, acc2);
    const int r0 = warp * 16 + g, r8 = r0 + 8;
    for (int s = 0; s < n; ++s) {
        // Stage s has landed once at most stages - 2 later groups are in flight.
        if (stages >= 4) cp_async_wait<2>();
        else if (stages == 3) cp_async_wait<1>();
        else cp_async_wait<0>();
        __syncthreads();  // every thread's copies of stage s are visible; stage s - 1 is free
        if (s + stages - 1 < n) {
            issue_weights(s + stages - 1);
            issue_acts(s + stages - 1);
        }
        cp_async_commit();
        if (!active) continue;
        const u8* st = stage(s);
        const uint4* sx = (const uint4*)(st + St::WBYTES + St::DBYTES);
        // Q6_K's super-block scale of the warp's row r (0..15) of weight `which` in this
        // stage (the stage holds each 2-byte scale as the aligned word around it).
        auto q6_scale = [&](int which, int r) {
            const u32* dw = (const u32*)(st + St::WBYTES);
            const size_t row = min(row0 + r, nrows - 1);
            return h2f((u16)(dw[which * BMMP_ROWS + warp * 16 + r] >> (16 * (int)((row * nsb + sb0 + s) & 1))));
        };
        // The warp's 16 rows' scale words for the 8 chunks (and the second weight's),
        // decoded once a stage instead of by each quad at every chunk: lane L takes row
        // L % 16, chunks 4·(L / 16)..+3.
        u32* words = hscale_smem + warp * (St::NW * 16 * 8);
        {
            const int r = lane & 15, j0 = 4 * (lane >> 4);
#pragma unroll
            for (int which = 0; which < St::NW; ++which) {
                const float d = T == T_Q6_K ? q6_scale(which, r) : 0.0f;
                const u8* blk = st + (which * BMMP_ROWS + warp * 16 + r) * BODY;
#pragma unroll
                for (int j = j0; j < j0 + 4; ++j) words[(which * 16 + r) * 8 + j] = kq_hscale<T>(blk, d, j);
            }
            __syncwarp();
        }
#pragma unroll 2
        for (int j = 0; j < 8; ++j) {
            u32 f0[4], f8[4], u0[4], u8[4];
            kq_hfrag<T>(st + r0 * BODY, words[g * 8 + j], j, t, f0);
            kq_hfrag<T>(st + r8 * BODY, words[(g + 8) * 8 + j], j, t, f8);
            if constexpr (SWIGLU) {
                kq_hfrag<T>(st + (BMMP_ROWS + r0) * BODY, words[(16 + g) * 8 + j], j, t, u0);
                kq_hfrag<T>(st + (BMMP_ROWS + r8) * BODY, words[(24 + g) * 8 + j], j, t, u8);
            }
            // Rows g and g + 8 for k = 4t.. (the first mma) and 16 + 4t.. (the second).
            const u32 a_lo[4] = {f0[0], f8[0], f0[1], f8[1]}, a_hi[4] = {f0[2], f8[2], f0[3], f8[3]};
            const u32 b_lo[4] = {u0[0], u8[0], u0[1], u8[1]}, b_hi[4] = {u0[2], u8[2], u0[3], u8[3]};
#pragma unroll
            for (int n_ = 0; n_ < NT; ++n_) {
                const uint4 x = sx[(j * B + n_ * 8 + g) * 4 + t];
                mma_f16(acc[n_], a_lo, x.x, x.y);
                mma_f16(acc[n_], a_hi, x.z, x.w);
                if constexpr (SWIGLU) {
                    mma_f16(acc2[n_], b_lo, x.x, x.y);
                    mma_f16(acc2[n_], b_hi, x.z, x.w);
                }
            }
        }
        __syncwarp();  // the words are rewritten for the next stage
    }
    if (!active) return;
    bmm_store<NT, SWIGLU>(part + (size_t)blockIdx.y * NT * 8 * ldp, ldp, nrows, row0, g, t, acc, acc2);
}

#define BMM_ENTRY(NAME, T, NT)                                                                                         \
    extern "C" __global__ void __launch_bounds__(BMM_WARPS * 32) bmm_##NAME##_##NT(                                   \
        const u8* body, const u32* qh, const u8* sc, const uint4* x, const float2* s, float* part, int ldp,           \
        int nrows, int K, int per_split) {                                                                             \
        grid_dependency_wait();                                                                                        \
        W w = {body, qh, sc};                                                                                          \
        BAct a = {x, s};                                                                                               \
        bmm<T, NT, false>(w, w, a, part, ldp, nrows, K, per_split);                                                    \
    }                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(BMM_WARPS * 32) bmm_swiglu_##NAME##_##NT(                            \
        const u8* body, const u32* qh, const u8* sc, const u8* body2, const u32* qh2, const u8* sc2, const uint4* x,  \
        const float2* s, float* part, int ldp, int nrows, int K, int per_split) {                                      \
        grid_dependency_wait();                                                                                        \
        W w = {body, qh, sc}, w2 = {body2, qh2, sc2};                                                                  \
        BAct a = {x, s};                                                                                               \
        bmm<T, NT, true>(w, w2, a, part, ldp, nrows, K, per_split);                                                    \
    }

#define BMM_GROUPED_ENTRY(NAME, T, NT)                                                                                 \
    extern "C" __global__ void __launch_bounds__(BMM_WARPS * 32) bmm_grouped_##NAME##_##NT(                           \
        const u8* body, const u32* qh, const u8* sc, const uint4* x, const float2* s, int rows, const int* order,      \
        const int* starts, int slots_per_input, float* y, int ldy, int width, int K, const float* bias) {              \
        grid_dependency_wait();                                                                                        \
        W w = {body, qh, sc};                                                                                          \
        BAct a = {x, s};                                                                                               \
        bmm_grouped<T, NT, false>(w, w, a, rows, order, starts, slots_per_input, y, ldy, width, K, bias, 0, 0.0f,     \
                                  0.0f);                                                                               \
    }                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(BMM_WARPS * 32) bmm_grouped_swiglu_##NAME##_##NT(                    \
        const u8* body, const u32* qh, const u8* sc, const u8* body2, const u32* qh2, const u8* sc2, const uint4* x,  \
        const float2* s, int rows, const int* order, const int* starts, int slots_per_input, float* y, int ldy,        \
        int width, int K, const float* bias, int act, float alpha, float limit) {                                      \
        grid_dependency_wait();                                                                                        \
        W w = {body, qh, sc}, w2 = {body2, qh2, sc2};                                                                  \
        BAct a = {x, s};                                                                                               \
        bmm_grouped<T, NT, true>(w, w2, a, rows, order, starts, slots_per_input, y, ldy, width, K, bias, act, alpha,  \
                                 limit);                                                                               \
    }

#define BMMP_ENTRY(NAME, T, NT)                                                                                        \
    extern "C" __global__ void __launch_bounds__(BMM_WARPS * 32) bmmh_##NAME##_##NT(                                  \
        const u8* body, const u32* qh, const u8* sc, const uint4* x, const float2* s, float* part, int ldp,           \
        int nrows, int K, int per_split, int stages) {                                                                 \
        W w = {body, qh, sc};                                                                                          \
        BAct a = {x, s};                                                                                               \
        bmmp<T, NT, false>(w, w, a, part, ldp, nrows, K, per_split, stages);                                           \
    }                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(BMM_WARPS * 32) bmmh_swiglu_##NAME##_##NT(                           \
        const u8* body, const u32* qh, const u8* sc, const u8* body2, const u32* qh2, const u8* sc2, const uint4* x,  \
        const float2* s, float* part, int ldp, int nrows, int K, int per_split, int stages) {                          \
        W w = {body, qh, sc}, w2 = {body2, qh2, sc2};                                                                  \
        BAct a = {x, s};                                                                                               \
        bmmp<T, NT, true>(w, w2, a, part, ldp, nrows, K, per_split, stages);                                           \
    }

#define BMMP_TYPE(NAME, T) \
    BMMP_ENTRY(NAME, T, 1)    \
    BMMP_ENTRY(NAME, T, 2)    \
    BMMP_ENTRY(NAME, T, 4)    \
    BMMP_ENTRY(NAME, T, 8)

// The pipelined entries exist for Q4_K, Q5_K and Q6_K only (chosen by the type's token:
// `##` keeps it from expanding to its number).
#define BMMP_FOR_T_Q4_K(NAME, T) BMMP_TYPE(NAME, T)
#define BMMP_FOR_T_Q5_K(NAME, T) BMMP_TYPE(NAME, T)
#define BMMP_FOR_T_Q6_K(NAME, T) BMMP_TYPE(NAME, T)
#define BMMP_FOR_T_Q4_0(NAME, T)
#define BMMP_FOR_T_Q4_1(NAME, T)
#define BMMP_FOR_T_Q5_0(NAME, T)
#define BMMP_FOR_T_Q5_1(NAME, T)
#define BMMP_FOR_T_Q8_0(NAME, T)
#define BMMP_FOR_T_Q4_0X4(NAME, T)
#define BMMP_FOR_T_Q2_K(NAME, T)
#define BMMP_FOR_T_Q3_K(NAME, T)
#define BMMP_FOR_T_IQ4_NL(NAME, T)
#define BMMP_FOR_T_IQ4_XS(NAME, T)
#define BMMP_FOR_T_MXFP4(NAME, T)
#define BMMP_FOR_T_IQ2_XXS(NAME, T)
#define BMMP_FOR_T_IQ2_XS(NAME, T)
#define BMMP_FOR_T_IQ2_S(NAME, T)
#define BMMP_FOR_T_IQ3_XXS(NAME, T)
#define BMMP_FOR_T_IQ3_S(NAME, T)
#define BMMP_FOR_T_IQ1_S(NAME, T)
#define BMMP_FOR_T_IQ1_M(NAME, T)

// Entry points bmm_{tag}_{NT} and bmm_swiglu_{tag}_{NT} for B = 8·NT sequences, the grouped
// bmm_grouped_{tag}_{NT} and bmm_grouped_swiglu_{tag}_{NT}, and for the K-quants
// bmmh_{tag}_{NT} and bmmh_swiglu_{tag}_{NT}.
#define BMM_TYPE(NAME, T)         \
    BMM_ENTRY(NAME, T, 1)         \
    BMM_ENTRY(NAME, T, 2)         \
    BMM_ENTRY(NAME, T, 4)         \
    BMM_ENTRY(NAME, T, 8)         \
    BMM_GROUPED_ENTRY(NAME, T, 1) \
    BMM_GROUPED_ENTRY(NAME, T, 2) \
    BMM_GROUPED_ENTRY(NAME, T, 4) \
    BMM_GROUPED_ENTRY(NAME, T, 8) \
    BMMP_FOR_##T(NAME, T)
