// Dequantisation of whole weight matrices (or of gathered rows) for the batched prefill:
// weights become f16 rows for a tensor-core GEMM, embedding rows become f32 activations.
//
// Compiled after gemv.cu in the same module, so the device layout (`W`, `Traits`) and its
// helpers (aligned loads, the K-quant scale unpacking, the 5th-bit spreading) are the very
// ones the GEMVs use; each decoder below mirrors its `dot_chunk` / `dot_pair_k` branch with
// the activation taken as each unit vector in turn.
//
// One thread per 32-value chunk of a row: it decodes the chunk into registers and writes
// 32 outputs. Output row r holds weight row ids[r] (ids == null: row r); an id out of range
// writes NaN, like the embedding lookup.

template <int T>
static __device__ __forceinline__ void dequant_chunk(const W& w, size_t row, int K, int c, float (&v)[32]) {
    typedef Traits<T> Tr;
    if constexpr (float_weights(T)) {
        const int base = c * 32;
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            const size_t j = row * K + base + i;
            v[i] = base + i < K ? (T == T_F32 ? ((const float*)w.body)[j] : h16<T>(((const u16*)w.body)[j])) : 0.0f;
        }
    } else if constexpr (q4_0_values(T) || T == T_Q4_1 || T == T_Q5_0 || T == T_Q5_1) {
        const size_t b = row * (K / 32) + c;
        size_t body_at, sc_at;
        block_offsets<T>(row, (size_t)K / 32, c, body_at, sc_at);
        int qs[4];
        load16(w.body + body_at, qs);
        u32 qh = 0;
        if constexpr (T == T_Q5_0 || T == T_Q5_1) qh = w.qh[b];
        float d, m = 0.0f;
        if constexpr (T == T_Q4_1 || T == T_Q5_1) {
            const u32 dm = *(const u32*)(w.sc + b * 4);
            d = h2f(dm & 0xffff);
            m = h2f(dm >> 16);
        } else {
            d = ld_h(w.sc + sc_at);
        }
        const float offset = q4_0_values(T) ? 8.0f : (T == T_Q5_0 ? 16.0f : 0.0f);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const u32 byte = ((u32)qs[i >> 2] >> (8 * (i & 3))) & 255;
            // Value i is the low nibble of byte i, value 16 + i its high nibble; bit v of
            // qh is value v's 5th bit (what spread4 puts in place in the GEMV).
            float lo = (float)((byte & 15) | (((qh >> i) & 1) << 4));
            float hi = (float)((byte >> 4) | (((qh >> (16 + i)) & 1) << 4));
            if constexpr (T == T_Q4_1 || T == T_Q5_1) {
                v[i] = d * lo + m;
                v[16 + i] = d * hi + m;
            } else {
                v[i] = d * (lo - offset);
                v[16 + i] = d * (hi - offset);
            }
        }
    } else if constexpr (T == T_Q2_K || T == T_Q3_K) {
        int q[8];
        float d, s0, s1, m0, m1;
        k23_chunk<T>(w, row * ((size_t)K / 256) + (c >> 3), c & 7, q, d, s0, s1, m0, m1);
        const float off = T == T_Q3_K ? 4.0f : 0.0f;
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            const float code = (float)(((u32)q[i >> 2] >> (8 * (i & 3))) & 255);
            v[i] = d * (i < 16 ? s0 : s1) * (code - off) - (i < 16 ? m0 : m1);
        }
    } else if constexpr (grid_type(T)) {
        int q[8];
        float s0, s1;
        grid_chunk<T>(w, row, K, c, q, s0, s1);
#pragma unroll
        for (int i = 0; i < 32; ++i) v[i] = (i < 16 ? s0 : s1) * (float)(i8)(((u32)q[i >> 2] >> (8 * (i & 3))) & 255);
    } else if constexpr (levels4_type(T)) {
        int q[8];
        float d;
        levels4_chunk<T>(w, row, K, c, q, d);
#pragma unroll
        for (int i = 0; i < 32; ++i) v[i] = d * (float)(i8)(((u32)q[i >> 2] >> (8 * (i & 3))) & 255);
    } else if constexpr (T == T_Q8_0) {
        const size_t b = row * (K / 32) + c;
        int qs[8];
        load32(w.body + b * 32, qs);
        const float d = ld_h(w.sc + b * 2);
#pragma unroll
        for (int i = 0; i < 32; ++i) v[i] = d * (float)(i8)(((u32)qs[i >> 2] >> (8 * (i & 3))) & 255);
    } else if constexpr (T == T_Q4_K || T == T_Q5_K) {
        // Sub-block j of a 256-value block: scale/min pair j, the low (even j) or high
        // (odd j) nibbles of the 32 qs bytes shared by sub-blocks 2p and 2p + 1.
        const size_t nblk = (size_t)K / 256;
        const int j = c & 7, p = j >> 1;
        const u8* blk = w.body + (row * nblk + (c >> 3)) * Tr::BODY;
        const uint4 head = *(const uint4*)blk;
        const float d = h2f(head.x & 0xffff), dmin = h2f(head.x >> 16);
        int sc, m;
        k4_scale_min_w(head.y, head.z, head.w, j, sc, m);
        const float ds = d * (float)sc, dm = dmin * (float)m;
        int qs[8];
        load32(blk + (T == T_Q4_K ? 16 : 48) + 32 * p, qs);
        int qh[8];
        if constexpr (T == T_Q5_K) load32(blk + 16, qh);
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            const u32 byte = ((u32)qs[i >> 2] >> (8 * (i & 3))) & 255;
            u32 q = (j & 1) ? byte >> 4 : byte & 15;
            if constexpr (T == T_Q5_K) q |= ((((u32)qh[i >> 2] >> (8 * (i & 3))) >> j) & 1) << 4;
            v[i] = ds * (float)q - dm;
        }
    } else {  // Q6_K, in the device layout (see dot_chunk)
        const size_t b = row * ((size_t)K / 256) + (c >> 3);
        const int cc = c & 7;
        const u8* blk = w.body + b * Tr::BODY;
        int q[8];
        float s0, s1;
        q6k_chunk(blk, cc, q, s0, s1);
        const float d = ld_h(w.sc + b * 2);
        s0 *= d;
        s1 *= d;
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            const u32 code = ((u32)q[i >> 2] >> (8 * (i & 3))) & 255;
            v[i] = (i < 16 ? s0 : s1) * ((float)code - 32.0f);
        }
    }
}

