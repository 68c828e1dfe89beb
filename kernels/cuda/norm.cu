// RMSNorm, fused with quantisation of its output to Q8_1 (the activation format the dp4a
// GEMVs read) and its residual plane, or plain quantisation; and the copy kernel the
// bandwidth roofline is measured with.
//
// Q8_1 on the device is two arrays rather than ggml's interleaved 36-byte blocks, so both
// can be read with aligned vector loads: `q` holds the int8 values (32 per block, rows
// padded to whole blocks with zeros) and `ds` one float2 per block: (d, d * sum(q)).

// rsqrt(mean(x²) + eps) over a row of n values, computed by the whole block (every thread
// gets it; `scratch` holds 32 floats).
static __device__ __forceinline__ float rms_scale(const float* __restrict__ x, int n, float eps, float* scratch) {
    float ss = 0.0f;
    if ((n & 3) == 0) {
        for (int i = threadIdx.x; i < n / 4; i += blockDim.x) {
            const float4 v = ((const float4*)x)[i];
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
    } else {
        for (int i = threadIdx.x; i < n; i += blockDim.x) ss += x[i] * x[i];
    }
    return rsqrtf(block_sum(ss, scratch) / (float)n + eps);
}

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
    const float scale = eps >= 0.0f ? rms_scale(x, n, eps, scratch) : 1.0f;
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

// Packs `gridDim.y` rows of `n` values — RMS-normalised times `w` when eps >= 0, times `w`
// when only `w` is given — into the batched matmuls' activation layout (see bmm.cu): per
// row and 32-value chunk, the Q8_1 values and their residual plane interleaved for the mma
// B fragments, and (dx, sx) per chunk and row, chunk-major; and the same values in f16 in
// the same order (`out_h`, for the f16 walk). One warp per chunk, 8 per block.
extern "C" __global__ void act_pack(const float* __restrict__ x, const float* __restrict__ w, float eps, int n,
                                    uint4* __restrict__ out, float2* __restrict__ s, u16* __restrict__ out_h) {
    grid_dependency_wait();
    __shared__ float scratch[32];
    const int row = blockIdx.y, rows = gridDim.y;
    const int nblk = (n + 31) >> 5;
    x += (size_t)row * n;
    const float scale = eps >= 0.0f ? rms_scale(x, n, eps, scratch) : 1.0f;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int b = blockIdx.x * (blockDim.x >> 5) + warp;
    if (b >= nblk) return;
    const int i = b * 32 + lane;
    float v = 0.0f;
    if (i < n) v = x[i] * scale * (w ? w[i] : 1.0f);
    pack_chunk_warp(v, lane, row, rows, nblk, b, out, s, out_h);
}

// Value r of row m of a batched matmul's result: its split sums added in split order, then
// bias, scale and residual, or the gated activation (see bmm_finish).
static __device__ __forceinline__ float finish_value(const float* __restrict__ part, int splits, int rows, int ldp,
                                                     int nrows, int swiglu, const float* __restrict__ bias,
                                                     const float* residual, float scale, int ldy, int m, int r) {
    float a = 0.0f, b = 0.0f;
    for (int sp = 0; sp < splits; ++sp) {
        const float* p = part + ((size_t)sp * rows + m) * ldp;
        a += p[r];
        if (swiglu) b += p[nrows + r];
    }
    if (swiglu) return glu_act(a, swiglu == 2) * b;
    float v = a;
    if (bias) v += bias[r];
    v *= scale;
    if (residual) v += residual[(size_t)m * ldy + r];
    return v;
}

// The batched matmuls' epilogue: y[m][r] = scale·(Σ over splits of part[split][m][r] (in
// split order) + bias[r]) + residual[m][r] (which may be y itself); in SwiGLU mode the parts
// hold gate rows [0, nrows) and up rows [nrows, 2·nrows) and y = act(gate) · up, act SiLU
// (swiglu 1) or tanh-approximated GELU (swiglu 2: GeGLU).
extern "C" __global__ void bmm_finish(const float* __restrict__ part, int splits, int rows, int ldp, int nrows,
                                      int swiglu, const float* __restrict__ bias, const float* residual, float scale,
                                      float* y, int ldy) {
    grid_dependency_wait();
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)rows * nrows) return;
    const int m = (int)(idx / nrows), r = (int)(idx % nrows);
    y[(size_t)m * ldy + r] = finish_value(part, splits, rows, ldp, nrows, swiglu, bias, residual, scale, ldy, m, r);
}

// bmm_finish, with y also packed for the next batched matmul as act_pack packs it without a
// norm: the launch act_pack would take. Grid (ceil(nrows / 1024), rows), 1024 threads,
// block (bx, m) finishing values [1024·bx, 1024·bx + 1024) of row m, each warp packing its
// own 32 (nrows a multiple of 32). A pack that normalises needs the whole row first; the
// form that had the last block of each row do it measured slower than act_pack's launch
// (docs/log/2026-11-to-12.md, "Fewer launches between the batched matmuls").
extern "C" __global__ void __launch_bounds__(1024)
    bmm_finish_pack(const float* __restrict__ part, int splits, int rows, int ldp, int nrows, int swiglu,
                    const float* __restrict__ bias, const float* residual, float scale, float* y, int ldy,
                    uint4* __restrict__ out,
                    float2* __restrict__ s, u16* __restrict__ out_h) {
    grid_dependency_wait();
    const int m = blockIdx.y, r = blockIdx.x * blockDim.x + threadIdx.x;
    float v = 0.0f;
    if (r < nrows) {
        v = finish_value(part, splits, rows, ldp, nrows, swiglu, bias, residual, scale, ldy, m, r);
        y[(size_t)m * ldy + r] = v;
    }
    if ((r >> 5) < (nrows >> 5)) pack_chunk_warp(v, threadIdx.x & 31, m, rows, nrows >> 5, r >> 5, out, s, out_h);
}

// x[t] += rmsnorm(y[t]) · w for each of the `rows` rows of n values, one block per row: a
// sandwich norm (Gemma's post-attention and post-MLP norms) joining the residual stream.
extern "C" __global__ void add_rmsnorm_rows(const float* __restrict__ y, const float* __restrict__ w, float eps,
                                            float* __restrict__ x, int n) {
    grid_dependency_wait();
    __shared__ float scratch[32];
    const size_t row = blockIdx.x;
    y += row * n;
    x += row * n;
    const float scale = row_rms_scale(y, n, eps, scratch);
    for (int i = threadIdx.x; i < n; i += blockDim.x) x[i] += y[i] * scale * w[i];
}

// x[t] += scale · bias for each of the `rows` rows of n values (grid (ceil(n / 256), rows)):
// the bias of a projection whose product came from a GEMM without an epilogue (the prefill's
// attention output, gpt-oss's).
extern "C" __global__ void add_bias_rows(const float* __restrict__ bias, float scale, float* __restrict__ x, int n) {
    grid_dependency_wait();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[(size_t)blockIdx.y * n + i] += scale * bias[i];
}
