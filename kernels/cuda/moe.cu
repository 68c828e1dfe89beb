// Mixture of Experts around the expert GEMVs (gemv.cu's ExpertSel): routing each token's
// router logits to its experts, and joining the experts' outputs into the residual stream.
// Both run inside the decode graph, so the chosen experts never leave the device.

// A (logit, expert) pair ordered as the CPU oracle orders experts: the larger logit first,
// equal logits to the lower index (torch.topk's pick). NaN ranks below everything, so the
// ids stay distinct and valid; the weights carry the NaN instead (see moe_route).
struct Pick {
    float v;
    int e;
};

static __device__ __forceinline__ bool better(Pick a, Pick b) {
    return a.v > b.v || (a.v == b.v && a.e < b.e);
}

static __device__ __forceinline__ Pick warp_best(Pick p) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const Pick q = {__shfl_xor_sync(0xffffffffu, p.v, o), __shfl_xor_sync(0xffffffffu, p.e, o)};
        if (better(q, p)) p = q;
    }
    return p;
}

#define MOE_MAX_USED 32

// The block's largest value; every thread gets it. `scratch` holds 32 floats.
static __device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : -INFINITY;
    return warp_max(v);
}

// Token t (blockIdx.x) of `count` router logits (row t of `logits`): the softmax over every
// expert, the `used` most probable, each weighted by its probability (divided by the chosen
// ones' sum when `normalize`). Writes ids[t·used + j] in ascending expert order, the order
// the CPU oracle sums them in, and the weights alike. A NaN logit makes every weight NaN:
// it reaches the output rather than being routed around. One block of up to 1024 threads
// a token; used ≤ MOE_MAX_USED.
extern "C" __global__ void moe_route(const float* __restrict__ logits, int count, int used, int normalize,
                                     int* __restrict__ ids, float* __restrict__ weights) {
    grid_dependency_wait();
    __shared__ float scratch[32];
    __shared__ Pick warp_picks[32];
    __shared__ int chosen[MOE_MAX_USED];
    const int t = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = (blockDim.x + 31) >> 5;
    logits += (size_t)t * count;
    float mx = -INFINITY, nan = 0.0f;
    for (int e = threadIdx.x; e < count; e += blockDim.x) {
        const float v = logits[e];
        if (isnan(v)) nan = 1.0f;
        else mx = fmaxf(mx, v);
    }
    mx = block_max(mx, scratch);
    const bool any_nan = block_sum(nan, scratch) > 0.0f;
    float total = 0.0f;
    for (int e = threadIdx.x; e < count; e += blockDim.x) total += expf(logits[e] - mx);
    total = block_sum(total, scratch);
    for (int j = 0; j < used; ++j) {
        Pick best = {-INFINITY, count};
        for (int e = threadIdx.x; e < count; e += blockDim.x) {
            bool taken = false;
            for (int i = 0; i < j; ++i) taken |= chosen[i] == e;
            if (taken) continue;
            const float v = logits[e];
            const Pick p = {isnan(v) ? -INFINITY : v, e};
            if (better(p, best)) best = p;
        }
        best = warp_best(best);
        if (lane == 0) warp_picks[warp] = best;
        __syncthreads();
        if (warp == 0) {
            Pick p = lane < nwarps ? warp_picks[lane] : Pick{-INFINITY, count};
            p = warp_best(p);
            if (lane == 0) chosen[j] = p.e;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        for (int i = 1; i < used; ++i)
            for (int k = i; k > 0 && chosen[k - 1] > chosen[k]; --k) {
                const int tmp = chosen[k];
                chosen[k] = chosen[k - 1];
                chosen[k - 1] = tmp;
            }
        float sum = 0.0f;
        for (int j = 0; j < used; ++j) sum += expf(logits[chosen[j]] - mx) / total;
        const float norm = normalize ? sum : 1.0f;
        for (int j = 0; j < used; ++j) {
            ids[(size_t)t * used + j] = chosen[j];
            weights[(size_t)t * used + j] = any_nan ? __int_as_float(0x7fffffff) : expf(logits[chosen[j]] - mx) / total / norm;
        }
    }
}

// Row t (blockIdx.y) of the residual stream joined by its token's experts: out[i] =
// residual[i] + scale·Σ_j weights[j]·y[j][i] over the `used` slots in order (`residual` may
// be `out`, or null: out = scale·Σ). With `q` also the planes of out·norm_w and each 32-value
// group's Σout² for the next GEMV, as rmsnorm_q8_1 quantises without normalising. One warp
// a 32-value group, 8 a block; grid (ceil(groups / 8), rows).
extern "C" __global__ void moe_combine(const float* __restrict__ y, const float* __restrict__ weights, int used,
                                       float scale, const float* residual, float* out, const float* __restrict__ norm_w,
                                       i8* __restrict__ q, i8* __restrict__ lo, float2* __restrict__ ds,
                                       float* __restrict__ parts, int n) {
    grid_dependency_wait();
    const int row = blockIdx.y;
    const int nblk = (n + 31) >> 5;
    const int lane = threadIdx.x & 31, b = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b >= nblk) return;
    const int i = b * 32 + lane;
    y += (size_t)row * used * n;
    weights += (size_t)row * used;
    float v = 0.0f;
    if (i < n) {
        float acc = 0.0f;
        for (int j = 0; j < used; ++j) acc += weights[j] * y[(size_t)j * n + i];
        v = scale * acc;
        if (residual) v += residual[(size_t)row * n + i];
        out[(size_t)row * n + i] = v;
    }
    if (parts) {
        const float ss = warp_sum(v * v);
        if (lane == 0) parts[(size_t)row * nblk + b] = ss;
    }
    if (q) {
        if (norm_w && i < n) v *= norm_w[i];
        quantize_block_warp(v, q, lo, ds, (size_t)row * nblk * 32 + i, (size_t)row * nblk + b);
    }
}

// order[] = the slots 0..slots in ascending order of their expert ids[slot] (a counting
// sort; within an expert in no particular order): the expert GEMVs of a batch run their
// slots in this order so the blocks running at once share an expert's rows in L2. The
// GEMVs' results do not depend on it. One block; count ≤ MOE_MAX_EXPERTS.
#define MOE_MAX_EXPERTS 1024
extern "C" __global__ void moe_order(const int* __restrict__ ids, int slots, int count, int* __restrict__ order) {
    grid_dependency_wait();
    __shared__ int start[MOE_MAX_EXPERTS];
    for (int e = threadIdx.x; e < count; e += blockDim.x) start[e] = 0;
    __syncthreads();
    for (int s = threadIdx.x; s < slots; s += blockDim.x) atomicAdd(&start[ids[s]], 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        int sum = 0;
        for (int e = 0; e < count; ++e) {
            const int n = start[e];
            start[e] = sum;
            sum += n;
        }
    }
    __syncthreads();
    for (int s = threadIdx.x; s < slots; s += blockDim.x) order[atomicAdd(&start[ids[s]], 1)] = s;
}
