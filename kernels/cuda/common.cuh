// Shared by every kiln kernel source. NVRTC compiles each module as this header followed by
// the module's own text, so no include path is needed and no toolkit header is assumed:
// half conversions and dp4a are written as inline PTX.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define WARP 32
#define FULL_MASK 0xffffffffu
#define INFINITY __int_as_float(0x7f800000)

static __device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

static __device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Two floats as one f16x2 word (`lo` in the low half), rounded to nearest.
static __device__ __forceinline__ u32 pack_h2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// c += A·B on the tensor cores: a 16x16 f16 A (four f16x2 registers in the mma fragment
// order), a 16x8 f16 B (two), f32 accumulators.
static __device__ __forceinline__ void mma_f16(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

static __device__ __forceinline__ float ld_h(const u8* p) {
    return h2f(*(const u16*)p);
}

static __device__ __forceinline__ int dp4a(int a, int b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// The shared-memory address of a generic pointer into shared memory (for cp.async).
static __device__ __forceinline__ u32 smem_u32(const void* p) {
    u64 a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (u32)a;
}

// Asynchronous copies global → shared memory (sm_80+): 16 bytes bypassing L1, or 4.
static __device__ __forceinline__ void cp_async16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
}

static __device__ __forceinline__ void cp_async4(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src));
}

static __device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }

// Waits until at most N of this thread's committed copy groups are still in flight.
template <int N>
static __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

// The gate activation of a gated feed-forward: SiLU (SwiGLU) or, with `gelu`, GELU in its
// tanh approximation (GeGLU: what ggml and `gelu_pytorch_tanh` compute).
static __device__ __forceinline__ float glu_act(float g, int gelu) {
    if (gelu) return 0.5f * g * (1.0f + tanhf(0.7978846f * (g + 0.044715f * g * g * g)));
    return g / (1.0f + expf(-g));
}

// A gated feed-forward's value for one gate and up pair (the Rust `GatedAct`): act(g)·u
// with act SiLU (act 0) or tanh GELU (1), or gpt-oss's clamped form (2): g at most
// `limit`, u within ±limit, then g·σ(alpha·g)·(u + 1). The clamps let a NaN through, as
// the CPU's do.
static __device__ __forceinline__ float glu(float g, float u, int act, float alpha, float limit) {
    if (act == 2) {
        g = g > limit ? limit : g;
        u = u > limit ? limit : (u < -limit ? -limit : u);
        return g / (1.0f + expf(-alpha * g)) * (u + 1.0f);
    }
    return glu_act(g, act) * u;
}

static __device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

static __device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

static __device__ __forceinline__ int warp_sum_i(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// Sum over the whole block; every thread gets the result. `scratch` holds 32 floats.
static __device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

// rsqrt(mean(x²) + eps) of the n values of one row, computed by the whole block (every
// thread gets it); `scratch` holds 32 floats of shared memory.
static __device__ __forceinline__ float row_rms_scale(const float* x, int n, float eps, float* scratch) {
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += x[i] * x[i];
    ss = block_sum(ss, scratch);
    return rsqrtf(ss / (float)n + eps);
}

// Programmatic dependent launch (sm_90+). kiln launches every kernel with the
// programmatic-serialization attribute, so a kernel may be scheduled while the one before it
// on the stream is still finishing; this wait, the first statement of every kernel, blocks
// until that predecessor has completed and its writes are visible. Because every kernel
// waits, completion stays transitive: a kernel never overtakes any earlier one. The trigger
// lets the next kernel's blocks be scheduled as soon as all of this grid's blocks have
// started, which hides the launch latency between the small kernels of a decode step.
// On older architectures both are no-ops and launches are plainly serialised.
static __device__ __forceinline__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// Activation quantisation for the integer GEMVs, one 32-value block per warp (lane i holds
// value i). `q` gets round(v / d) with d = amax / 127 (Q8_1); `lo`, when not null, the
// rounding residual at 1/254 of that step, so that d / 254 * (254 * q + lo) holds v to
// 15 bits of the block's range. `ds` gets (d, d * sum(q)); readers of `lo` add its own sum.
static __device__ __forceinline__ void quantize_block_warp(float v, i8* __restrict__ q, i8* __restrict__ lo,
                                                           float2* __restrict__ ds, size_t i, size_t blk) {
    const int lane = threadIdx.x & 31;
    const float amax = warp_max(fabsf(v));
    const float inv = amax == 0.0f ? 0.0f : 127.0f / amax;
    const float scaled = v * inv;
    const float hi = rintf(scaled);
    q[i] = (i8)(int)hi;
    if (lo) lo[i] = (i8)(int)rintf((scaled - hi) * 254.0f);
    const int sum = warp_sum_i((int)hi);
    if (lane == 0) ds[blk] = make_float2(amax / 127.0f, amax / 127.0f * (float)sum);
}

// Four 8×8 matrices of 16-bit values from shared memory (ldmatrix): lane l gives the
// address of row l % 8 of matrix l / 8, and gets in b0..b3 the matrices' elements of the
// mma fragment layout (row l / 4, columns 2·(l % 4) and the next); `trans` transposes each
// matrix on the way.
template <bool TRANS = false>
static __device__ __forceinline__ void ldsm_x4(const void* src, u32& b0, u32& b1, u32& b2, u32& b3) {
    if constexpr (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3)
                     : "r"(smem_u32(src)));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3)
                     : "r"(smem_u32(src)));
}

