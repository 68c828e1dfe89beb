// Matrix-vector products y = W x for every weight type kiln runs, at batch 1 (decode).
//
// Weights are in kiln's device layout (see the Rust `repack` module): ggml's blocks split
// into a 16-byte-aligned `body` array (the quants; Q4_K and Q5_K keep their whole block,
// Q6_K all but `d`; the K-quants with their scales or quant bits regrouped, see the Rust
// `format` module), an optional `qh` array (one u32 of 5th bits per Q5_0/Q5_1 block) and
// a `sc` array (Q4_0/Q5_0/Q8_0/Q6_K: half d; Q4_1/Q5_1: half2 (d, m)), so every load is
// aligned and vectorised.
//
// Work unit: a chunk of 32 consecutive values of a row. Lane l of a warp takes chunks
// l, l+32, ...; a warp owns R rows and reads each activation chunk once for all of them.
// Three activation formats, chosen per launch (template parameter A):
//   - A_F32: x in f32, weights dequantised in registers, f32 FMAs;
//   - A_Q8: x quantised to int8 per 32-block (Q8_1), integer dot products with dp4a;
//   - A_Q16: the same int8 values plus their rounding residual as a second int8 plane
//     (see quantize_block_warp): two dp4a per four weights, activations exact to 15 bits
//     of each block's range instead of 8, combined exactly in an int32 before scaling.
// Epilogue: + bias[row] (optional), + residual[row] (optional). In SwiGLU mode the warp
// computes row r of both `gate` and `up` and writes silu(gate·x) * (up·x).

#define A_F32 0
#define A_Q8 1
#define A_Q16 2

#define T_F32 0
#define T_F16 1
#define T_Q4_0 2
#define T_Q4_1 3
#define T_Q5_0 6
#define T_Q5_1 7
#define T_Q8_0 8
#define T_Q2_K 10
#define T_Q3_K 11
#define T_Q4_K 12
#define T_Q5_K 13
#define T_Q6_K 14
#define T_IQ4_NL 20
#define T_IQ4_XS 23
#define T_MXFP4 39
#define T_IQ2_XXS 16
#define T_IQ2_XS 17
#define T_IQ3_XXS 18
#define T_IQ1_S 19
#define T_IQ3_S 21
#define T_IQ2_S 22
#define T_IQ1_M 29
#define T_BF16 30
// kiln's own device formats (not ggml ids): Q4_0 blocks in groups of four rows.
#define T_Q4_0X4 102

// Weights stored as plain floats, one value per element.
static constexpr __host__ __device__ bool float_weights(int t) { return t == T_F32 || t == T_F16 || t == T_BF16; }

// A 16-bit float weight of type T to f32.
template <int T> static __device__ __forceinline__ float h16(u32 bits) {
    return T == T_BF16 ? __uint_as_float(bits << 16) : h2f((u16)bits);
}

template <int T> struct Traits;
template <> struct Traits<T_F32> { static const int BLOCK = 1, BODY = 4, SC = 0; };
template <> struct Traits<T_F16> { static const int BLOCK = 1, BODY = 2, SC = 0; };
template <> struct Traits<T_BF16> { static const int BLOCK = 1, BODY = 2, SC = 0; };
template <> struct Traits<T_Q4_0> { static const int BLOCK = 32, BODY = 16, SC = 2; };
template <> struct Traits<T_Q4_1> { static const int BLOCK = 32, BODY = 16, SC = 4; };
template <> struct Traits<T_Q5_0> { static const int BLOCK = 32, BODY = 16, SC = 2; };
template <> struct Traits<T_Q5_1> { static const int BLOCK = 32, BODY = 16, SC = 4; };
template <> struct Traits<T_Q8_0> { static const int BLOCK = 32, BODY = 32, SC = 2; };
// Q2_K and Q3_K in their device layouts (the Rust `q2k_block_for_device` /
// `q3k_block_for_device`): the body holds each 32-value chunk's 2-bit codes (and Q3_K's third
// bits) together; `sc` the super-block scale(s) and the sub-block scales.
template <> struct Traits<T_Q2_K> { static const int BLOCK = 256, BODY = 64, SC = 20; };
template <> struct Traits<T_Q3_K> { static const int BLOCK = 256, BODY = 96, SC = 14; };
template <> struct Traits<T_Q4_K> { static const int BLOCK = 256, BODY = 144, SC = 0; };
template <> struct Traits<T_Q5_K> { static const int BLOCK = 256, BODY = 176, SC = 0; };
template <> struct Traits<T_Q6_K> { static const int BLOCK = 256, BODY = 208, SC = 2; };
template <> struct Traits<T_Q4_0X4> { static const int BLOCK = 32, BODY = 16, SC = 2; };
// IQ4_XS's body is the 128 code bytes of a super-block, its `sc` the 8 bytes before them
// (d, the high scale bits, the low scale nibbles).
template <> struct Traits<T_IQ4_NL> { static const int BLOCK = 32, BODY = 16, SC = 2; };
template <> struct Traits<T_IQ4_XS> { static const int BLOCK = 256, BODY = 128, SC = 8; };
// MXFP4: Q4_0's nibbles, the E8M0 exponent byte in `sc`.
template <> struct Traits<T_MXFP4> { static const int BLOCK = 32, BODY = 16, SC = 1; };
// The grid I-quants (see grid_chunk): the block's f16 d in `sc` (IQ2_XS, IQ2_S and IQ3_S
// moved to the block's end at upload, with the other fields `sc` holds), the rest in `body`.
template <> struct Traits<T_IQ2_XXS> { static const int BLOCK = 256, BODY = 64, SC = 2; };
template <> struct Traits<T_IQ2_XS> { static const int BLOCK = 256, BODY = 64, SC = 10; };
template <> struct Traits<T_IQ2_S> { static const int BLOCK = 256, BODY = 64, SC = 18; };
template <> struct Traits<T_IQ3_XXS> { static const int BLOCK = 256, BODY = 96, SC = 2; };
template <> struct Traits<T_IQ3_S> { static const int BLOCK = 256, BODY = 64, SC = 46; };
template <> struct Traits<T_IQ1_S> { static const int BLOCK = 256, BODY = 48, SC = 2; };
template <> struct Traits<T_IQ1_M> { static const int BLOCK = 256, BODY = 48, SC = 8; };

// Q4_0's values, whatever the row layout.
static constexpr __host__ __device__ bool q4_0_values(int t) { return t == T_Q4_0 || t == T_Q4_0X4; }

// Byte offsets of chunk c of `row` in the body and scale arrays of a 32-value-block type.
// Plain layout: block row * nblk + c. T_Q4_0X4 (rows in groups of four, see the Rust
// `format` module): in a group, tiles of up to 32 chunks, each row's blocks of a tile
// contiguous (lanes of a warp read 512 contiguous bytes per row); the four rows' scales of
// one chunk side by side.
template <int T>
static __device__ __forceinline__ void block_offsets(size_t row, size_t nblk, int c, size_t& body, size_t& sc) {
    typedef Traits<T> Tr;
    if constexpr (T == T_Q4_0X4) {
        const size_t g = row >> 2, r = row & 3;
        const int tile = c & ~31;
        const size_t width = min((size_t)32, nblk - (size_t)tile);
        body = ((g * nblk + tile) * 4 + r * width + (c & 31)) * Tr::BODY;
        sc = ((g * nblk + c) * 4 + r) * Tr::SC;
    } else {
        const size_t b = row * nblk + c;
        body = b * Tr::BODY;
        sc = b * Tr::SC;
    }
}

// One weight matrix: pointers to the start of its arrays and their per-row strides.
struct W {
    const u8* body;
    const u32* qh;
    const u8* sc;
};

