// Decode attention for one new query per head over the f16 KV cache, split over the
// context (flash-decoding): each (head, split) block takes a run of positions and writes an
// unnormalised partial result with its running max and sum; the last block of a head to
// finish (counted in `counters`, which it leaves at zero) merges the head's splits, so the
// whole attention is one launch. The context length is read from device memory and the
// split length follows it (short splits while the context is short, so that many blocks
// keep the GPU busy; longer ones as it grows; the rule is in attn_partial_impl), so a grid
// of a bounded number of splits serves every length up to the cache's and one captured
// graph serves every step. Blocks past the end return at once.
//
// Grouped-query attention: query head h reads KV head h / (n_heads / n_kv).
//
// Sliding-window layers (`window` > 0) attend to the last `window` positions only, and
// their cache is a ring of `max_ctx` rows per KV head (position p in row p % max_ctx; for
// full layers max_ctx is the context, so the row is p).
// A warp takes 32 positions at a time: lane l scores position p0 + l with a whole-row dot
// product (16-byte K loads, q broadcast from shared memory), the warp updates its running
// softmax once per 32 positions, then accumulates the 32 V rows with lane l owning
// elements [l·E, l·E + E) — independent loads throughout, instead of one dependent
// reduction per position.

// E consecutive f16 values to f32, with the widest aligned loads E allows (a lane's slice
// of a V row starts at lane·E halves).
template <int E>
static __device__ __forceinline__ void load_halves(const u16* p, float (&v)[E]) {
    if constexpr (E == 8) {
        const uint4 a = *(const uint4*)p;
        const u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) { v[2 * i] = h2f(w[i] & 0xffff); v[2 * i + 1] = h2f(w[i] >> 16); }
    } else if constexpr (E == 4) {
        const uint2 a = *(const uint2*)p;
        v[0] = h2f(a.x & 0xffff); v[1] = h2f(a.x >> 16); v[2] = h2f(a.y & 0xffff); v[3] = h2f(a.y >> 16);
    } else if constexpr (E == 2) {
        const u32 a = *(const u32*)p;
        v[0] = h2f(a & 0xffff); v[1] = h2f(a >> 16);
    } else {
#pragma unroll
        for (int e = 0; e < E; ++e) v[e] = h2f(p[e]);
    }
}

template <int E>
static __device__ __forceinline__ void attn_partial_impl(const float* __restrict__ q, const u16* __restrict__ kc,
                                                         const u16* __restrict__ vc, const int* __restrict__ len_ptr,
                                                         int n_heads, int n_kv, int max_ctx, int split, float scale,
                                                         int window, float* __restrict__ part_o, float2* __restrict__ part_ml,
                                                         u32* __restrict__ counters, float* __restrict__ out,
                                                         i8* __restrict__ oq, i8* __restrict__ olo,
                                                         float2* __restrict__ ods) {
    const int hd = E * 32;
    const int head = blockIdx.x, s = blockIdx.y, nsplit = gridDim.y;
    const int len = *len_ptr;
    const int lo = window > 0 ? max(0, len - window) : 0;
    // Splits of at least `split`, aiming at 16 a head up to 256 positions each (4,096 of
    // context; a split of 128+ keeps all four warps busy), at most the grid's: split 64 at
    // 1,024 positions, 256 from 4,096 to 32,768, then longer. The points measured best on
    // an H200 (docs/architecture.md).
    {
        const int span = len - lo;
        const int even = min(256, ((span + 15) / 16 + 31) / 32 * 32);
        const int most = ((span + nsplit - 1) / nsplit + 31) / 32 * 32;
        split = max(split, max(even, most));
    }
    const int start = lo + s * split;
    if (start >= len) return;
    const int end = min(len, start + split);
    const int kvh = head / (n_heads / n_kv);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    __shared__ float4 qs[E * 8];
    for (int i = threadIdx.x; i < hd; i += blockDim.x) ((float*)qs)[i] = q[(size_t)head * hd + i] * scale;
    __syncthreads();
    float acc[E];
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    const u16* kbase = kc + (size_t)kvh * max_ctx * hd;
    const u16* vbase = vc + (size_t)kvh * max_ctx * hd + lane * E;
    for (int p0 = start + warp * 32; p0 < end; p0 += nwarps * 32) {
        const int p = p0 + lane;
        float score = -INFINITY;
        if (p < end) {
            const uint4* kp = (const uint4*)(kbase + (size_t)(p % max_ctx) * hd);
            float dot = 0.0f;
#pragma unroll
            for (int i = 0; i < E * 4; ++i) {
                const uint4 kv = kp[i];
                const float4 a = qs[2 * i], b = qs[2 * i + 1];
                dot += a.x * h2f(kv.x & 0xffff) + a.y * h2f(kv.x >> 16) + a.z * h2f(kv.y & 0xffff) + a.w * h2f(kv.y >> 16) +
                       b.x * h2f(kv.z & 0xffff) + b.y * h2f(kv.z >> 16) + b.z * h2f(kv.w & 0xffff) + b.w * h2f(kv.w >> 16);
            }
            score = dot;
        }
        const float m_new = fmaxf(m, warp_max(score));
        const float corr = expf(m - m_new);
        const float pw = p < end ? expf(score - m_new) : 0.0f;
        l = l * corr + warp_sum(pw);
#pragma unroll
        for (int e = 0; e < E; ++e) acc[e] *= corr;
        // V rows in batches of VB positions, every load of a batch issued before the
        // first is used: the loop is bound by memory latency, not bandwidth, so what
        // matters is how many loads are in flight. Positions past the end weigh 0 and
        // read the last valid row (in bounds).
        constexpr int VB = E <= 4 ? 16 : 8;
#pragma unroll
        for (int jb = 0; jb < 32; jb += VB) {
            if (p0 + jb >= end) break;
            float v[VB][E];
#pragma unroll
            for (int j = 0; j < VB; ++j) load_halves<E>(vbase + (size_t)(min(p0 + jb + j, end - 1) % max_ctx) * hd, v[j]);
#pragma unroll
            for (int j = 0; j < VB; ++j) {
                const float wj = __shfl_sync(FULL_MASK, pw, jb + j);
#pragma unroll
                for (int e = 0; e < E; ++e) acc[e] += wj * v[j][e];
            }
        }
        m = m_new;
    }
    // Merge the warps of this block.
    __shared__ float sm_m[4], sm_l[4];
    __shared__ float sm_o[4 * 256];  // launch bounds: at most 4 warps, hd at most 256
    if (lane == 0) { sm_m[warp] = m; sm_l[warp] = l; }
#pragma unroll
    for (int e = 0; e < E; ++e) sm_o[warp * hd + lane * E + e] = acc[e];
    __syncthreads();
    float M = -INFINITY;
    for (int w = 0; w < nwarps; ++w) M = fmaxf(M, sm_m[w]);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float o = 0.0f;
        for (int w = 0; w < nwarps; ++w)
            if (sm_m[w] != -INFINITY) o += sm_o[w * hd + d] * expf(sm_m[w] - M);
        part_o[((size_t)head * nsplit + s) * hd + d] = o;
    }
    if (threadIdx.x == 0) {
        float L = 0.0f;
        for (int w = 0; w < nwarps; ++w)
            if (sm_m[w] != -INFINITY) L += sm_l[w] * expf(sm_m[w] - M);
        part_ml[(size_t)head * nsplit + s] = make_float2(M, L);
    }
    // Publish this split, then count it; the head's last split merges them all.
    __threadfence();
    __syncthreads();
    __shared__ int is_last;
    const int n = min(nsplit, (len - lo + split - 1) / split);
    if (threadIdx.x == 0) {
        const u32 done = atomicAdd(&counters[head], 1u) + 1;
        is_last = done == (u32)n;
        if (is_last) counters[head] = 0;
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    // Other blocks' partials: read through L2 (volatile), never a stale L1 line.
    const volatile float* vo = part_o + (size_t)head * nsplit * hd;
    const volatile float2* vml = part_ml + (size_t)head * nsplit;
    float Mh = -INFINITY;
    for (int j = 0; j < n; ++j) Mh = fmaxf(Mh, vml[j].x);
    for (int d0 = warp * 32; d0 < hd; d0 += nwarps * 32) {
        const int d = d0 + lane;
        float o = 0.0f, L = 0.0f;
        for (int j = 0; j < n; ++j) {
            const float mj = vml[j].x, lj = vml[j].y;
            const float wj = mj == -INFINITY ? 0.0f : expf(mj - Mh);
            L += lj * wj;
            o += vo[(size_t)j * hd + d] * wj;
        }
        const float v = o / L;
        const size_t i = (size_t)head * hd + d;
        out[i] = v;
        // 32-value blocks never straddle heads (hd is a multiple of 32).
        if (oq) quantize_block_warp(v, oq, olo, ods, i, i / 32);
    }
}

