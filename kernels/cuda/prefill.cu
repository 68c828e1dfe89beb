// The per-token steps of a batched prefill, over the N tokens of a chunk (row t of every
// activation is token t, at position start + t). The matrix products themselves are cuBLAS
// GEMMs on f16 copies of the weights; these kernels feed them f16 inputs and consume their
// f32 outputs. The residual stream stays f32.

// y (f16) = x · rsqrt(mean(x²) + eps) · w, one block per row.
extern "C" __global__ void rmsnorm_rows_f16(const float* __restrict__ x, const float* __restrict__ w, float eps,
                                            u16* __restrict__ y, int n) {
    grid_dependency_wait();
    __shared__ float scratch[32];
    const size_t row = blockIdx.x;
    x += row * n;
    y += row * n;
    const float scale = row_rms_scale(x, n, eps, scratch);
    for (int i = threadIdx.x; i < n; i += blockDim.x) y[i] = f2h(x[i] * scale * w[i]);
}

// RoPE (+ optional bias before it and per-head RMSNorm of Q and K) for every token of the
// chunk, K and V written to the cache at positions start + t. Grid (n_heads + n_kv, rows);
// the per-token logic is rope.cu's rope_kv, with the bias the decode GEMV adds itself.
extern "C" __global__ void rope_kv_rows(const float* __restrict__ qkv, const float* __restrict__ bias,
                                        float* __restrict__ q_out, u16* __restrict__ kc, u16* __restrict__ vc,
                                        int start, int n_heads, int n_kv, int hd, int rot_dims,
                                        const float* __restrict__ inv_freq, int neox, const float* __restrict__ q_norm,
                                        const float* __restrict__ k_norm, float eps, int max_ctx) {
    grid_dependency_wait();
    __shared__ float scratch[32];
    const int head = blockIdx.x, t = blockIdx.y;
    const bool is_q = head < n_heads;
    const int kvh = head - n_heads;
    const size_t width = (size_t)(n_heads + 2 * n_kv) * hd;
    const float* row = qkv + (size_t)t * width;
    const int off = is_q ? head * hd : (n_heads + kvh) * hd;
    const int pos = start + t;
    const int i = threadIdx.x;
    const int half = hd / 2;
    int a, b;
    if (neox) {
        const int rhalf = rot_dims / 2;
        if (i < rhalf) { a = i; b = i + rhalf; }
        else { a = rot_dims + 2 * (i - rhalf); b = a + 1; }
    } else {
        a = 2 * i; b = 2 * i + 1;
    }
    float xa = 0.0f, xb = 0.0f;
    if (i < half) {
        xa = row[off + a];
        xb = row[off + b];
        if (bias) { xa += bias[off + a]; xb += bias[off + b]; }
    }
    const float* norm = is_q ? q_norm : k_norm;
    if (norm) {
        const float ss = block_sum(xa * xa + xb * xb, scratch);
        const float s = rsqrtf(ss / (float)hd + eps);
        if (i < half) { xa = xa * s * norm[a]; xb = xb * s * norm[b]; }
    }
    if (i >= half) return;
    if (2 * i < rot_dims) {
        float sn, cs;
        sincosf((float)pos * inv_freq[i], &sn, &cs);
        const float ra = xa * cs - xb * sn, rb = xa * sn + xb * cs;
        xa = ra; xb = rb;
    }
    if (is_q) {
        float* q = q_out + ((size_t)t * n_heads + head) * hd;
        q[a] = xa;
        q[b] = xb;
    } else {
        const size_t c = ((size_t)kvh * max_ctx + pos % max_ctx) * hd;  // a ring for windowed layers
        kc[c + a] = f2h(xa);
        kc[c + b] = f2h(xb);
        const int voff = (n_heads + n_kv + kvh) * hd;
        float va = row[voff + a], vb = row[voff + b];
        if (bias) { va += bias[voff + a]; vb += bias[voff + b]; }
        vc[c + a] = f2h(va);
        vc[c + b] = f2h(vb);
    }
}