// What a lane knows about the activation chunk it works on.
struct XChunk {
    float v[32];      // float path: the values (zero past the row's end)
    int q[8];         // integer paths: the int8 values, four per int
    int r[8];         // A_Q16: the residual plane
    float d, s;       // integer paths: the unit of IAcc::value() and the block's sum
    float sum, sum_lo; // float path: sum of all 32 / of the first 16 values
    int qsum_lo, qsum_hi; // integer paths: sum over each half in units of d (Q6_K's -32 offset)
};

// An integer dot product of weight bytes with the activation's int8 values and, for A_Q16,
// with its residual plane; value() is in units of XChunk::d.
template <int A> struct IAcc {
    int hi = 0, lo = 0;
    __device__ __forceinline__ void add(int w, const XChunk& x, int i) {
        hi = dp4a(w, x.q[i], hi);
        if (A == A_Q16) lo = dp4a(w, x.r[i], lo);
    }
    __device__ __forceinline__ int value() const { return A == A_Q16 ? hi * 254 + lo : hi; }
};

static __device__ __forceinline__ void load32(const u8* p, int (&o)[8]) {
    const uint4 a = *(const uint4*)p, b = *(const uint4*)(p + 16);
    o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w; o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
}

static __device__ __forceinline__ void load16(const u8* p, int (&o)[4]) {
    const uint4 a = *(const uint4*)p;
    o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w;
}

// sum over i of byte_i(qv) * x[base + i], bytes taken as unsigned
static __device__ __forceinline__ float fdot4u(u32 qv, const float* x) {
    return (float)(qv & 255) * x[0] + (float)((qv >> 8) & 255) * x[1] + (float)((qv >> 16) & 255) * x[2] +
           (float)(qv >> 24) * x[3];
}

static __device__ __forceinline__ float fdot4s(u32 qv, const float* x) {
    return (float)(i8)(qv & 255) * x[0] + (float)(i8)((qv >> 8) & 255) * x[1] + (float)(i8)((qv >> 16) & 255) * x[2] +
           (float)(i8)(qv >> 24) * x[3];
}

// Spreads 4 bits of `bits` into bit 4 of each byte.
static __device__ __forceinline__ u32 spread4(u32 bits) {
    return ((bits & 1) << 4) | ((bits & 2) << 11) | ((bits & 4) << 18) | ((bits & 8) << 25);
}

// Q2_K and Q3_K chunks (32 values, cc = 0..8 in a super-block) in the device layout, each
// with a scale per 16-value half. The chunk's 2-bit codes are two
// words (values 0..15, 16..31), value 4i + b of a word at bits 8b + 2i; Q3_K's third bits
// one word, value 4i + b (i = 0..7) at bit 8b + i, its codes 0..7 standing for −4..3.
// - Q2_K: w = d·s·q − dmin·m per half; s and m the low and high nibbles of the half's byte.
// - Q3_K: w = d·s·(q − 4) per half, s 6 bits less 32: the low nibbles in byte cc of the
//   scale bytes (half 0 low, half 1 high), the high 2-bit parts in byte 8 + cc / 2 at
//   4·(cc mod 2) (half 0, then half 1).
struct K23Codes {
    uint2 plane;  // the 2-bit codes
    u32 hb;       // Q3_K's third bits
};

template <int T>
static __device__ __forceinline__ K23Codes k23_codes(const W& w, size_t b, int cc) {
    const u8* body = w.body + b * Traits<T>::BODY;
    K23Codes k;
    k.plane = *(const uint2*)(body + 8 * cc);
    k.hb = T == T_Q3_K ? *(const u32*)(body + 64 + 4 * cc) : 0u;
    return k;
}

// Codes 4i..4i+3 of the chunk (i = 0..7) as bytes.
template <int T>
static __device__ __forceinline__ u32 k23_word(const K23Codes& k, int i) {
    u32 v = ((i < 4 ? k.plane.x : k.plane.y) >> (2 * (i & 3))) & 0x03030303;
    if constexpr (T == T_Q3_K) v |= ((k.hb >> i) & 0x01010101) << 2;
    return v;
}

// The chunk's scales: w = d·s0·q − m0 (first half), d·s1·q − m1 (second); Q3_K's codes are
// then less 4 and its m0 = m1 = 0.
template <int T>
static __device__ __forceinline__ void k23_scales(const W& w, size_t b, int cc, float& d, float& s0, float& s1,
                                                  float& m0, float& m1) {
    const u8* sc = w.sc + b * Traits<T>::SC;
    if constexpr (T == T_Q2_K) {
        const u32 dm = *(const u32*)sc;
        const u32 sm = *(const u16*)(sc + 4 + 2 * cc);
        const float dmin = h2f(dm >> 16);
        d = h2f(dm & 0xffff);
        s0 = (float)(sm & 15);
        s1 = (float)((sm >> 8) & 15);
        m0 = dmin * (float)((sm >> 4) & 15);
        m1 = dmin * (float)(sm >> 12);
    } else {
        d = ld_h(sc);
        const u32 lo = sc[2 + cc], hi = (u32)sc[10 + (cc >> 1)] >> (4 * (cc & 1));
        s0 = (float)((int)((lo & 15) | ((hi & 3) << 4)) - 32);
        s1 = (float)((int)((lo >> 4) | (((hi >> 2) & 3) << 4)) - 32);
        m0 = m1 = 0.0f;
    }
}

// The whole chunk: its codes four to a word in value order (values 0..15 in q[0..4], 16..31
// in q[4..8], like the activation's planes) and its scales.
template <int T>
static __device__ __forceinline__ void k23_chunk(const W& w, size_t b, int cc, int (&q)[8], float& d, float& s0,
                                                 float& s1, float& m0, float& m1) {
    const K23Codes k = k23_codes<T>(w, b, cc);
#pragma unroll
    for (int i = 0; i < 8; ++i) q[i] = (int)k23_word<T>(k, i);
    k23_scales<T>(w, b, cc, d, s0, s1, m0, m1);
}

// Formats whose 4-bit codes index a table of 16 signed levels: the I-quants' non-linear
// levels (ggml's kvalues_iq4nl) and MXFP4's E2M1 values doubled (kvalues_mxfp4), four to a
// word.
#define IQ4_LEVELS_0 0xbfad9881u  // -127 -104  -83  -65
#define IQ4_LEVELS_1 0xf6eaddcfu  //  -49  -35  -22  -10
#define IQ4_LEVELS_2 0x26190d01u  //    1   13   25   38
#define IQ4_LEVELS_3 0x71594535u  //   53   69   89  113
#define MXFP4_LEVELS_0 0x03020100u  //   0   1   2   3
#define MXFP4_LEVELS_1 0x0c080604u  //   4   6   8  12
#define MXFP4_LEVELS_2 0xfdfeff00u  //   0  -1  -2  -3
#define MXFP4_LEVELS_3 0xf4f8fafcu  //  -4  -6  -8 -12

static constexpr __host__ __device__ bool levels4_type(int t) {
    return t == T_IQ4_NL || t == T_IQ4_XS || t == T_MXFP4;
}

// Four codes (one per byte, 0..15) to their int8 levels: two 8-entry byte_perm lookups and
// a third that keeps, per byte, the half its code's bit 3 names.
template <int T>
static __device__ __forceinline__ u32 levels4(u32 codes) {
    constexpr bool mx = T == T_MXFP4;
    const u32 sel = (codes & 0xf) | ((codes >> 4) & 0xf0) | ((codes >> 8) & 0xf00) | ((codes >> 12) & 0xf000);
    // prmt reads a selector's bit 3 as "replicate the sign": the lookups take bits 0-2 only.
    const u32 lo = __byte_perm(mx ? MXFP4_LEVELS_0 : IQ4_LEVELS_0, mx ? MXFP4_LEVELS_1 : IQ4_LEVELS_1, sel & 0x7777);
    const u32 hi = __byte_perm(mx ? MXFP4_LEVELS_2 : IQ4_LEVELS_2, mx ? MXFP4_LEVELS_3 : IQ4_LEVELS_3, sel & 0x7777);
    return __byte_perm(lo, hi, 0x3210 | ((sel & 0x8888) >> 1));
}

