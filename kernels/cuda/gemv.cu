// Matrix-vector products y = W x for every weight type kiln runs, at batch 1 (decode).
//
// Weights are in kiln's device layout (see the Rust `repack` module): ggml's blocks split
// into a 16-byte-aligned `body` array (the quants; Q4_K and Q5_K keep their whole block,
// Q6_K all but `d`), an optional `qh` array (one u32 of 5th bits per Q5_0/Q5_1 block) and
// a `sc` array (Q4_0/Q5_0/Q8_0/Q6_K: half d; Q4_1/Q5_1: half2 (d, m)), so every load is
// aligned and vectorised.
//
// Work unit: a chunk of 32 consecutive values of a row. Lane l of a warp takes chunks
// l, l+32, ...; a warp owns R rows and reads each activation chunk once for all of them.
// Two activation formats, chosen per launch:
//   - float: x in f32, weights dequantised in registers, f32 FMAs;
//   - q8_1: x quantised to int8 per 32-block, integer dot products with dp4a.
// Epilogue: + bias[row] (optional), + residual[row] (optional). In SwiGLU mode the warp
// computes row r of both `gate` and `up` and writes silu(gate·x) * (up·x).

#define T_F32 0
#define T_F16 1
#define T_Q4_0 2
#define T_Q4_1 3
#define T_Q5_0 6
#define T_Q5_1 7
#define T_Q8_0 8
#define T_Q4_K 12
#define T_Q5_K 13
#define T_Q6_K 14

template <int T> struct Traits;
template <> struct Traits<T_F32> { static const int BLOCK = 1, BODY = 4, SC = 0; };
template <> struct Traits<T_F16> { static const int BLOCK = 1, BODY = 2, SC = 0; };
template <> struct Traits<T_Q4_0> { static const int BLOCK = 32, BODY = 16, SC = 2; };
template <> struct Traits<T_Q4_1> { static const int BLOCK = 32, BODY = 16, SC = 4; };
template <> struct Traits<T_Q5_0> { static const int BLOCK = 32, BODY = 16, SC = 2; };
template <> struct Traits<T_Q5_1> { static const int BLOCK = 32, BODY = 16, SC = 4; };
template <> struct Traits<T_Q8_0> { static const int BLOCK = 32, BODY = 32, SC = 2; };
template <> struct Traits<T_Q4_K> { static const int BLOCK = 256, BODY = 144, SC = 0; };
template <> struct Traits<T_Q5_K> { static const int BLOCK = 256, BODY = 176, SC = 0; };
template <> struct Traits<T_Q6_K> { static const int BLOCK = 256, BODY = 208, SC = 2; };

// One weight matrix: pointers to the start of its arrays and their per-row strides.
struct W {
    const u8* body;
    const u32* qh;
    const u8* sc;
};

// What a lane knows about the activation chunk it works on.
struct XChunk {
    float v[32];      // float path: the values (zero past the row's end)
    int q[8];         // q8_1 path: the int8 values, four per int
    float d, s;       // q8_1 path: scale and d * sum(q)
    float sum, sum_lo; // float path: sum of all 32 / of the first 16 values
    int qsum_lo, qsum_hi; // q8_1 path: sum of q over each half (Q6_K's -32 offset)
};