// Flash attention on tensor cores, the steps the prefill's (prefill.cu) and the batched
// decode's group attention (attention.cu) share. A warp holds 16 query rows: lane (g, t)
// rows g and g + 8 of m16n8k16 tiles. For a tile of SN·8 keys, `s` holds the scores (base
// 2, masked to -inf) in the mma accumulator layout, `o` the running output over HD = ON·8
// dimensions, `m` and `l` each row's running maximum and (this lane's part of the) sum.
//
// The online softmax: new maxima (a row that has seen nothing yet keeps base 0), the old
// output and sum rescaled, and `s` turned into the weights exp2(s − max).
template <int SN, int ON>
static __device__ __forceinline__ void flash_softmax(float (&s)[SN][4], float (&m)[2], float (&l)[2],
                                                     float (&o)[ON][4]) {
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < SN; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[n][e]);
    float corr[2], base[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(FULL_MASK, mx[h], 1));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(FULL_MASK, mx[h], 2));
        const float mn = fmaxf(m[h], mx[h]);
        base[h] = mn == -INFINITY ? 0.0f : mn;
        corr[h] = exp2f(m[h] - base[h]);
        m[h] = mn;
        l[h] *= corr[h];
    }
#pragma unroll
    for (int n = 0; n < ON; ++n) {
        o[n][0] *= corr[0];
        o[n][1] *= corr[0];
        o[n][2] *= corr[1];
        o[n][3] *= corr[1];
    }
#pragma unroll
    for (int n = 0; n < SN; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            s[n][e] = exp2f(s[n][e] - base[e >> 1]);
            l[e >> 1] += s[n][e];
        }
    }
}