// MXFP4's block scale: half of 2^(e − 127), exactly (ggml's GGML_E8M0_TO_FP32_HALF; e = 0
// and 1 give subnormals).
static __device__ __forceinline__ float e8m0_half(u32 e) {
    return __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
}

// Chunk c (32 values) of a level-table row: where its 16 code bytes are (value j is the
// low nibble of byte j, value 16 + j its high nibble, as in Q4_0) and its scale (IQ4_XS:
// d·(ls − 32) for the sub-block's 6-bit ls, its low nibble in byte ib / 2 of scales_l, its
// high 2 bits at 2·ib of scales_h).
template <int T>
static __device__ __forceinline__ const u8* levels4_codes(const W& w, size_t row, int K, int c, float& d) {
    if constexpr (T == T_IQ4_NL || T == T_MXFP4) {
        const size_t b = row * ((size_t)K / 32) + c;
        d = T == T_MXFP4 ? e8m0_half(w.sc[b]) : ld_h(w.sc + b * 2);
        return w.body + b * 16;
    } else {
        const size_t b = row * ((size_t)K / 256) + (c >> 3);
        const int ib = c & 7;
        const uint2 s = *(const uint2*)(w.sc + b * 8);
        const int ls = (int)(((s.y >> (4 * ib)) & 15) | (((s.x >> (16 + 2 * ib)) & 3) << 4));
        d = h2f(s.x & 0xffff) * (float)(ls - 32);
        return w.body + b * 128 + 16 * ib;
    }
}

// Chunk c's levels as signed bytes, four to a word in value order (values 0..15 in q[0..4],
// 16..31 in q[4..8], like the activation's planes), and its scale.
template <int T>
static __device__ __forceinline__ void levels4_chunk(const W& w, size_t row, int K, int c, int (&q)[8], float& d) {
    int qs[4];
    load16(levels4_codes<T>(w, row, K, c, d), qs);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        q[i] = (int)levels4<T>(qs[i] & 0x0f0f0f0f);
        q[4 + i] = (int)levels4<T>((qs[i] >> 4) & 0x0f0f0f0f);
    }
}

// The grid I-quants: a 256-value super-block's values come in groups of 8 (4 for the IQ3
// types) read from a lattice by index (iq_grids.cuh, defined in these types' modules only),
// signed, and scaled per 32 values (per 16: IQ2_XS, IQ2_S, IQ1_M). Layouts as core's
// quant::iquants_grid describes them, with `body` and `sc` as Traits says.
static constexpr __host__ __device__ bool grid_type(int t) {
    return t == T_IQ2_XXS || t == T_IQ2_XS || t == T_IQ2_S || t == T_IQ3_XXS || t == T_IQ3_S || t == T_IQ1_S ||
           t == T_IQ1_M;
}
// Grid types with a scale per 16 values (the rest: per 32).
static constexpr __host__ __device__ bool grid_halves(int t) { return t == T_IQ2_XS || t == T_IQ2_S || t == T_IQ1_M; }

extern __device__ const unsigned long long iq2xxs_grid[256];
extern __device__ const unsigned long long iq2xs_grid[512];
extern __device__ const unsigned long long iq2s_grid[1024];
extern __device__ const unsigned int iq3xxs_grid[256];
extern __device__ const unsigned int iq3s_grid[512];
extern __device__ const unsigned long long iq1s_grid[2048];

// Four magnitudes (bytes of w) with the signs of `bits` (bit j negates byte j).
static __device__ __forceinline__ u32 signed4(u32 w, u32 bits) {
    const u32 m = (((bits & 15) * 0x00204081u) & 0x01010101u) * 0xffu;
    return __vsub4(w ^ m, m);
}

// ggml's ksigns_iq2xs: a 7-bit index's eight signs, the eighth making the count even.
static __device__ __forceinline__ u32 ksigns(u32 i) { return i | ((__popc(i) & 1) << 7); }

// A group of 8 grid values with 8 signs into two words of q.
static __device__ __forceinline__ void grid_group8(unsigned long long row, u32 signs, int* q) {
    q[0] = (int)signed4((u32)row, signs);
    q[1] = (int)signed4((u32)(row >> 32), signs >> 4);
}

// IQ1's values g + delta (g in −1, 0, 1, delta ±1/8) as the integers 8g ± 1 (its scale
// then carries the 1/8): four values of a grid row's word.
static __device__ __forceinline__ int iq1_word(u32 w, bool minus) {
    return (int)__vadd4((w << 3) & 0xf8f8f8f8u, minus ? 0xffffffffu : 0x01010101u);
}

// Chunk c (32 values) of a grid-type row as signed bytes, four to a word in value order
// (values 0..15 in q[0..4], 16..31 in q[4..8]), and the scales of its halves (s0 = s1 for
// the types with a scale per 32 values).
template <int T>
static __device__ __forceinline__ void grid_chunk(const W& w, size_t row, int K, int c, int (&q)[8], float& s0,
                                                  float& s1) {
    typedef Traits<T> Tr;
    const size_t b = row * ((size_t)K / 256) + (c >> 3);
    const int ib = c & 7;
    const u8* body = w.body + b * Tr::BODY;
    const u8* sc = w.sc + b * Tr::SC;
    if constexpr (T == T_IQ2_XXS) {
        // Sub-block ib: four grid indices, then four 7-bit sign indices under a 4-bit scale.
        const uint2 v = *(const uint2*)(body + 8 * ib);
        s0 = s1 = ld_h(sc) * (0.5f + (float)(v.y >> 28)) * 0.25f;
#pragma unroll
        for (int l = 0; l < 4; ++l)
            grid_group8(iq2xxs_grid[(v.x >> (8 * l)) & 255], ksigns((v.y >> (7 * l)) & 127), q + 2 * l);
    } else if constexpr (T == T_IQ2_XS || T == T_IQ2_S) {
        // sc: IQ2_XS's 8 scale bytes then d; IQ2_S's 8 index-top bytes, 8 scale bytes, d.
        constexpr int scales_at = T == T_IQ2_XS ? 0 : 8, d_at = T == T_IQ2_XS ? 8 : 16;
        const u32 ls = sc[scales_at + ib];
        const float d = ld_h(sc + d_at);
        s0 = d * (0.5f + (float)(ls & 15)) * 0.25f;
        s1 = d * (0.5f + (float)(ls >> 4)) * 0.25f;
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const int i = 4 * ib + l;
            if constexpr (T == T_IQ2_XS) {
                const u32 v = *(const u16*)(body + 2 * i);
                grid_group8(iq2xs_grid[v & 511], ksigns(v >> 9), q + 2 * l);
            } else {
                const u32 top = (sc[ib] >> (2 * l)) & 3;
                grid_group8(iq2s_grid[body[i] | (top << 8)], body[32 + i], q + 2 * l);
            }
        }
    } else if constexpr (T == T_IQ3_XXS) {
        // 64 index bytes (a grid row of 4 each), then a word a sub-block as IQ2_XXS's second.
        const u32 aux = *(const u32*)(body + 64 + 4 * ib);
        s0 = s1 = ld_h(sc) * (0.5f + (float)(aux >> 28)) * 0.5f;
        const uint2 idx = *(const uint2*)(body + 8 * ib);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const u32 signs = ksigns((aux >> (7 * (j >> 1))) & 127) >> (4 * (j & 1));
            q[j] = (int)signed4(iq3xxs_grid[((j < 4 ? idx.x : idx.y) >> (8 * (j & 3))) & 255], signs);
        }
    } else if constexpr (T == T_IQ3_S) {
        // sc: 8 index-top bytes (a bit a group of 4), 32 sign bytes, 4 scale bytes, d.
        const u32 ls = (sc[40 + (ib >> 1)] >> (4 * (ib & 1))) & 15;
        s0 = s1 = ld_h(sc + 44) * (float)(1 + 2 * ls);
        const u32 tops = sc[ib];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const u32 idx = body[8 * ib + j] | (((tops >> j) & 1) << 8);
            q[j] = (int)signed4(iq3s_grid[idx], sc[8 + 4 * ib + (j >> 1)] >> (4 * (j & 1)));
        }
    } else if constexpr (T == T_IQ1_S) {
        // 32 low index bytes, then a u16 a sub-block: four 3-bit index tops, a 3-bit scale,
        // the delta's sign in bit 15.
        const u32 qh = *(const u16*)(body + 32 + 2 * ib);
        s0 = s1 = ld_h(sc) * (float)(2 * ((qh >> 12) & 7) + 1) * 0.125f;
        const bool minus = qh & 0x8000;
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const unsigned long long r = iq1s_grid[body[4 * ib + l] | (((qh >> (3 * l)) & 7) << 8)];
            q[2 * l] = iq1_word((u32)r, minus);
            q[2 * l + 1] = iq1_word((u32)(r >> 32), minus);
        }
    } else {  // IQ1_M
        // 32 low index bytes, 16 bytes of nibbles (3-bit index top, the delta's sign in bit
        // 3), then sc: four u16 of 3-bit scales (one per 16 values) whose top nibbles make d.
        const uint2 sw = *(const uint2*)sc;
        const u32 s01 = sw.x, s23 = sw.y;
        const u32 dbits = ((s01 >> 12) & 0xf) | ((s01 >> 24) & 0xf0) | ((s23 >> 4) & 0xf00) | ((s23 >> 16) & 0xf000);
        const float d = h2f((u16)dbits);
        // Scale k (0..16) is bits 3·(k % 4) of u16 k / 4.
        const u32 sk = ib < 4 ? s01 : s23;
        const int k0 = 2 * ib;
        const u32 half = (k0 / 4) & 1 ? sk >> 16 : sk & 0xffff;
        s0 = d * (float)(2 * ((half >> (3 * (k0 % 4))) & 7) + 1) * 0.125f;
        s1 = d * (float)(2 * ((half >> (3 * (k0 % 4 + 1))) & 7) + 1) * 0.125f;
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const int i = 4 * ib + l;
            const u32 nib = (body[32 + (i >> 1)] >> (4 * (i & 1))) & 15;
            const unsigned long long r = iq1s_grid[body[i] | ((nib & 7) << 8)];
            q[2 * l] = iq1_word((u32)r, nib & 8);
            q[2 * l + 1] = iq1_word((u32)(r >> 32), nib & 8);
        }
    }
}