#define ATTN_ENTRY(E)                                                                                                  \
    extern "C" __global__ void __launch_bounds__(128) attn_decode_##E(                                                 \
        const float* q, const u16* kc, const u16* vc, const int* len_ptr, int n_heads, int n_kv, int max_ctx,          \
        int split, float scale, int window, float* part_o, float2* part_ml, u32* counters, float* out, i8* oq,         \
        i8* olo, float2* ods) {                                                                                        \
        grid_dependency_wait();                                                                                        \
        attn_partial_impl<E>(q, kc, vc, len_ptr, n_heads, n_kv, max_ctx, split, scale, window, part_o, part_ml,        \
                             counters, out, oq, olo, ods);                                                             \
    }

// The batched decode step's attention: grid.z is the row of the batch. Row z attends over
// positions 0..len[z] of cache slot slot[z] (slots `slot_stride` halves apart); its
// partials, counters and output are row z's own. A padding row (len 0) writes zeros.
#define ATTN_BATCH_ENTRY(E)                                                                                            \
    extern "C" __global__ void __launch_bounds__(128) attn_decode_batch_##E(                                           \
        const float* q, const u16* kc, const u16* vc, const int* lens, const int* slot, long long slot_stride,         \
        int n_heads, int n_kv, int max_ctx, int split, float scale, int window, float* part_o, float2* part_ml,       \
        u32* counters, float* out) {                                                                                   \
        grid_dependency_wait();                                                                                        \
        const int z = blockIdx.z, hd = 32 * E, nsplit = gridDim.y;                                                     \
        const size_t qd = (size_t)n_heads * hd;                                                                        \
        if (lens[z] <= 0) {                                                                                            \
            if (blockIdx.y == 0)                                                                                       \
                for (int d = threadIdx.x; d < hd; d += blockDim.x) out[z * qd + (size_t)blockIdx.x * hd + d] = 0.0f;   \
            return;                                                                                                    \
        }                                                                                                              \
        const size_t cache = (size_t)slot[z] * (size_t)slot_stride;                                                   \
        attn_partial_impl<E>(q + z * qd, kc + cache, vc + cache, lens + z, n_heads, n_kv, max_ctx, split, scale,       \
                             window, part_o + z * qd * nsplit, part_ml + (size_t)z * n_heads * nsplit,               \
                             counters + z * n_heads, out + z * qd, nullptr, nullptr, nullptr);                         \
    }