// o += P·V over the tile's SN·8 keys: P's A fragments straight from the weights in `s`
// (rounded to f16), V's rows (one a key, HD values) in shared memory at `vt`, LD values
// apart, read transposed.
template <int SN, int ON, int LD>
static __device__ __forceinline__ void flash_pv(const float (&s)[SN][4], const u16* vt, float (&o)[ON][4]) {
    const int lane = threadIdx.x & 31, mi = lane >> 3, r = lane & 7;
#pragma unroll
    for (int kk = 0; kk < SN / 2; ++kk) {
        const u32 pa[4] = {pack_h2(s[2 * kk][0], s[2 * kk][1]), pack_h2(s[2 * kk][2], s[2 * kk][3]),
                           pack_h2(s[2 * kk + 1][0], s[2 * kk + 1][1]), pack_h2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
        for (int n = 0; n < ON; n += 2) {
            // Keys kk·16 and kk·16 + 8 at dims n·8, then at dims (n+1)·8.
            u32 b0, b1, b2, b3;
            ldsm_x4<true>(vt + (kk * 16 + (mi & 1) * 8 + r) * LD + n * 8 + (mi >> 1) * 8, b0, b1, b2, b3);
            mma_f16(o[n], pa, b0, b1);
            mma_f16(o[n + 1], pa, b2, b3);
        }
    }
}

// One 32-value chunk (chunk b of row `row`, `nblk` chunks a row, `rows` rows) in the batched
// matmuls' activation layout, by one warp (lane i holds value i, v): the Q8_1 values and
// their residual plane interleaved for the mma B fragments, (dx, sx) chunk-major, and the
// f16 plane. act_pack, bmm_finish_pack and the batched
// decode attention write it.
static __device__ __forceinline__ void pack_chunk_warp(float v, int lane, int row, int rows, int nblk, int b,
                                                       uint4* __restrict__ out, float2* __restrict__ s,
                                                       u16* __restrict__ out_h) {
    const float amax = warp_max(fabsf(v));
    const float inv = amax == 0.0f ? 0.0f : 127.0f / amax;
    const float scaled = v * inv;
    const float hi = rintf(scaled);
    const int q = (int)hi, lo = (int)rintf((scaled - hi) * 254.0f);
    const int sum = warp_sum_i(q) * 254 + warp_sum_i(lo);
    const int t = (lane & 15) >> 2;
    const int off = t * 16 + (lane >= 16 ? 4 : 0) + (lane & 3);
    u8* o = (u8*)(out + ((size_t)row * nblk + b) * 4);
    o[off] = (u8)(i8)q;
    o[off + 8] = (u8)(i8)lo;
    // The f16 plane: lane t of a quad's 16 bytes are values 4t..4t+3 and 16+4t..16+4t+3 of
    // the chunk, as its int8 bytes are. Finite values beyond f16's range saturate.
    const float vh = fabsf(v) > 65504.0f ? copysignf(65504.0f, v) : v;
    out_h[((size_t)row * nblk + b) * 32 + t * 8 + (lane >= 16 ? 4 : 0) + (lane & 3)] = f2h(vh);
    if (lane == 0) {
        const float dx = amax / 127.0f / 254.0f;
        s[(size_t)b * rows + row] = make_float2(dx, dx * (float)sum);
    }
}

// Where a kernel packs its output for a batched matmul (pack_chunk_warp's planes), row
// `row` of `rows`; `x` null: nowhere.
struct ActPack {
    uint4* x = nullptr;
    float2* s = nullptr;
    u16* h = nullptr;
    int row = 0, rows = 0;
};

// A plane of the KV cache (keys or values of one layer) as the kernels read it: f16 values
// (KvF16), or q8_0 (KvQ8): one int8 per value and an f16 scale per 32 consecutive values in
// a plane of their own, the scale of value e at d[e / 32] (so d = amax / 127 per 32, as
// ggml's q8_0 block, without its 34-byte stride). `at(e)` moves the view to value e, which
// is always a multiple of 32 (a slot, a head or a row), so the scale plane moves with it.
// load8 reads 8 values at a multiple of 8; load<E> E consecutive values at lane · E.
struct KvF16 {
    static constexpr bool Q8 = false;
    const u16* p;
    __device__ __forceinline__ KvF16 at(size_t e) const { return {p + e}; }
    __device__ __forceinline__ void load8(size_t e, float (&v)[8]) const {
        const uint4 a = *(const uint4*)(p + e);
        const u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) { v[2 * i] = h2f(w[i] & 0xffff); v[2 * i + 1] = h2f(w[i] >> 16); }
    }
    template <int E> __device__ __forceinline__ void load(size_t e, float (&v)[E]) const {
        const u16* s = p + e;
        if constexpr (E == 8) {
            float t[8];
            load8(e, t);
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] = t[i];
        } else if constexpr (E == 4) {
            const uint2 a = *(const uint2*)s;
            v[0] = h2f(a.x & 0xffff); v[1] = h2f(a.x >> 16); v[2] = h2f(a.y & 0xffff); v[3] = h2f(a.y >> 16);
        } else if constexpr (E == 2) {
            const u32 a = *(const u32*)s;
            v[0] = h2f(a & 0xffff); v[1] = h2f(a >> 16);
        } else {
#pragma unroll
            for (int i = 0; i < E; ++i) v[i] = h2f(s[i]);
        }
    }
};