// Q4_K / Q5_K sub-block scales and mins, 6 bits each, from the block's 12 scale bytes in
// the device layout (the Rust `kquant_scales_for_device`; w0..w2 are bytes 0-3, 4-7, 8-11):
// byte j (0..8) holds sub-block j's low 4 bits (scale, then min above it), byte 8 + p the
// high 2 bits of sub-blocks 2p and 2p+1 (scale 2p, min 2p, scale 2p+1, min 2p+1 from bit
// 0). The same shifts serve every j, so lanes decoding different sub-blocks never diverge.
static __device__ __forceinline__ void k4_scale_min_w(u32 w0, u32 w1, u32 w2, int j, int& sc, int& m) {
    const u32 lo = ((j < 4 ? w0 : w1) >> (8 * (j & 3))) & 255;
    const u32 hi = (w2 >> (4 * j)) & 15;
    sc = (int)((lo & 15) | ((hi & 3) << 4));
    m = (int)((lo >> 4) | ((hi >> 2) << 4));
}

// Sub-blocks 2p and 2p+1 at once (what a GEMV lane takes, see dot_pair_k).
static __device__ __forceinline__ void k4_scale_min_pair(u32 w0, u32 w1, u32 w2, int p, int& sc0, int& m0, int& sc1,
                                                         int& m1) {
    const u32 lo = (p < 2 ? w0 : w1) >> (16 * (p & 1));
    const u32 hi = w2 >> (8 * p);
    sc0 = (int)((lo & 15) | ((hi & 3) << 4));
    m0 = (int)(((lo >> 4) & 15) | ((hi & 12) << 2));
    sc1 = (int)(((lo >> 8) & 15) | (hi & 48));
    m1 = (int)(((lo >> 12) & 15) | ((hi >> 2) & 48));
}

// Q4_K / Q5_K: sub-blocks 2p and 2p+1 share 32 bytes of qs (low and high nibbles), so a lane
// takes both — one 32-byte load, every nibble used. `u` counts 64-value units of the row.
template <int T, int A>
static __device__ __forceinline__ float dot_pair_k(const W& w, size_t row, int K, int u, const XChunk& x0, const XChunk& x1) {
    typedef Traits<T> Tr;
    const size_t nblk = (size_t)K / 256;
    const int p = u & 3;
    const u8* blk = w.body + (row * nblk + (u >> 2)) * Tr::BODY;
    const uint4 head = *(const uint4*)blk;  // d, dmin, scales[12]
    const float d = h2f(head.x & 0xffff), dmin = h2f(head.x >> 16);
    int sc0, m0, sc1, m1;
    k4_scale_min_pair(head.y, head.z, head.w, p, sc0, m0, sc1, m1);
    int qs[8];
    load32(blk + (T == T_Q4_K ? 16 : 48) + 32 * p, qs);
    int lo[8], hi[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        lo[i] = qs[i] & 0x0f0f0f0f;
        hi[i] = (qs[i] >> 4) & 0x0f0f0f0f;
    }
    if constexpr (T == T_Q5_K) {
        int qh[8];
        load32(blk + 16, qh);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            lo[i] |= ((qh[i] >> (2 * p)) & 0x01010101) << 4;
            hi[i] |= ((qh[i] >> (2 * p + 1)) & 0x01010101) << 4;
        }
    }
    if constexpr (A != A_F32) {
        IAcc<A> a0, a1;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            a0.add(lo[i], x0, i);
            a1.add(hi[i], x1, i);
        }
        return d * ((float)sc0 * x0.d * (float)a0.value() + (float)sc1 * x1.d * (float)a1.value()) -
               dmin * ((float)m0 * x0.s + (float)m1 * x1.s);
    } else {
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            s0 += fdot4u(lo[i], &x0.v[4 * i]);
            s1 += fdot4u(hi[i], &x1.v[4 * i]);
        }
        return d * ((float)sc0 * s0 + (float)sc1 * s1) - dmin * ((float)m0 * x0.sum + (float)m1 * x1.sum);
    }
}

// Chunk cc (0..8) of a Q6_K block in the device layout (the Rust `q6k_block_for_device`):
// its 6-bit codes as bytes, four to a word in value order (values 0..15 in q[0..4], 16..31
// in q[4..8], like the activation's planes), and the scales of its two 16-value halves.
// Low nibbles of values j and j + 16 share byte j of the chunk's 16; the high 2-bit parts
// of values 4i..4i+3 sit at bit 2(i mod 4) of the bytes of word i / 4 of its 8.
static __device__ __forceinline__ void q6k_chunk(const u8* blk, int cc, int (&q)[8], float& s0, float& s1) {
    int ql[4];
    load16(blk + 16 * cc, ql);
    const uint2 qh = *(const uint2*)(blk + 128 + 8 * cc);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        q[i] = (ql[i] & 0x0f0f0f0f) | (((qh.x >> (2 * i)) & 0x03030303) << 4);
        q[4 + i] = ((ql[i] >> 4) & 0x0f0f0f0f) | (((qh.y >> (2 * i)) & 0x03030303) << 4);
    }
    const u32 scales = *(const u16*)(blk + 192 + 2 * cc);
    s0 = (float)(i8)(scales & 255);
    s1 = (float)(i8)(scales >> 8);
}

