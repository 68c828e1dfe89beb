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

#define MOE_MAX_EXPERTS 1024

// Token t (blockIdx.x) of `count` router logits (row t of `logits`): the softmax over every
// expert, the `used` most probable, each weighted by its probability (divided by the chosen
// ones' sum when `normalize`). Writes ids[t·used + j] in ascending expert order, the order
// the CPU oracle sums them in, and the weights alike. A NaN logit makes every weight NaN:
// it reaches the output rather than being routed around. One warp a token, the logits in
// its registers (expert lane + 32·i in lane `lane`'s v[i]): the `used` rounds of picking
// the best are warp shuffles, with no block-wide barrier. count ≤ MOE_MAX_EXPERTS, used ≤ 32
// (lane j keeps the j-th pick).
extern "C" __global__ void __launch_bounds__(32) moe_route(const float* __restrict__ logits, int count, int used,
                                                           int normalize, int* __restrict__ ids,
                                                           float* __restrict__ weights) {
    grid_dependency_wait();
    constexpr int PER_LANE = MOE_MAX_EXPERTS / 32;
    const int t = blockIdx.x, lane = threadIdx.x;
    logits += (size_t)t * count;
    float v[PER_LANE];
    float mx = -INFINITY;
    bool nan = false;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        const int e = lane + 32 * i;
        v[i] = e < count ? logits[e] : -INFINITY;
        if (isnan(v[i])) {
            nan = true;
            v[i] = -INFINITY;  // never picked ahead of a number; the weights carry the NaN
        }
        mx = fmaxf(mx, v[i]);
    }
    mx = warp_max(mx);
    const bool any_nan = __any_sync(0xffffffffu, nan);
    float total = 0.0f;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i)
        if (lane + 32 * i < count) total += expf(v[i] - mx);
    total = warp_sum(total);
    // Round j picks the best expert not yet taken; its lane marks it taken. Lane j keeps
    // the j-th pick.
    u32 taken = 0;
    int mine = count;
    for (int j = 0; j < used; ++j) {
        Pick best = {-INFINITY, count};
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            const Pick p = {v[i], lane + 32 * i};
            if (p.e < count && !(taken >> i & 1) && better(p, best)) best = p;
        }
        best = warp_best(best);
        if ((best.e & 31) == lane) taken |= 1u << (best.e >> 5);
        if (lane == j) mine = best.e;
    }
    // Ascending expert order: lane j's rank among the picks.
    int rank = 0;
    for (int j = 0; j < used; ++j) rank += __shfl_sync(0xffffffffu, mine, j) < mine;
    const float p = lane < used ? expf(logits[mine] - mx) / total : 0.0f;
    const float sum = warp_sum(p);
    if (lane < used) {
        ids[(size_t)t * used + rank] = mine;
        weights[(size_t)t * used + rank] =
            any_nan ? __int_as_float(0x7fffffff) : p / (normalize ? sum : 1.0f);
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
// slots in this order so the blocks running at once share an expert's rows in L2, and the
// grouped matmuls (bmm.cu) take expert e's slots from order[starts[e]] to
// order[starts[e + 1]] (`starts`, count + 1 values, may be null). The results do not depend
// on the order within an expert. One block; count ≤ MOE_MAX_EXPERTS.
extern "C" __global__ void moe_order(const int* __restrict__ ids, int slots, int count, int* __restrict__ order,
                                     int* __restrict__ starts) {
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
            if (starts) starts[e] = sum;
            sum += n;
        }
        if (starts) starts[count] = sum;
    }
    __syncthreads();
    for (int s = threadIdx.x; s < slots; s += blockDim.x) order[atomicAdd(&start[ids[s]], 1)] = s;
}