struct KvQ8 {
    static constexpr bool Q8 = true;
    const i8* q;
    const u16* d;
    __device__ __forceinline__ KvQ8 at(size_t e) const { return {q + e, d + e / 32}; }
    __device__ __forceinline__ void load8(size_t e, float (&v)[8]) const {
        const uint2 a = *(const uint2*)(q + e);
        const float s = h2f(d[e / 32]);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            v[i] = s * (float)(i8)(a.x >> (8 * i));
            v[4 + i] = s * (float)(i8)(a.y >> (8 * i));
        }
    }
    template <int E> __device__ __forceinline__ void load(size_t e, float (&v)[E]) const {
        if constexpr (E == 8) {
            load8(e, v);
        } else if constexpr (E == 4 || E == 2 || E == 1) {
            // 32 / E lanes share a scale; the E bytes in one aligned load.
            const float s = h2f(d[e / 32]);
            const u32 a = E == 4 ? *(const u32*)(q + e) : E == 2 ? (u32) * (const u16*)(q + e) : (u32)(u8)q[e];
#pragma unroll
            for (int i = 0; i < E; ++i) v[i] = s * (float)(i8)(a >> (8 * i));
        } else {
            // A lane's E values may straddle two scales.
#pragma unroll
            for (int i = 0; i < E; ++i) v[i] = h2f(d[(e + i) / 32]) * (float)q[e + i];
        }
    }
};

// The writer's side of a q8_0 plane: one warp quantises the 32 values vals[0..32) (lane l
// holds value l) into q[0..32) and their scale *d, rounding as ggml's quantize_row_q8_0
// (d = amax / 127, q = round(x / d) half away from zero, through x · (1 / d)).
static __device__ __forceinline__ void quantize_kv_block(float x, i8* __restrict__ q, u16* __restrict__ d) {
    const int lane = threadIdx.x & 31;
    const float amax = warp_max(fabsf(x));
    const float dd = amax / 127.0f;
    const float id = dd != 0.0f ? 1.0f / dd : 0.0f;
    q[lane] = (i8)(int)roundf(x * id);
    if (lane == 0) *d = f2h(dd);
}

// The row of a KV head's cache that holds position p. A layer that keeps the whole context
// is paged: its rows form a pool of 32-row blocks shared by all sequences, and a sequence's
// block table (`table`) names its blocks in order, so position p is row p % 32 of block
// table[p / 32] (kiln_core::KV_BLOCK_TOKENS). A sliding-window layer keeps a contiguous ring
// of `rows` rows per sequence (table null): position p is row p % rows. Either way a KV
// head's rows lie `rows` apart (the pool's rows, or the ring's).
static __device__ __forceinline__ int kv_row(const int* __restrict__ table, int p, int rows) {
    return table ? table[p >> 5] * 32 + (p & 31) : p % rows;
}

// Writes one KV head's rotated key and its value row to the cache at value offset `off` (a
// multiple of 32). Every thread of the block calls it; `mine` says whether the thread holds
// a rotary pair (dims a and b of both rows). An f16 cache takes the values as they are; a
// q8_0 one (Q8) gathers both rows in shared memory and quantises them a 32-value block a
// warp, as ggml's q8_0 does.
template <bool Q8>
static __device__ __forceinline__ void store_kv(void* __restrict__ kc, void* __restrict__ vc, u16* __restrict__ kd,
                                                u16* __restrict__ vd, size_t off, int hd, bool mine, int a, int b,
                                                float ka, float kb, float va, float vb) {
    if constexpr (!Q8) {
        if (mine) {
            u16* k = (u16*)kc + off;
            u16* v = (u16*)vc + off;
            k[a] = f2h(ka);
            k[b] = f2h(kb);
            v[a] = f2h(va);
            v[b] = f2h(vb);
        }
    } else {
        __shared__ float rows[2][256];  // head_dim is at most 256
        if (mine) {
            rows[0][a] = ka;
            rows[0][b] = kb;
            rows[1][a] = va;
            rows[1][b] = vb;
        }
        __syncthreads();
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
        const int per = hd / 32;  // blocks a row
        for (int blk = warp; blk < 2 * per; blk += nwarps) {
            const int plane = blk / per, c = (blk % per) * 32;
            i8* q = (i8*)(plane ? vc : kc) + off + c;
            u16* d = (plane ? vd : kd) + (off + c) / 32;
            quantize_kv_block(rows[plane][c + lane], q, d);
        }
    }
}