// A chunk's two halves (values 0..15 and 16..31, the words q[0..3] and q[4..7]) dotted
// with the activation apart, for the types with a scale (or an offset) per half: integer
// sums on the 8-bit paths, float sums on A_F32 (SIGNED: the words hold signed bytes).
template <int A>
static __device__ __forceinline__ void halves_int(const int (&q)[8], const XChunk& x, int& lo, int& hi) {
    IAcc<A> a, b;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        a.add(q[i], x, i);
        b.add(q[4 + i], x, 4 + i);
    }
    lo = a.value();
    hi = b.value();
}

template <bool SIGNED>
static __device__ __forceinline__ void halves_float(const int (&q)[8], const XChunk& x, float& lo, float& hi) {
    lo = 0.0f;
    hi = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        lo += SIGNED ? fdot4s(q[i], &x.v[4 * i]) : fdot4u(q[i], &x.v[4 * i]);
        hi += SIGNED ? fdot4s(q[4 + i], &x.v[16 + 4 * i]) : fdot4u(q[4 + i], &x.v[16 + 4 * i]);
    }
}

// Dot product of chunk `c` of row `row` (row length K) with the activation chunk (every
// type but Q4_K/Q5_K, which go through dot_pair_k).
template <int T, int A>
static __device__ __forceinline__ float dot_chunk(const W& w, size_t row, int K, int c, const XChunk& x) {
    typedef Traits<T> Tr;
    const size_t nblk = (size_t)K / Tr::BLOCK;
    if constexpr (float_weights(T)) {
        // Float weights always take the float path.
        const int base = c * 32;
        float acc = 0.0f;
        if (T == T_F32) {
            const float* p = (const float*)w.body + row * K + base;
            if (base + 32 <= K && (K & 3) == 0) {
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const float4 f = ((const float4*)p)[i];
                    acc += f.x * x.v[4 * i] + f.y * x.v[4 * i + 1] + f.z * x.v[4 * i + 2] + f.w * x.v[4 * i + 3];
                }
            } else {
                for (int i = 0; i < 32 && base + i < K; ++i) acc += p[i] * x.v[i];
            }
        } else {
            const u16* p = (const u16*)w.body + row * K + base;
            if (base + 32 <= K && (K & 7) == 0) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const uint4 h = ((const uint4*)p)[i];
                    const u32 hv[4] = {h.x, h.y, h.z, h.w};
#pragma unroll
                    for (int k = 0; k < 4; ++k)
                        acc += h16<T>(hv[k] & 0xffff) * x.v[8 * i + 2 * k] + h16<T>(hv[k] >> 16) * x.v[8 * i + 2 * k + 1];
                }
            } else {
                for (int i = 0; i < 32 && base + i < K; ++i) acc += h16<T>(p[i]) * x.v[i];
            }
        }
        return acc;
    } else if constexpr (q4_0_values(T) || T == T_Q4_1 || T == T_Q5_0 || T == T_Q5_1) {
        const size_t b = row * nblk + c;
        size_t body_at, sc_at;
        block_offsets<T>(row, nblk, c, body_at, sc_at);
        int qs[4];
        load16(w.body + body_at, qs);
        int lo[4], hi[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            lo[i] = qs[i] & 0x0f0f0f0f;
            hi[i] = (qs[i] >> 4) & 0x0f0f0f0f;
        }
        if constexpr (T == T_Q5_0 || T == T_Q5_1) {
            const u32 qh = w.qh[b];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                lo[i] |= spread4(qh >> (4 * i));
                hi[i] |= spread4(qh >> (16 + 4 * i));
            }
        }
        float d, m = 0.0f;
        if constexpr (T == T_Q4_1 || T == T_Q5_1) {
            const u32 dm = *(const u32*)(w.sc + b * 4);
            d = h2f(dm & 0xffff);
            m = h2f(dm >> 16);
        } else {
            d = ld_h(w.sc + sc_at);
        }
        const float offset = q4_0_values(T) ? 8.0f : (T == T_Q5_0 ? 16.0f : 0.0f);
        if constexpr (A != A_F32) {
            IAcc<A> acc;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                acc.add(lo[i], x, i);
                acc.add(hi[i], x, 4 + i);
            }
            const int sumi = acc.value();
            if constexpr (T == T_Q4_1 || T == T_Q5_1) return d * x.d * (float)sumi + m * x.s;
            return d * (x.d * (float)sumi - offset * x.s);
        } else {
            float sum = 0.0f;
#pragma unroll
            for (int i = 0; i < 4; ++i) sum += fdot4u(lo[i], &x.v[4 * i]) + fdot4u(hi[i], &x.v[16 + 4 * i]);
            if constexpr (T == T_Q4_1 || T == T_Q5_1) return d * sum + m * x.sum;
            return d * (sum - offset * x.sum);
        }
    } else if constexpr (T == T_Q2_K || T == T_Q3_K) {
        // Q3_K's codes stand for q − 4: its offset, like Q6_K's 32, comes off each half's sum.
        const int off = T == T_Q3_K ? 4 : 0;
        int q[8];
        float d, s0, s1, m0, m1;
        k23_chunk<T>(w, row * ((size_t)K / 256) + (c >> 3), c & 7, q, d, s0, s1, m0, m1);
        if constexpr (A != A_F32) {
            int lo, hi;
            halves_int<A>(q, x, lo, hi);
            return x.d * (d * (s0 * (float)(lo - off * x.qsum_lo) + s1 * (float)(hi - off * x.qsum_hi)) -
                          (m0 * (float)x.qsum_lo + m1 * (float)x.qsum_hi));
        } else {
            float lo, hi;
            halves_float<false>(q, x, lo, hi);
            const float sum_hi = x.sum - x.sum_lo;
            return d * (s0 * (lo - off * x.sum_lo) + s1 * (hi - off * sum_hi)) - (m0 * x.sum_lo + m1 * sum_hi);
        }
    } else if constexpr (grid_type(T)) {
        int q[8];
        float s0, s1;
        grid_chunk<T>(w, row, K, c, q, s0, s1);
        if constexpr (A != A_F32) {
            int lo, hi;
            halves_int<A>(q, x, lo, hi);
            return x.d * (s0 * (float)lo + s1 * (float)hi);
        } else {
            float lo, hi;
            halves_float<true>(q, x, lo, hi);
            return s0 * lo + s1 * hi;
        }
    } else if constexpr (levels4_type(T)) {
        int q[8];
        float d;
        levels4_chunk<T>(w, row, K, c, q, d);
        if constexpr (A != A_F32) {
            IAcc<A> acc;
#pragma unroll
            for (int i = 0; i < 8; ++i) acc.add(q[i], x, i);
            return d * x.d * (float)acc.value();
        } else {
            float sum = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i) sum += fdot4s(q[i], &x.v[4 * i]);
            return d * sum;
        }
    } else if constexpr (T == T_Q8_0) {
        const size_t b = row * nblk + c;
        int qs[8];
        load32(w.body + b * 32, qs);
        const float d = ld_h(w.sc + b * 2);
        if constexpr (A != A_F32) {
            IAcc<A> acc;
#pragma unroll
            for (int i = 0; i < 8; ++i) acc.add(qs[i], x, i);
            return d * x.d * (float)acc.value();
        } else {
            float sum = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i) sum += fdot4s(qs[i], &x.v[4 * i]);
            return d * sum;
        }
    } else {  // Q6_K, in the device layout (the Rust `q6k_block_for_device`)
        const size_t b = row * nblk + (c >> 3);
        const int cc = c & 7;
        const u8* blk = w.body + b * Tr::BODY;
        int q[8];
        float s0, s1;
        q6k_chunk(blk, cc, q, s0, s1);
        const float d = ld_h(w.sc + b * 2);
        if constexpr (A != A_F32) {
            int lo, hi;
            halves_int<A>(q, x, lo, hi);
            return d * x.d * (s0 * (float)(lo - 32 * x.qsum_lo) + s1 * (float)(hi - 32 * x.qsum_hi));
        } else {
            float lo, hi;
            halves_float<false>(q, x, lo, hi);
            return d * (s0 * (lo - 32.0f * x.sum_lo) + s1 * (hi - 32.0f * (x.sum - x.sum_lo)));
        }
    }
}