static __device__ __forceinline__ void k4_scale_min(const u8* s, int j, int& sc, int& m) {
    if (j < 4) {
        sc = s[j] & 63;
        m = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

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

// Dot product of chunk `c` of row `row` (row length K) with the activation chunk.
template <int T, bool Q>
static __device__ __forceinline__ float dot_chunk(const W& w, size_t row, int K, int c, const XChunk& x) {
    typedef Traits<T> Tr;
    const size_t nblk = (size_t)K / Tr::BLOCK;
    if constexpr (T == T_F32 || T == T_F16) {
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
                        acc += h2f(hv[k] & 0xffff) * x.v[8 * i + 2 * k] + h2f(hv[k] >> 16) * x.v[8 * i + 2 * k + 1];
                }
            } else {
                for (int i = 0; i < 32 && base + i < K; ++i) acc += h2f(p[i]) * x.v[i];
            }
        }
        return acc;
    } else if constexpr (T == T_Q4_0 || T == T_Q4_1 || T == T_Q5_0 || T == T_Q5_1) {
        const size_t b = row * nblk + c;
        int qs[4];
        load16(w.body + b * 16, qs);
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
            d = ld_h(w.sc + b * 2);
        }
        const float offset = T == T_Q4_0 ? 8.0f : (T == T_Q5_0 ? 16.0f : 0.0f);
        if constexpr (Q) {
            int sumi = 0;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                sumi = dp4a(lo[i], x.q[i], sumi);
                sumi = dp4a(hi[i], x.q[4 + i], sumi);
            }
            if constexpr (T == T_Q4_1 || T == T_Q5_1) return d * x.d * (float)sumi + m * x.s;
            return d * (x.d * (float)sumi - offset * x.s);
        } else {
            float sum = 0.0f;
#pragma unroll
            for (int i = 0; i < 4; ++i) sum += fdot4u(lo[i], &x.v[4 * i]) + fdot4u(hi[i], &x.v[16 + 4 * i]);
            if constexpr (T == T_Q4_1 || T == T_Q5_1) return d * sum + m * x.sum;
            return d * (sum - offset * x.sum);
        }
    } else if constexpr (T == T_Q8_0) {
        const size_t b = row * nblk + c;
        int qs[8];
        load32(w.body + b * 32, qs);
        const float d = ld_h(w.sc + b * 2);
        if constexpr (Q) {
            int sumi = 0;
#pragma unroll
            for (int i = 0; i < 8; ++i) sumi = dp4a(qs[i], x.q[i], sumi);
            return d * x.d * (float)sumi;
        } else {
            float sum = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i) sum += fdot4s(qs[i], &x.v[4 * i]);
            return d * sum;
        }
    } else if constexpr (T == T_Q4_K || T == T_Q5_K) {
        const int j = c & 7;
        const u8* blk = w.body + (row * nblk + (c >> 3)) * Tr::BODY;
        const u32 dm = *(const u32*)blk;
        const float d = h2f(dm & 0xffff), dmin = h2f(dm >> 16);
        int sc, m;
        k4_scale_min(blk + 4, j, sc, m);
        const int qs_off = T == T_Q4_K ? 16 : 48;
        int qs[8];
        load32(blk + qs_off + 32 * (j >> 1), qs);
        const int shift = 4 * (j & 1);
#pragma unroll
        for (int i = 0; i < 8; ++i) qs[i] = (qs[i] >> shift) & 0x0f0f0f0f;
        if constexpr (T == T_Q5_K) {
            int qh[8];
            load32(blk + 16, qh);
#pragma unroll
            for (int i = 0; i < 8; ++i) qs[i] |= ((qh[i] >> j) & 0x01010101) << 4;
        }
        if constexpr (Q) {
            int sumi = 0;
#pragma unroll
            for (int i = 0; i < 8; ++i) sumi = dp4a(qs[i], x.q[i], sumi);
            return d * (float)sc * x.d * (float)sumi - dmin * (float)m * x.s;
        } else {
            float sum = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i) sum += fdot4u(qs[i], &x.v[4 * i]);
            return d * (float)sc * sum - dmin * (float)m * x.sum;
        }
    } else {  // Q6_K
        const size_t b = row * nblk + (c >> 3);
        const int cc = c & 7, h = cc >> 2, k = cc & 3;
        const u8* blk = w.body + b * Tr::BODY;
        int ql[8], qh[8];
        load32(blk + 64 * h + 32 * (k & 1), ql);
        load32(blk + 128 + 32 * h, qh);
        const int lshift = 4 * (k >> 1), hshift = 2 * k;
        int q[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = ((ql[i] >> lshift) & 0x0f0f0f0f) | (((qh[i] >> hshift) & 0x03030303) << 4);
        const i8* scales = (const i8*)(blk + 192 + 8 * h + 2 * k);
        const float s0 = (float)scales[0], s1 = (float)scales[1];
        const float d = ld_h(w.sc + b * 2);
        if constexpr (Q) {
            int lo = 0, hi = 0;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                lo = dp4a(q[i], x.q[i], lo);
                hi = dp4a(q[4 + i], x.q[4 + i], hi);
            }
            return d * x.d * (s0 * (float)(lo - 32 * x.qsum_lo) + s1 * (float)(hi - 32 * x.qsum_hi));
        } else {
            float lo = 0.0f, hi = 0.0f;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                lo += fdot4u(q[i], &x.v[4 * i]);
                hi += fdot4u(q[4 + i], &x.v[16 + 4 * i]);
            }
            return d * (s0 * (lo - 32.0f * x.sum_lo) + s1 * (hi - 32.0f * (x.sum - x.sum_lo)));
        }
    }
}