template <int T>
static __device__ __forceinline__ void dequant(W w, const int* __restrict__ ids, int row0, int out_rows, int wrows,
                                               int K, u16* __restrict__ out_h, float* __restrict__ out_f, float scale) {
    const int nchunks = (K + 31) >> 5;
    const size_t g = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= (size_t)out_rows * nchunks) return;
    const int r = (int)(g / nchunks), c = (int)(g % nchunks);
    const int src = ids ? ids[r] : row0 + r;
    float v[32];
    if (src < 0 || src >= wrows) {
#pragma unroll
        for (int i = 0; i < 32; ++i) v[i] = __int_as_float(0x7fffffff);
    } else {
        dequant_chunk<T>(w, (size_t)src, K, c, v);
#pragma unroll
        for (int i = 0; i < 32; ++i) v[i] *= scale;
    }
    const size_t base = (size_t)r * K + (size_t)c * 32;
    const bool whole = c * 32 + 32 <= K;
    if (out_h) {
        if (whole && (K & 7) == 0) {
            // Four 16-byte stores.
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                uint4 o;
                o.x = (u32)f2h(v[8 * i]) | ((u32)f2h(v[8 * i + 1]) << 16);
                o.y = (u32)f2h(v[8 * i + 2]) | ((u32)f2h(v[8 * i + 3]) << 16);
                o.z = (u32)f2h(v[8 * i + 4]) | ((u32)f2h(v[8 * i + 5]) << 16);
                o.w = (u32)f2h(v[8 * i + 6]) | ((u32)f2h(v[8 * i + 7]) << 16);
                ((uint4*)(out_h + base))[i] = o;
            }
        } else {
#pragma unroll
            for (int i = 0; i < 32; ++i)
                if (c * 32 + i < K) out_h[base + i] = f2h(v[i]);
        }
    } else {
#pragma unroll
        for (int i = 0; i < 32; ++i)
            if (c * 32 + i < K) out_f[base + i] = v[i];
    }
}

// Entry point dequant_{type}: (layout arrays, ids or null, first row when ids is null (a
// slice of the LM head at a time), output rows, weight rows, row length, f16 output or
// null, f32 output or null, scale of every value: 1 but for Gemma's embedding lookup).
#define DEQUANT_TYPE(NAME, T)                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) dequant_##NAME(const u8* body, const u32* qh, const u8* sc,     \
                                                                      const int* ids, int row0, int out_rows, int wrows,\
                                                                      int K, u16* out_h, float* out_f, float scale) {  \
        grid_dependency_wait();                                                                                        \
        W w = {body, qh, sc};                                                                                          \
        dequant<T>(w, ids, row0, out_rows, wrows, K, out_h, out_f, scale);                                             \
    }