static __device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Asks L2 for the weight bytes of unit `u` of `row` (what dot_chunk / dot_pair_k will load):
// issued before the kernel waits for its predecessor (programmatic dependent launch), so the
// weights stream in while the previous kernel finishes. Weights are never written during a
// step, so reading them early is safe; activations are only read after the wait.
template <int T>
static __device__ __forceinline__ void prefetch_unit(const W& w, size_t row, int K, int u) {
    typedef Traits<T> Tr;
    if constexpr (float_weights(T)) {
        prefetch_l2(w.body + (row * K + (size_t)u * 32) * Tr::BODY);
    } else if constexpr (T == T_Q4_K || T == T_Q5_K) {
        const u8* blk = w.body + (row * ((size_t)K / 256) + (u >> 2)) * Tr::BODY;
        prefetch_l2(blk);
        prefetch_l2(blk + Tr::BODY - 1);
    } else if constexpr (T == T_Q2_K || T == T_Q3_K) {
        const size_t b = row * ((size_t)K / 256) + (u >> 3);
        prefetch_l2(w.body + b * Tr::BODY + 8 * (u & 7));
        if constexpr (T == T_Q3_K) prefetch_l2(w.body + b * Tr::BODY + 64 + 4 * (u & 7));
        prefetch_l2(w.sc + b * Tr::SC);
    } else if constexpr (T == T_IQ4_XS) {
        const size_t b = row * ((size_t)K / 256) + (u >> 3);
        prefetch_l2(w.body + b * Tr::BODY + 16 * (u & 7));
        prefetch_l2(w.sc + b * Tr::SC);
    } else if constexpr (grid_type(T)) {
        const size_t b = row * ((size_t)K / 256) + (u >> 3);
        prefetch_l2(w.body + b * Tr::BODY);
        prefetch_l2(w.sc + b * Tr::SC);
    } else if constexpr (T == T_Q6_K) {
        const size_t b = row * ((size_t)K / 256) + (u >> 3);
        const int cc = u & 7;
        const u8* blk = w.body + b * Tr::BODY;
        prefetch_l2(blk + 16 * cc);
        prefetch_l2(blk + 128 + 8 * cc);
        prefetch_l2(blk + 192 + 2 * cc);
        prefetch_l2(w.sc + b * Tr::SC);
    } else {
        size_t body_at, sc_at;
        block_offsets<T>(row, (size_t)K / 32, u, body_at, sc_at);
        prefetch_l2(w.body + body_at);
        prefetch_l2(w.sc + sc_at);
        if constexpr (T == T_Q5_0 || T == T_Q5_1) prefetch_l2(w.qh + row * ((size_t)K / 32) + u);
    }
}

// The activation a GEMV reads: f32 values (A_F32), or the quantised planes. `norm_parts`,
// when not null, says the planes still lack RMSNorm's 1/rms factor: they hold x·w (the norm
// weight applied, see GemvOut) and norm_parts[g] is sum(x²) over 32-value group g. Block
// quantisation is scale-invariant (the int8 values are the same either way) and a dot
// product is linear, so the GEMV applies rsqrt(sum/K + eps) to each finished row instead
// of a separate launch normalising the vector first.
struct XIn {
    const float* __restrict__ x;
    const i8* __restrict__ q;
    const i8* __restrict__ r;
    const float2* __restrict__ ds;
    const float* __restrict__ norm_parts;
    float eps;
};

template <int T, int A>
static __device__ __forceinline__ void load_x(XChunk& xc, const XIn& in, int c, int K) {
    if constexpr (A == A_F32) {
        const float* x = in.x;
        const int base = c * 32;
        if (base + 32 <= K && (K & 3) == 0) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float4 f = ((const float4*)(x + base))[i];
                xc.v[4 * i] = f.x; xc.v[4 * i + 1] = f.y; xc.v[4 * i + 2] = f.z; xc.v[4 * i + 3] = f.w;
            }
        } else {
#pragma unroll
            for (int i = 0; i < 32; ++i) xc.v[i] = base + i < K ? x[base + i] : 0.0f;
        }
        if (!float_weights(T)) {
            float lo = 0.0f, hi = 0.0f;
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                lo += xc.v[i];
                hi += xc.v[16 + i];
            }
            xc.sum_lo = lo;
            xc.sum = lo + hi;
        }
    } else {
        load32((const u8*)(in.q + (size_t)c * 32), xc.q);
        if (A == A_Q16) load32((const u8*)(in.r + (size_t)c * 32), xc.r);
        const float2 ds = in.ds[c];
        xc.d = A == A_Q16 ? ds.x * (1.0f / 254.0f) : ds.x;
        if constexpr (float_weights(T)) {
            // Float weights take the float path on the dequantised activation.
#pragma unroll
            for (int i = 0; i < 32; ++i) {
                const int q = (i8)(xc.q[i >> 2] >> (8 * (i & 3)));
                const int r = A == A_Q16 ? (int)(i8)(xc.r[i >> 2] >> (8 * (i & 3))) : 0;
                xc.v[i] = xc.d * (float)(A == A_Q16 ? 254 * q + r : q);
            }
        } else {
            IAcc<A> lo, hi;  // sums of the values over each half, in units of xc.d
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                lo.add(0x01010101, xc, i);
                hi.add(0x01010101, xc, 4 + i);
            }
            // ds.y is d * sum(q); the residual plane adds its own (exact) share.
            xc.s = A == A_Q16 ? ds.y + xc.d * (float)(lo.lo + hi.lo) : ds.y;
            xc.qsum_lo = lo.value();
            xc.qsum_hi = hi.value();
        }
    }
}

// What a GEMV does with its outputs: y = scale·(W·x (+ bias)) (+ residual), or in SwiGLU mode
// y = glu(gate·x (+ bg), up·x (+ bu)) (SiLU, GELU or gpt-oss's clamped form). With `q` (QOUT
// kernels, whose blocks own whole 32-row groups) it also quantises y·norm_w (norm_w
// optional) into the next GEMV's planes, and writes the group's sum(y²) to
// norm_parts[group]: the next RMSNorm, left for the consumer to finish (see XIn). Partial sums in fixed slots, summed in a fixed order, keep every step
// bit-reproducible (float atomics would not be).
struct GemvOut {
    const float* __restrict__ bias;
    const float* residual;  // may be `y` itself (x += W·a): each output is read, then written, by one thread
    float* y;
    const float* __restrict__ norm_w;
    i8* __restrict__ q;
    i8* __restrict__ r;
    float2* __restrict__ ds;
    float* __restrict__ norm_parts;
    int act;             // SwiGLU mode: the gated activation (`glu` in common.cuh)
    float alpha, limit;  // its constants (act 2)
    float scale;  // 1 but for models that scale a branch or the logits (Granite)
};

// A block is NW warps. S warps share R rows, each taking every S-th chunk (split-K inside
// the block, so short rows still put many loads in flight); NW / S such groups per block.
// `bx` is the block's index in the grid (blockIdx.x), passed in so a caller may run the
// tile as another block.
template <int R, int S, int NW>
struct GemvTile {
    static constexpr int RB = NW / S * R;  // rows per block
    int lane, part, row0;
    __device__ __forceinline__ GemvTile(int bx) {
        lane = threadIdx.x & 31;
        const int warp = threadIdx.x >> 5;
        part = warp % S;
        row0 = bx * RB + warp / S * R;
    }
};

