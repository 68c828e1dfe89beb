// Token selection on the device, so only an id crosses the bus.
//
// Greedy: `argmax_partial` reduces slices of the logits to (value, index) keys and
// `argmax_final` reduces those; ties go to the lowest index and NaN never wins, as the host
// `kiln_core::argmax`.
//
// Sampling (top-k ≤ 64 → temperature → top-p → min-p → draw, the host `Sampler`'s order):
// `topk_partial` sorts each 4096-logit slice in shared memory and keeps its best k;
// `sample_final` sorts the candidates of all slices, keeps the best k, and draws with a
// SplitMix64 generator whose state lives in device memory — the same generator and the same
// arithmetic order as the host sampler, so a seed gives the same tokens on either side
// (up to expf rounding).

// Orders (value desc, index asc) as one u64 key where larger is better; NaN is -inf.
static __device__ __forceinline__ u64 make_key(float v, u32 idx) {
    if (v != v) v = -INFINITY;
    u32 b = __float_as_uint(v);
    b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((u64)b << 32) | (u64)(0xffffffffu - idx);
}

static __device__ __forceinline__ u64 warp_max_u64(u64 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 other = __shfl_xor_sync(FULL_MASK, v, o);
        v = other > v ? other : v;
    }
    return v;
}

static __device__ __forceinline__ u64 block_max_u64(u64 v) {
    __shared__ u64 scratch[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    v = warp_max_u64(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : 0ull;
    return warp_max_u64(v);
}

extern "C" __global__ void argmax_partial(const float* __restrict__ x, int n, int per_block, u64* __restrict__ keys) {
    grid_dependency_wait();
    // grid.y: one row of logits each (a batch), keys per row side by side.
    x += (size_t)blockIdx.y * n;
    keys += (size_t)blockIdx.y * gridDim.x;
    const int start = blockIdx.x * per_block, end = min(n, start + per_block);
    u64 best = 0;
    for (int i = start + threadIdx.x; i < end; i += blockDim.x) {
        const u64 k = make_key(x[i], (u32)i);
        best = k > best ? k : best;
    }
    best = block_max_u64(best);
    if (threadIdx.x == 0) keys[blockIdx.x] = best;
}

extern "C" __global__ void argmax_final(const u64* __restrict__ keys, int nkeys, int* __restrict__ out) {
    grid_dependency_wait();
    keys += (size_t)blockIdx.y * nkeys;
    out += blockIdx.y;
    u64 best = 0;
    for (int i = threadIdx.x; i < nkeys; i += blockDim.x) best = keys[i] > best ? keys[i] : best;
    best = block_max_u64(best);
    if (threadIdx.x == 0) *out = (int)(0xffffffffu - (u32)(best & 0xffffffffu));
}

#define SLICE 4096

// Sorts keys[0..n) (n a power of two) descending in shared memory.
static __device__ void bitonic_desc(u64* keys, int n) {
    for (int k = 2; k <= n; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < n; i += blockDim.x) {
                const int ixj = i ^ j;
                if (ixj > i) {
                    const u64 a = keys[i], b = keys[ixj];
                    const bool desc = (i & k) == 0;
                    if (desc ? a < b : a > b) {
                        keys[i] = b;
                        keys[ixj] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
}

static __device__ __forceinline__ float key_value(u64 key) {
    u32 b = (u32)(key >> 32);
    b = (b & 0x80000000u) ? (b & 0x7fffffffu) : ~b;
    return __uint_as_float(b);
}

static __device__ __forceinline__ u32 key_index(u64 key) { return 0xffffffffu - (u32)(key & 0xffffffffu); }

// One block per SLICE logits; writes its k best keys to cand[blockIdx.x * k ...].
extern "C" __global__ void topk_partial(const float* __restrict__ x, int n, int k, u64* __restrict__ cand) {
    grid_dependency_wait();
    __shared__ u64 keys[SLICE];
    x += (size_t)blockIdx.y * n;
    cand += (size_t)blockIdx.y * gridDim.x * k;
    const int start = blockIdx.x * SLICE;
    for (int i = threadIdx.x; i < SLICE; i += blockDim.x) {
        const int g = start + i;
        keys[i] = g < n ? make_key(x[g], (u32)g) : 0ull;
    }
    __syncthreads();
    bitonic_desc(keys, SLICE);
    for (int i = threadIdx.x; i < k; i += blockDim.x) cand[(size_t)blockIdx.x * k + i] = keys[i];
}

static __device__ __forceinline__ u64 splitmix_next(u64* state) {
    u64 z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// One block per row of candidates (ncand = slices * k ≤ SLICE); thread 0 does the O(k)
// tail in the host's order. The uniform draw is `u` (a host sampler's generator, or the
// device SplitMix64 state, see the entries).
static __device__ void sample_from(const u64* __restrict__ cand, int ncand, int k, float temperature, float top_p,
                                   float min_p, u64* __restrict__ rng_state, const float* __restrict__ u_in,
                                   int* __restrict__ out) {
    __shared__ u64 keys[SLICE];
    __shared__ float prob[64];
    for (int i = threadIdx.x; i < SLICE; i += blockDim.x) keys[i] = i < ncand ? cand[i] : 0ull;
    __syncthreads();
    bitonic_desc(keys, SLICE);
    if (threadIdx.x != 0) return;
    // Keys of value -inf (NaN logits, padding) never count as candidates.
    int n = 0;
    while (n < k && keys[n] != 0ull && key_value(keys[n]) != -INFINITY) ++n;
    if (n == 0) { *out = 0; return; }
    const float max = key_value(keys[0]);
    float sum = 0.0f;
    for (int i = 0; i < n; ++i) {
        prob[i] = expf((key_value(keys[i]) - max) / temperature);
        sum += prob[i];
    }
    for (int i = 0; i < n; ++i) prob[i] /= sum;
    if (top_p < 1.0f) {
        float acc = 0.0f;
        for (int i = 0; i < n; ++i) {
            acc += prob[i];
            if (acc >= top_p) { n = i + 1; break; }
        }
    }
    if (min_p > 0.0f) {
        const float floor = prob[0] * min_p;
        int keep = 0;
        while (keep < n && prob[keep] >= floor) ++keep;
        n = keep < 1 ? 1 : keep;
    }
    float total = 0.0f;
    for (int i = 0; i < n; ++i) total += prob[i];
    const float u = u_in ? *u_in : (float)(splitmix_next(rng_state) >> 40) / (float)(1u << 24);
    float r = u * total;
    for (int i = 0; i < n; ++i) {
        if (r < prob[i]) { *out = (int)key_index(keys[i]); return; }
        r -= prob[i];
    }
    *out = (int)key_index(keys[n - 1]);
}

// The uniform draw comes from `u_in` when given (a host sampler's own generator), else
// from the SplitMix64 state `rng_state`.
extern "C" __global__ void sample_final(const u64* __restrict__ cand, int ncand, int k, float temperature, float top_p,
                                        float min_p, u64* __restrict__ rng_state, const float* __restrict__ u_in,
                                        int* __restrict__ out) {
    grid_dependency_wait();
    sample_from(cand, ncand, k, temperature, top_p, min_p, rng_state, u_in, out);
}

// A batch: row y of candidates (`ncand` each, from topk_partial with `kslice` per slice)
// sampled with its own settings params[y] = (temperature, top_p, min_p, top_k) and uniform
// draw u[y]; top_k 1 is greedy (the lowest index among equal maxima, as argmax).
extern "C" __global__ void sample_rows(const u64* __restrict__ cand, int ncand, const float4* __restrict__ params,
                                       const float* __restrict__ u, int* __restrict__ out) {
    grid_dependency_wait();
    const int y = blockIdx.y;
    const float4 p = params[y];
    const int k = min(max((int)p.w, 1), 64);  // prob[] holds 64
    sample_from(cand + (size_t)y * ncand, ncand, k, p.x, p.y, p.z, nullptr, u + y, out + y);
}

// logits[index[i]] += bias[i] for each of the `n` entries (a sequence's logit bias, its
// row's offset folded into the index), before the rows are sampled. Indices outside
// [0, len) are skipped. Atomic: an index listed twice gets both additions.
extern "C" __global__ void add_logit_bias(float* __restrict__ logits, int len, const int* __restrict__ index,
                                          const float* __restrict__ bias, int n) {
    grid_dependency_wait();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const int at = index[i];
        if (at >= 0 && at < len) atomicAdd(logits + at, bias[i]);
    }
}