template <int T, bool Q>
static __device__ __forceinline__ void load_x(XChunk& xc, const float* __restrict__ x, const i8* __restrict__ xq,
                                              const float2* __restrict__ xds, int c, int K) {
    const bool float_path = !Q || T == T_F32 || T == T_F16;
    if (float_path) {
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
        if (T != T_F32 && T != T_F16) {
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
        load32((const u8*)(xq + (size_t)c * 32), xc.q);
        const float2 ds = xds[c];
        xc.d = ds.x;
        xc.s = ds.y;
        if (T == T_Q6_K) {
            int lo = 0, hi = 0;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                lo = dp4a(0x01010101, xc.q[i], lo);
                hi = dp4a(0x01010101, xc.q[4 + i], hi);
            }
            xc.qsum_lo = lo;
            xc.qsum_hi = hi;
        }
    }
}

static __device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

template <int T, bool Q, int R, bool SWIGLU>
static __device__ __forceinline__ void gemv(W w, W w2, const float* __restrict__ x, const i8* __restrict__ xq,
                                            const float2* __restrict__ xds, const float* __restrict__ bias,
                                            const float* __restrict__ residual, float* __restrict__ y, int nrows, int K) {
    const int lane = threadIdx.x & 31;
    const int row0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * R;
    if (row0 >= nrows) return;
    const int nchunks = (K + 31) >> 5;
    float acc[R], acc2[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = acc2[r] = 0.0f;
    XChunk xc;
    for (int c = lane; c < nchunks; c += 32) {
        load_x<T, Q>(xc, x, xq, xds, c, K);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            // Rows past the end clamp to the last one: the loads stay in bounds and the
            // result is never written.
            const size_t row = (size_t)min(row0 + r, nrows - 1);
            acc[r] += dot_chunk<T, Q>(w, row, K, c, xc);
            if (SWIGLU) acc2[r] += dot_chunk<T, Q>(w2, row, K, c, xc);
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        acc[r] = warp_sum(acc[r]);
        if (SWIGLU) acc2[r] = warp_sum(acc2[r]);
    }
    if (lane < R && row0 + lane < nrows) {
        float v = 0.0f, v2 = 0.0f;
#pragma unroll
        for (int r = 0; r < R; ++r)
            if (r == lane) {
                v = acc[r];
                v2 = acc2[r];
            }
        const int row = row0 + lane;
        if (SWIGLU) {
            v = silu(v) * v2;
        } else {
            if (bias) v += bias[row];
            if (residual) v += residual[row];
        }
        y[row] = v;
    }
}

#define GEMV_ENTRY(NAME, T, Q, R)                                                                                      \
    extern "C" __global__ void __launch_bounds__(128) gemv_##NAME##_##R(                                               \
        const u8* body, const u32* qh, const u8* sc, const float* x, const i8* xq, const float2* xds,                  \
        const float* bias, const float* residual, float* y, int nrows, int K) {                                        \
        W w = {body, qh, sc};                                                                                          \
        gemv<T, Q, R, false>(w, w, x, xq, xds, bias, residual, y, nrows, K);                                           \
    }                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(128) swiglu_##NAME##_##R(                                             \
        const u8* gbody, const u32* gqh, const u8* gsc, const u8* ubody, const u32* uqh, const u8* usc,                \
        const float* x, const i8* xq, const float2* xds, float* y, int nrows, int K) {                                 \
        W g = {gbody, gqh, gsc}, u = {ubody, uqh, usc};                                                                \
        gemv<T, Q, R, true>(g, u, x, xq, xds, nullptr, nullptr, y, nrows, K);                                          \
    }

#define GEMV_TYPE(NAME, T)   \
    GEMV_ENTRY(NAME##_f, T, false, 1) \
    GEMV_ENTRY(NAME##_f, T, false, 2) \
    GEMV_ENTRY(NAME##_f, T, false, 4) \
    GEMV_ENTRY(NAME##_q, T, true, 1)  \
    GEMV_ENTRY(NAME##_q, T, true, 2)  \
    GEMV_ENTRY(NAME##_q, T, true, 4)

GEMV_TYPE(q4_0, T_Q4_0)
GEMV_TYPE(q4_1, T_Q4_1)
GEMV_TYPE(q5_0, T_Q5_0)
GEMV_TYPE(q5_1, T_Q5_1)
GEMV_TYPE(q8_0, T_Q8_0)
GEMV_TYPE(q4_k, T_Q4_K)
GEMV_TYPE(q5_k, T_Q5_K)
GEMV_TYPE(q6_k, T_Q6_K)
GEMV_ENTRY(f32_f, T_F32, false, 1)
GEMV_ENTRY(f32_f, T_F32, false, 2)
GEMV_ENTRY(f32_f, T_F32, false, 4)
GEMV_ENTRY(f16_f, T_F16, false, 1)
GEMV_ENTRY(f16_f, T_F16, false, 2)
GEMV_ENTRY(f16_f, T_F16, false, 4)