// A lane's unit of work: one 32-value chunk, or two for Q4_K/Q5_K (see dot_pair_k).
template <int T> static constexpr __host__ __device__ int gemv_unit() { return (T == T_Q4_K || T == T_Q5_K) ? 2 : 1; }

// Asks L2 for the weights of this lane's first PREFETCH units (see prefetch_unit): issued
// before the GEMV waits for its input, so the weights stream in meanwhile. Bounded so a
// huge matrix does not flush L2 ahead of use.
template <int T, int R, int S, int NW, bool SWIGLU>
static __device__ __forceinline__ void gemv_prefetch(W w, W w2, int nrows, int K, int bx) {
    const GemvTile<R, S, NW> t(bx);
    const int nchunks = (K + 31) >> 5;
    constexpr int U = gemv_unit<T>();
    constexpr int PREFETCH = 2;
    if (t.row0 >= nrows) return;
#pragma unroll
    for (int i = 0; i < PREFETCH; ++i) {
        const int u = t.part * 32 + t.lane + i * 32 * S;
        if (u * U >= nchunks) break;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const size_t row = (size_t)min(t.row0 + r, nrows - 1);
            prefetch_unit<T>(w, row, K, u);
            if (SWIGLU) prefetch_unit<T>(w2, row, K, u);
        }
    }
}

// The GEMV proper, once its input is ready.
// `row_base` is the first row of the matrix within `w` (an expert's, see ExpertSel): row r
// of the result is row row_base + r of the weights, and of their biases.
template <int T, int A, int R, int S, int NW, bool SWIGLU, bool QOUT>
static __device__ __forceinline__ void gemv_compute(W w, W w2, const XIn in, const GemvOut out, int nrows, int K,
                                                    int bx, size_t row_base = 0) {
    const GemvTile<R, S, NW> t(bx);
    const int lane = t.lane, warp = threadIdx.x >> 5, part = t.part, row0 = t.row0;
    constexpr int RB = GemvTile<R, S, NW>::RB;
    static_assert(!QOUT || RB == 32, "a quantising GEMV block owns one 32-row group");
    const int nchunks = (K + 31) >> 5;
    constexpr int U = gemv_unit<T>();
    // The pending norm's partial sums: loaded now, used after the loop, so their latency
    // hides behind the weight loads.
    float norm_part = 0.0f;
    if (in.norm_parts)
        for (int g = lane; g < nchunks; g += 32) norm_part += in.norm_parts[g];
    float acc[R], acc2[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = acc2[r] = 0.0f;
    XChunk xc[U];
    if (row0 < nrows) {
        for (int u = part * 32 + lane; u * U < nchunks; u += 32 * S) {
#pragma unroll
            for (int i = 0; i < U; ++i) load_x<T, A>(xc[i], in, u * U + i, K);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                // Rows past the end clamp to the last one: the loads stay in bounds and the
                // result is never written.
                const size_t row = row_base + (size_t)min(row0 + r, nrows - 1);
                if constexpr (U == 2) {
                    acc[r] += dot_pair_k<T, A>(w, row, K, u, xc[0], xc[1]);
                    if (SWIGLU) acc2[r] += dot_pair_k<T, A>(w2, row, K, u, xc[0], xc[1]);
                } else {
                    acc[r] += dot_chunk<T, A>(w, row, K, u, xc[0]);
                    if (SWIGLU) acc2[r] += dot_chunk<T, A>(w2, row, K, u, xc[0]);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        acc[r] = warp_sum(acc[r]);
        if (SWIGLU) acc2[r] = warp_sum(acc2[r]);
    }
    if (S > 1) {
        __shared__ float red[NW][2][R];
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                red[warp][0][r] = acc[r];
                red[warp][1][r] = acc2[r];
            }
        }
        __syncthreads();
        if (part == 0) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                float a = 0.0f, b = 0.0f;
                for (int p = 0; p < S; ++p) {
                    a += red[warp + p][0][r];
                    b += red[warp + p][1][r];
                }
                acc[r] = a;
                acc2[r] = b;
            }
        }
    }
    // Every warp sums the partials the same way: the same scale in every block.
    const float norm_ss = in.norm_parts ? warp_sum(norm_part) : 0.0f;
    __shared__ float group_vals[QOUT ? 32 : 1];
    if (part == 0 && lane < R && row0 + lane < nrows) {
        float v = 0.0f, v2 = 0.0f;
#pragma unroll
        for (int r = 0; r < R; ++r)
            if (r == lane) {
                v = acc[r];
                v2 = acc2[r];
            }
        const int row = row0 + lane;
        if (in.norm_parts) {
            const float scale = rsqrtf(norm_ss / (float)K + in.eps);
            v *= scale;
            v2 *= scale;
        }
        if (SWIGLU) {
            // Gated biases: each matrix's gate rows' then its up rows' (an expert's at
            // 2·row_base).
            if (out.bias) {
                v += out.bias[2 * row_base + row];
                v2 += out.bias[2 * row_base + nrows + row];
            }
            v = glu(v, v2, out.act, out.alpha, out.limit);
        } else {
            if (out.bias) v += out.bias[row_base + row];
            v *= out.scale;
            if (out.residual) v += out.residual[row];
        }
        out.y[row] = v;
        if (QOUT) group_vals[row - bx * RB] = v;
    }
    if constexpr (QOUT) {
        __syncthreads();
        if (warp == 0) {
            const int row = bx * 32 + lane;
            float v = row < nrows ? group_vals[lane] : 0.0f;
            if (out.norm_parts) {
                const float ss = warp_sum(v * v);
                if (lane == 0) out.norm_parts[bx] = ss;
            }
            if (out.norm_w && row < nrows) v *= out.norm_w[row];
            quantize_block_warp(v, out.q, out.r, out.ds, row, bx);
        }
    }
}

// A Mixture of Experts' GEMVs: `w` holds every expert's matrix of `nrows` rows one after
// another (rows are addressed linearly from a matrix's start in every format, so expert e's
// is rows e·nrows..), and grid row y (blockIdx.y), a slot, multiplies expert ids[y]'s.
// Slot y reads input y / slots_per_input (1: its own, the down projection after each
// expert's activation; a token's expert count: that token's) or, with 0, the one input
// every slot shares; it writes its own output. The ids are written by the routing kernel
// just before, so they are read after the wait.
// With `order`, grid row y runs slot order[y]: a batch's slots sorted by expert, so the
// blocks running at once share an expert and read its rows from L2 (the results do not
// depend on the order).
struct ExpertSel {
    const int* ids;  // null: an ordinary GEMV
    int slots_per_input;
    const int* order;
};

// One GEMV launch: prefetch this block's first weights, wait for the previous kernel
// (programmatic dependent launch), compute. An experts' launch cannot prefetch: which rows
// it reads is known only after the wait.
template <int T, int A, int R, int S, int NW, bool SWIGLU, bool QOUT>
static __device__ __forceinline__ void gemv(W w, W w2, XIn in, GemvOut out, int nrows, int K, ExpertSel sel) {
    if (!sel.ids) {
        gemv_prefetch<T, R, S, NW, SWIGLU>(w, w2, nrows, K, blockIdx.x);
        grid_dependency_wait();
        gemv_compute<T, A, R, S, NW, SWIGLU, QOUT>(w, w2, in, out, nrows, K, blockIdx.x);
        return;
    }
    grid_dependency_wait();
    const size_t slot = sel.order ? (size_t)sel.order[blockIdx.y] : blockIdx.y;
    if (sel.slots_per_input) {
        const size_t input = slot / sel.slots_per_input;
        const size_t padded = (size_t)((K + 31) & ~31);
        if (in.x) in.x += input * K;
        if (in.q) in.q += input * padded;
        if (in.r) in.r += input * padded;
        if (in.ds) in.ds += input * padded / 32;
        if (in.norm_parts) in.norm_parts += input * padded / 32;
    }
    const size_t padded_out = (size_t)((nrows + 31) & ~31);
    out.y += slot * nrows;
    if (out.residual) out.residual += slot * nrows;
    if (out.q) out.q += slot * padded_out;
    if (out.r) out.r += slot * padded_out;
    if (out.ds) out.ds += slot * padded_out / 32;
    if (out.norm_parts) out.norm_parts += slot * padded_out / 32;
    gemv_compute<T, A, R, S, NW, SWIGLU, QOUT>(w, w2, in, out, nrows, K, blockIdx.x, (size_t)sel.ids[slot] * nrows);
}

