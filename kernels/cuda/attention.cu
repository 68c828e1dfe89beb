// Decode attention for one new query per head over the f16 KV cache, split over the
// context (flash-decoding): `attn_partial` gives each (head, split) block `split` positions
// and writes an unnormalised partial result with its running max and sum; `attn_combine`
// merges the splits. The context length is read from device memory, so the grid is sized
// for the longest context and blocks past the end return at once: one captured graph
// serves every step.
//
// Grouped-query attention: query head h reads KV head h / (n_heads / n_kv).
// A warp takes 32 positions at a time: lane l scores position p0 + l with a whole-row dot
// product (16-byte K loads, q broadcast from shared memory), the warp updates its running
// softmax once per 32 positions, then accumulates the 32 V rows with lane l owning
// elements [l·E, l·E + E) — independent loads throughout, instead of one dependent
// reduction per position.

template <int E>
static __device__ __forceinline__ void attn_partial_impl(const float* __restrict__ q, const u16* __restrict__ kc,
                                                         const u16* __restrict__ vc, const int* __restrict__ len_ptr,
                                                         int n_heads, int n_kv, int max_ctx, int split, float scale,
                                                         float* __restrict__ part_o, float2* __restrict__ part_ml) {
    const int hd = E * 32;
    const int head = blockIdx.x, s = blockIdx.y, nsplit = gridDim.y;
    const int len = *len_ptr;
    const int start = s * split;
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
            const uint4* kp = (const uint4*)(kbase + (size_t)p * hd);
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
        const int count = min(32, end - p0);
#pragma unroll 4
        for (int j = 0; j < count; ++j) {
            const float wj = __shfl_sync(FULL_MASK, pw, j);
            const u16* vp = vbase + (size_t)(p0 + j) * hd;
#pragma unroll
            for (int e = 0; e < E; ++e) acc[e] += wj * h2f(vp[e]);
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
}

#define ATTN_ENTRY(E)                                                                                                  \
    extern "C" __global__ void __launch_bounds__(128) attn_partial_##E(                                                \
        const float* q, const u16* kc, const u16* vc, const int* len_ptr, int n_heads, int n_kv, int max_ctx,          \
        int split, float scale, float* part_o, float2* part_ml) {                                                      \
        grid_dependency_wait();                                                                                        \
        attn_partial_impl<E>(q, kc, vc, len_ptr, n_heads, n_kv, max_ctx, split, scale, part_o, part_ml);               \
    }
ATTN_ENTRY(1)
ATTN_ENTRY(2)
ATTN_ENTRY(3)
ATTN_ENTRY(4)
ATTN_ENTRY(5)
ATTN_ENTRY(6)
ATTN_ENTRY(7)
ATTN_ENTRY(8)

// One block per head, one thread per element of the head (blockDim == hd). With `q` and
// `ds` it also writes the output as Q8_1 (and `lo`, the residual plane, when not null) (32-value blocks never straddle heads), sparing
// the output projection's input a separate quantisation launch.
extern "C" __global__ void attn_combine(const float* __restrict__ part_o, const float2* __restrict__ part_ml,
                                        const int* __restrict__ len_ptr, int split, int nsplit, int hd,
                                        float* __restrict__ out, i8* __restrict__ q, i8* __restrict__ lo,
                                        float2* __restrict__ ds) {
    grid_dependency_wait();
    const int head = blockIdx.x, d = threadIdx.x;
    const int n = min(nsplit, (*len_ptr + split - 1) / split);
    float M = -INFINITY;
    for (int s = 0; s < n; ++s) M = fmaxf(M, part_ml[(size_t)head * nsplit + s].x);
    float o = 0.0f, L = 0.0f;
    for (int s = 0; s < n; ++s) {
        const float2 ml = part_ml[(size_t)head * nsplit + s];
        const float w = expf(ml.x - M);
        L += ml.y * w;
        o += part_o[((size_t)head * nsplit + s) * hd + d] * w;
    }
    const float v = o / L;
    const size_t i = (size_t)head * hd + d;
    out[i] = v;
    if (q) quantize_block_warp(v, q, lo, ds, i, i / 32);
}