// Causal GQA attention of the chunk's queries over the cache: query t of head h sees
// positions 0 ..= start + t of KV head h / (n_heads / n_kv). One block of 4 warps per
// (head, query); warp w takes positions w, w + 4, ... with an online softmax (lane l holds
// dimensions l, l + 32, ...), then the 4 partial results are merged. Output in f16 (the
// O projection's GEMM input), [rows][n_heads * hd].
template <int E>
static __device__ __forceinline__ void attn_prefill(const float* __restrict__ q, const u16* __restrict__ kc,
                                                    const u16* __restrict__ vc, u16* __restrict__ out, int n_heads,
                                                    int n_kv, int max_ctx, int start, float scale, int window) {
    constexpr int HD = 32 * E, NW = 4;
    const int head = blockIdx.x, t = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kvh = head / (n_heads / n_kv);
    const int len = start + t + 1;
    // A sliding-window layer sees the last `window` positions, in a ring of max_ctx rows.
    const int lo = window > 0 ? max(0, len - window) : 0;
    const float* qr = q + ((size_t)t * n_heads + head) * HD;
    float qv[E], acc[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
        qv[e] = qr[lane + 32 * e] * scale;
        acc[e] = 0.0f;
    }
    const u16* K = kc + (size_t)kvh * max_ctx * HD;
    const u16* V = vc + (size_t)kvh * max_ctx * HD;
    float m = -INFINITY, l = 0.0f;
    for (int j = lo + warp; j < len; j += NW) {
        const int row = j % max_ctx;
        const u16* kr = K + (size_t)row * HD;
        float s = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) s += qv[e] * h2f(kr[lane + 32 * e]);
        s = warp_sum(s);
        const float mn = fmaxf(m, s);
        const float corr = expf(m - mn), p = expf(s - mn);
        l = l * corr + p;
        const u16* vr = V + (size_t)row * HD;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[e] = acc[e] * corr + p * h2f(vr[lane + 32 * e]);
        m = mn;
    }
    __shared__ float sm[NW], sl[NW], so[NW][HD];
    if (lane == 0) {
        sm[warp] = m;
        sl[warp] = l;
    }
#pragma unroll
    for (int e = 0; e < E; ++e) so[warp][lane + 32 * e] = acc[e];
    __syncthreads();
    // Warp 0 always saw the first position, so the overall maximum is finite; a warp that
    // saw no position has m = -inf and weight 0.
    float mx = sm[0];
#pragma unroll
    for (int w = 1; w < NW; ++w) mx = fmaxf(mx, sm[w]);
    float wt[NW], tot = 0.0f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
        wt[w] = expf(sm[w] - mx);
        tot += sl[w] * wt[w];
    }
    u16* o = out + ((size_t)t * n_heads + head) * HD;
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < NW; ++w) v += so[w][d] * wt[w];
        o[d] = f2h(v / tot);
    }
}

#define ATTN_PREFILL(E)                                                                                                \
    extern "C" __global__ void __launch_bounds__(128) attn_prefill_##E(                                               \
        const float* q, const u16* kc, const u16* vc, u16* out, int n_heads, int n_kv, int max_ctx, int start,        \
        float scale, int window) {                                                                                     \
        grid_dependency_wait();                                                                                        \
        attn_prefill<E>(q, kc, vc, out, n_heads, n_kv, max_ctx, start, scale, window);                                \
    }
ATTN_PREFILL(1)
ATTN_PREFILL(2)
ATTN_PREFILL(3)
ATTN_PREFILL(4)
ATTN_PREFILL(5)
ATTN_PREFILL(6)
ATTN_PREFILL(7)
ATTN_PREFILL(8)

// y[t][i] (f16) = act(gu[t][i]) · gu[t][ffn + i]: gate and up came out of one GEMM; act is
// SiLU (SwiGLU) or, with `gelu`, tanh-approximated GELU (GeGLU).
extern "C" __global__ void swiglu_rows_f16(const float* __restrict__ gu, u16* __restrict__ y, int rows, int ffn,
                                           int gelu) {
    grid_dependency_wait();
    const size_t g = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= (size_t)rows * ffn) return;
    const size_t t = g / ffn, i = g % ffn;
    const float a = gu[t * 2 * ffn + i], b = gu[t * 2 * ffn + ffn + i];
    y[g] = f2h(glu_act(a, gelu) * b);
}