// Row `*token` of a weight matrix, dequantised to f32 (the token embedding lookup). Thread
// i computes value i as the dot product of its chunk with a one-hot vector, so the lookup
// shares every line of dequantisation code with the GEMVs it feeds. With `out.q` a warp
// (one 32-value group) also writes the first layer's quantised input, as GemvOut says.
template <int T>
static __device__ __forceinline__ void embed(W w, const int* __restrict__ token, const GemvOut out, int nrows, int K,
                                             float scale, int bx) {
    const int i = bx * blockDim.x + threadIdx.x;
    if ((i & ~31) >= K) return;  // whole warps only: the quantisation below shuffles
    const int tok = *token;
    const int l = i & 31;
    float v;
    if (tok < 0 || tok >= nrows) {
        v = __int_as_float(0x7fffffff);  // NaN: an out-of-range id poisons the step
    } else if (i >= K) {
        v = 0.0f;
    } else {
        XChunk one, zero;
#pragma unroll
        for (int k = 0; k < 32; ++k) {
            one.v[k] = k == l ? 1.0f : 0.0f;
            zero.v[k] = 0.0f;
        }
        one.sum = 1.0f;
        one.sum_lo = l < 16 ? 1.0f : 0.0f;
        zero.sum = zero.sum_lo = 0.0f;
        if constexpr (T == T_Q4_K || T == T_Q5_K) {
            const bool high = (i >> 5) & 1;
            v = dot_pair_k<T, A_F32>(w, (size_t)tok, K, i >> 6, high ? zero : one, high ? one : zero);
        } else {
            v = dot_chunk<T, A_F32>(w, (size_t)tok, K, i >> 5, one);
        }
        v *= scale;  // Gemma scales its embedding by √hidden
    }
    if (i < K) out.y[i] = v;
    if (out.q) {
        if (i >= K) v = 0.0f;
        if (out.norm_parts) {
            const float ss = warp_sum(v * v);
            if (l == 0) out.norm_parts[i >> 5] = ss;
        }
        if (out.norm_w && i < K) v *= out.norm_w[i];
        quantize_block_warp(v, out.q, out.r, out.ds, i, i >> 5);
    }
}

#define EMBED_ENTRY(NAME, T)                                                                                           \
    extern "C" __global__ void embed_##NAME(const u8* body, const u32* qh, const u8* sc, const int* token, float* y,   \
                                            int nrows, int K, const float* norm_w, i8* yq, i8* yr, float2* yds,        \
                                            float* norm_parts, float scale) {                                          \
        grid_dependency_wait();                                                                                        \
        W w = {body, qh, sc};                                                                                          \
        GemvOut out = {nullptr, nullptr, y, norm_w, yq, yr, yds, norm_parts, 0, 1.0f};                                 \
        embed<T>(w, token, out, nrows, K, scale, blockIdx.x);                                                                      \
    }

// Entry points: {gemv|swiglu}_{type}_{f|q|w}_{R}_{S} (f: A_F32, q: A_Q8, w: A_Q16), blocks
// of 4 warps; {gemvq|swigluq}_{type}_{q|w}_{R}_{S}, blocks of 32·S/R warps that own one
// 32-row group each and quantise their output (integer paths only). Every entry takes the
// same parameters (unused ones null).
#define GEMV_PARAMS                                                                                                    \
    const u8 *body, const u32 *qh, const u8 *sc, const u8 *body2, const u32 *qh2, const u8 *sc2, const float *x,       \
        const i8 *xq, const i8 *xr, const float2 *xds, const float *in_parts, float eps, const float *bias,            \
        const float *residual, float *y, int nrows, int K, const float *norm_w, i8 *yq, i8 *yr, float2 *yds,           \
        float *out_parts, int act, float act_alpha, float act_limit, float scale, const int *expert_ids,                \
        int slots_per_input, const int *slot_order
// gemv() waits for the previous kernel itself, after prefetching its weights.
#define GEMV_BODY(T, A, R, S, NW, SWIGLU, QOUT)                                                                        \
    W w = {body, qh, sc}, w2 = {body2, qh2, sc2};                                                                      \
    XIn in = {x, xq, xr, xds, in_parts, eps};                                                                          \
    GemvOut out = {bias, residual, y, norm_w, yq, yr, yds, out_parts, act, act_alpha, act_limit, scale};               \
    gemv<T, A, R, S, NW, SWIGLU, QOUT>(w, w2, in, out, nrows, K, ExpertSel{expert_ids, slots_per_input, slot_order});

#define GEMV_ENTRY(NAME, T, A, R, S)                                                                                   \
    extern "C" __global__ void __launch_bounds__(128) gemv_##NAME##_##R##_##S(GEMV_PARAMS) {                           \
        GEMV_BODY(T, A, R, S, 4, false, false)                                                                         \
    }                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(128) swiglu_##NAME##_##R##_##S(GEMV_PARAMS) {                         \
        GEMV_BODY(T, A, R, S, 4, true, false)                                                                          \
    }

#define GEMVQ_ENTRY(NAME, T, A, R, S)                                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * 32 * S / R) gemvq_##NAME##_##R##_##S(GEMV_PARAMS) {              \
        GEMV_BODY(T, A, R, S, 32 * S / R, false, true)                                                                 \
    }                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * 32 * S / R) swigluq_##NAME##_##R##_##S(GEMV_PARAMS) {            \
        GEMV_BODY(T, A, R, S, 32 * S / R, true, true)                                                                  \
    }

#define GEMV_SPLITS(NAME, T, A, R) \
    GEMV_ENTRY(NAME, T, A, R, 1)   \
    GEMV_ENTRY(NAME, T, A, R, 2)   \
    GEMV_ENTRY(NAME, T, A, R, 4)

// The quantising tilings (rows per warp, warps per row): 16, 16 and 8 warps per block.
#define GEMVQ_TILINGS(NAME, T, A) \
    GEMVQ_ENTRY(NAME, T, A, 4, 2) \
    GEMVQ_ENTRY(NAME, T, A, 2, 1) \
    GEMVQ_ENTRY(NAME, T, A, 4, 1)

// Each weight type's kernels come in small modules (see `format.rs`), so a model compiles
// only its types and its activation path, and the modules compile in parallel: the
// embedding lookup; per activation path A (NAME = type tag + path tag) the plain GEMVs
// (every tiling and split) and the quantising ones.
#define GEMV_PLAIN(NAME, T, A)    \
    GEMV_SPLITS(NAME, T, A, 1)    \
    GEMV_SPLITS(NAME, T, A, 2)    \
    GEMV_SPLITS(NAME, T, A, 4)
#define GEMV_QUANTISING(NAME, T, A) GEMVQ_TILINGS(NAME, T, A)

// Row-grouped formats (T_Q4_0X4): a warp owns whole 4-row groups, so only R = 4.
#define GEMV_PLAIN_R4(NAME, T, A) GEMV_SPLITS(NAME, T, A, 4)
#define GEMV_QUANTISING_R4(NAME, T, A) \
    GEMVQ_ENTRY(NAME, T, A, 4, 2)      \
    GEMVQ_ENTRY(NAME, T, A, 4, 1)
