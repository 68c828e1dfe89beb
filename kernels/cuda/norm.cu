// RMSNorm, fused with quantisation of its output to Q8_1 (the activation format the dp4a
// GEMVs read) and its residual plane, or plain quantisation; and the copy kernel the
// bandwidth roofline is measured with.
//
// Q8_1 on the device is two arrays rather than ggml's interleaved 36-byte blocks, so both
// can be read with aligned vector loads: `q` holds the int8 values (32 per block, rows
// padded to whole blocks with zeros) and `ds` one float2 per block: (d, d * sum(q)).

// Grid (ceil(blocks / warps per block), rows): each warp quantises one 32-value block, so a
// long row is spread over many SMs. With normalisation every block of threads computes
// the row's sum of squares itself (the row is read from L2 a few times over) rather than
// waiting on another launch. `w` may be null (no scaling: plain quantisation), `eps < 0`
// disables the normalisation; `y` (the f32 result), `q`/`ds`, `lo` and `parts` (each
// 32-value block's sum of squares before the weight) may each be null.
extern "C" __global__ void rmsnorm_q8_1(const float* __restrict__ x, const float* __restrict__ w, float eps,
                                        float* __restrict__ y, i8* __restrict__ q, i8* __restrict__ lo,
                                        float2* __restrict__ ds, float* __restrict__ parts, int n) {
    grid_dependency_wait();
    __shared__ float scratch[32];
    const int row = blockIdx.y;
    const int nblk = (n + 31) >> 5;
    x += (size_t)row * n;
    float scale = 1.0f;
    if (eps >= 0.0f) {
        float ss = 0.0f;
        if ((n & 3) == 0) {
            for (int i = threadIdx.x; i < n / 4; i += blockDim.x) {
                const float4 v = ((const float4*)x)[i];
                ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
            }
        } else {
            for (int i = threadIdx.x; i < n; i += blockDim.x) ss += x[i] * x[i];
        }
        ss = block_sum(ss, scratch);
        scale = rsqrtf(ss / (float)n + eps);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int b = blockIdx.x * (blockDim.x >> 5) + warp;
    if (b >= nblk) return;
    const int i = b * 32 + lane;
    float v = 0.0f;
    if (i < n) v = x[i] * scale;
    // The block's Σv² before the weight: a pending norm's partial sum (see gemv.cu's XIn).
    if (parts) {
        const float ss = warp_sum(v * v);
        if (lane == 0) parts[(size_t)row * nblk + b] = ss;
    }
    if (i < n) {
        if (w) v *= w[i];
        if (y) y[(size_t)row * n + i] = v;
    }
    if (q) quantize_block_warp(v, q, lo, ds, (size_t)row * nblk * 32 + i, (size_t)row * nblk + b);
}

// Bandwidth yardstick: y = x with 16-byte accesses, grid-stride.
extern "C" __global__ void copy_u128(const uint4* __restrict__ x, uint4* __restrict__ y, size_t n) {
    grid_dependency_wait();
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) y[i] = x[i];
}
