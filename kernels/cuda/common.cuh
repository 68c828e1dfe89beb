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

static __device__ __forceinline__ float ld_h(const u8* p) {
    return h2f(*(const u16*)p);
}

static __device__ __forceinline__ int dp4a(int a, int b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// The gate activation of a gated feed-forward: SiLU (SwiGLU) or, with `gelu`, GELU in its
// tanh approximation (GeGLU: what ggml and `gelu_pytorch_tanh` compute).
static __device__ __forceinline__ float glu_act(float g, int gelu) {
    if (gelu) return 0.5f * g * (1.0f + tanhf(0.7978846f * (g + 0.044715f * g * g * g)));
    return g / (1.0f + expf(-g));
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
