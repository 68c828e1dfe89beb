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
// chunk, K and V written to the cache at positions start + t (f16, or with Q8 q8_0: kd, vd
// are its scale planes). Grid (n_heads + n_kv, rows); the per-token logic is rope.cu's
// rope_kv, with the bias the decode GEMV adds itself.
template <bool Q8>
static __device__ __forceinline__ void rope_kv_rows_impl(const float* __restrict__ qkv, const float* __restrict__ bias,
                                                         float* __restrict__ q_out, void* kc, void* vc, u16* kd,
                                                         u16* vd, int start, int n_heads, int n_kv, int hd,
                                                         int rot_dims, const float* __restrict__ inv_freq, int neox,
                                                         const float* __restrict__ q_norm,
                                                         const float* __restrict__ k_norm, float eps, int max_ctx,
                                                         const int* __restrict__ table) {
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
    const bool mine = i < half;
    int a, b;
    if (neox) {
        const int rhalf = rot_dims / 2;
        if (i < rhalf) { a = i; b = i + rhalf; }
        else { a = rot_dims + 2 * (i - rhalf); b = a + 1; }
    } else {
        a = 2 * i; b = 2 * i + 1;
    }
    float xa = 0.0f, xb = 0.0f;
    if (mine) {
        xa = row[off + a];
        xb = row[off + b];
        if (bias) { xa += bias[off + a]; xb += bias[off + b]; }
    }
    const float* norm = is_q ? q_norm : k_norm;
    if (norm) {
        const float ss = block_sum(xa * xa + xb * xb, scratch);
        const float s = rsqrtf(ss / (float)hd + eps);
        if (mine) { xa = xa * s * norm[a]; xb = xb * s * norm[b]; }
    }
    if (mine && 2 * i < rot_dims) {
        float sn, cs;
        sincosf((float)pos * inv_freq[i], &sn, &cs);
        const float ra = xa * cs - xb * sn, rb = xa * sn + xb * cs;
        xa = ra; xb = rb;
    }
    if (is_q) {
        if (mine) {
            float* q = q_out + ((size_t)t * n_heads + head) * hd;
            q[a] = xa;
            q[b] = xb;
        }
    } else {
        const size_t c = ((size_t)kvh * max_ctx + kv_row(table, pos, max_ctx)) * hd;
        const int voff = (n_heads + n_kv + kvh) * hd;
        float va = 0.0f, vb = 0.0f;
        if (mine) {
            va = row[voff + a];
            vb = row[voff + b];
            if (bias) { va += bias[voff + a]; vb += bias[voff + b]; }
        }
        store_kv<Q8>(kc, vc, kd, vd, c, hd, mine, a, b, xa, xb, va, vb);
    }
}

#define ROPE_KV_ROWS_ENTRY(NAME, Q8)                                                                                   \
    extern "C" __global__ void NAME(const float* __restrict__ qkv, const float* __restrict__ bias,                     \
                                    float* __restrict__ q_out, void* kc, void* vc, u16* kd, u16* vd, int start,        \
                                    int n_heads, int n_kv, int hd, int rot_dims, const float* __restrict__ inv_freq,   \
                                    int neox, const float* __restrict__ q_norm, const float* __restrict__ k_norm,      \
                                    float eps, int max_ctx, const int* __restrict__ table) {                           \
        grid_dependency_wait();                                                                                        \
        rope_kv_rows_impl<Q8>(qkv, bias, q_out, kc, vc, kd, vd, start, n_heads, n_kv, hd, rot_dims, inv_freq, neox,    \
                              q_norm, k_norm, eps, max_ctx, table);                                                    \
    }
ROPE_KV_ROWS_ENTRY(rope_kv_rows, false)
ROPE_KV_ROWS_ENTRY(rope_kv_rows_q8, true)

// One sequence's positions 0..rows of a q8_0 cache's layer (every KV head, keys and values:
// blockIdx.z), found through kv_row(table, p, src_rows), as f16 in a contiguous cache of
// `dst_rows` rows a head (position p in row p), for the prefill attention kernels (which read
// f16 tiles): each value becomes d · q exactly as the decode kernels compute it, rounded to
// f16. Grid (ceil(rows · hd / 256), n_kv, 2), 256 threads, one value a thread.
extern "C" __global__ void kv_q8_to_f16(const i8* __restrict__ kq, const u16* __restrict__ kd,
                                        const i8* __restrict__ vq, const u16* __restrict__ vd, u16* __restrict__ kf,
                                        u16* __restrict__ vf, int rows, int hd, int dst_rows, int src_rows,
                                        const int* __restrict__ table) {
    grid_dependency_wait();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)rows * hd) return;
    const int p = (int)(i / hd);
    const size_t e = ((size_t)blockIdx.y * src_rows + kv_row(table, p, src_rows)) * hd + i % hd;
    const size_t o = (size_t)blockIdx.y * dst_rows * hd + i;
    const bool values = blockIdx.z == 1;
    const i8* q = values ? vq : kq;
    const u16* d = values ? vd : kd;
    (values ? vf : kf)[o] = f2h(h2f(d[e / 32]) * (float)q[e]);
}

// Causal GQA attention of the chunk's queries over the cache: query t of head h sees
// positions 0 ..= start + t of KV head h / (n_heads / n_kv). One block of 4 warps per
// (head, query); warp w takes positions w, w + 4, ... with an online softmax (lane l holds
// dimensions l, l + 32, ...), then the 4 partial results are merged. With `sinks`, head h's
// softmax also holds the logit sinks[h], which attends to nothing (gpt-oss). Output in f16
// (the O projection's GEMM input), [rows][n_heads * hd].
template <int E>
static __device__ __forceinline__ void attn_prefill(const float* __restrict__ q, const u16* __restrict__ kc,
                                                    const u16* __restrict__ vc, u16* __restrict__ out, int n_heads,
                                                    int n_kv, int max_ctx, int start, float scale, int window,
                                                    const int* __restrict__ table, const float* __restrict__ sinks) {
    constexpr int HD = 32 * E, NW = 4;
    const int head = blockIdx.x, t = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kvh = head / (n_heads / n_kv);
    const int len = start + t + 1;
    // A sliding-window layer sees the last `window` positions, in a ring of max_ctx rows; a
    // paged layer's rows come through its block table (kv_row).
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
        const int row = kv_row(table, j, max_ctx);
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
    if (sinks) tot += expf(sinks[head] - mx);
    u16* o = out + ((size_t)t * n_heads + head) * HD;
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < NW; ++w) v += so[w][d] * wt[w];
        o[d] = f2h(v / tot);
    }
}

#define ATTN_PREFILL(E)                                                                                                \
    extern "C" __global__ void __launch_bounds__(128) attn_prefill_##E(                                                \
        const float* q, const u16* kc, const u16* vc, u16* out, int n_heads, int n_kv, int max_ctx, int start,         \
        float scale, int window, const int* table, const float* sinks) {                                               \
        grid_dependency_wait();                                                                                        \
        attn_prefill<E>(q, kc, vc, out, n_heads, n_kv, max_ctx, start, scale, window, table, sinks);                   \
    }
ATTN_PREFILL(1)
ATTN_PREFILL(2)
ATTN_PREFILL(3)
ATTN_PREFILL(4)
ATTN_PREFILL(5)
ATTN_PREFILL(6)
ATTN_PREFILL(7)
ATTN_PREFILL(8)

// The same attention on tensor cores, flash-attention style, for head_dim 64 and 128: a block
// of 4 warps takes 64 queries of one head (16 a warp) and walks the keys they see in tiles of
// BKV, each K/V tile copied to shared memory (cp.async, double-buffered: the next tile loads
// while this one is used). Per tile a warp computes S = Q·Kᵀ (mma m16n8k16, f16 in, f32
// accumulate; Q pre-scaled by scale·log2 e and held in registers), masks what its queries
// may not see (later positions, or before a sliding window), updates its running row
// maximum and sum (online softmax, base 2), and adds P·V with P rounded to f16 from the S
// registers. Rows outside the prompt, and key rows past the block's last position, are
// zero-filled so that masked weights (0) never meet garbage (0 · NaN). Blocks are issued
// longest first (the last queries see the most keys).
template <int HD, int BKV>
static __device__ __forceinline__ void attn_prefill_mma(const float* __restrict__ q, const u16* __restrict__ kc,
                                                        const u16* __restrict__ vc, u16* __restrict__ out, int rows,
                                                        int n_heads, int n_kv, int max_ctx, int start, float scale,
                                                        int window, const int* __restrict__ table,
                                                        const float* __restrict__ sinks) {
    constexpr int BQ = 64, LD = HD + 8;  // shared rows padded by 16 bytes: ldmatrix without bank conflicts
    constexpr int KSTEPS = HD / 16, SN = BKV / 8, ON = HD / 8, CHUNKS = HD / 8;
    __shared__ __align__(16) u16 ks[2][BKV * LD];
    __shared__ __align__(16) u16 vs[2][BKV * LD];
    const int head = blockIdx.y;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int kvh = head / (n_heads / n_kv);
    const int qw = q0 + warp * 16;                    // this warp's first query row
    const int hi = start + min(q0 + BQ, rows);        // the block sees positions [lo, hi)
    const int lo = window > 0 ? max(0, start + q0 - window + 1) : 0;
    const float qscale = scale * 1.4426950408889634f;  // exp(x) = exp2(x · log2 e)

    u32 qa[KSTEPS][4];
#pragma unroll
    for (int k = 0; k < KSTEPS; ++k) {
#pragma unroll
        for (int h = 0; h < 4; ++h) {
            const int r = qw + g + (h & 1) * 8, c = k * 16 + 2 * t4 + (h >> 1) * 8;
            float x = 0.0f, y = 0.0f;
            if (r < rows) {
                const float* src = q + ((size_t)r * n_heads + head) * HD + c;
                x = src[0] * qscale;
                y = src[1] * qscale;
            }
            qa[k][h] = pack_h2(x, y);
        }
    }
    float o[ON][4];
#pragma unroll
    for (int n = 0; n < ON; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

    const u16* K = kc + (size_t)kvh * max_ctx * HD;
    const u16* V = vc + (size_t)kvh * max_ctx * HD;
    const int ntiles = (hi - lo + BKV - 1) / BKV;
    auto load_tile = [&](int j, int buf) {
        const int p0 = lo + j * BKV;
        for (int c = threadIdx.x; c < BKV * CHUNKS; c += blockDim.x) {
            const int r = c / CHUNKS, ch = c % CHUNKS, p = p0 + r;
            u16* kd = &ks[buf][r * LD + ch * 8];
            u16* vd = &vs[buf][r * LD + ch * 8];
            if (p < hi) {
                const size_t at = (size_t)kv_row(table, p, max_ctx) * HD + ch * 8;
                cp_async16(smem_u32(kd), K + at);
                cp_async16(smem_u32(vd), V + at);
            } else {
                *(uint4*)kd = make_uint4(0, 0, 0, 0);
                *(uint4*)vd = make_uint4(0, 0, 0, 0);
            }
        }
        cp_async_commit();
    };

    if (ntiles > 0) load_tile(0, 0);
    for (int j = 0; j < ntiles; ++j) {
        const int buf = j & 1;
        if (j + 1 < ntiles) {
            load_tile(j + 1, buf ^ 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const int p0 = lo + j * BKV;
        // A warp whose queries see nothing of this tile (all later, or all before their
        // windows, or no queries at all) skips it.
        const bool skip = qw >= rows || p0 > start + qw + 15 ||
                          (window > 0 && p0 + BKV - 1 < start + qw - window + 1);
        if (!skip) {
            float s[SN][4];
#pragma unroll
            for (int n = 0; n < SN; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
            const u16* kt = ks[buf];
#pragma unroll
            for (int k = 0; k < KSTEPS; ++k) {
#pragma unroll
                for (int n = 0; n < SN; n += 2) {
                    // Matrices: keys n·8.. at dims k·16 and k·16 + 8, then keys (n+1)·8.. likewise.
                    const int mi = lane >> 3, r = lane & 7;
                    u32 b0, b1, b2, b3;
                    ldsm_x4(kt + (n * 8 + (mi >> 1) * 8 + r) * LD + k * 16 + (mi & 1) * 8, b0, b1, b2, b3);
                    mma_f16(s[n], qa[k], b0, b1);
                    mma_f16(s[n + 1], qa[k], b2, b3);
                }
            }
            // Mask what the queries may not see, then the online softmax of rows g and g + 8.
#pragma unroll
            for (int n = 0; n < SN; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int kp = p0 + n * 8 + 2 * t4 + (e & 1);
                    const int qp = start + qw + g + (e >> 1) * 8;
                    const bool seen = kp <= qp && (window <= 0 || kp > qp - window);
                    s[n][e] = seen ? s[n][e] : -INFINITY;
                }
            }
            flash_softmax(s, m, l, o);
            flash_pv<SN, ON, LD>(s, vs[buf], o);
        }
        __syncthreads();  // the next iteration's load overwrites this buffer
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(FULL_MASK, l[h], 1);
        l[h] += __shfl_xor_sync(FULL_MASK, l[h], 2);
        // A sink's logit joins the denominator (m is in base-2 units, like the scores).
        if (sinks) l[h] += exp2f(sinks[head] * 1.4426950408889634f - m[h]);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = qw + g + h * 8;
        if (r >= rows) continue;
        // Every query sees at least its own position, so l > 0.
        const float inv = 1.0f / l[h];
        u32* dst = (u32*)(out + ((size_t)r * n_heads + head) * HD);
#pragma unroll
        for (int n = 0; n < ON; ++n) dst[(n * 8 + 2 * t4) / 2] = pack_h2(o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
    }
}

#define ATTN_PREFILL_MMA(HD, BKV)                                                                                      \
    extern "C" __global__ void __launch_bounds__(128) attn_prefill_mma_##HD(                                           \
        const float* q, const u16* kc, const u16* vc, u16* out, int rows, int n_heads, int n_kv, int max_ctx,          \
        int start, float scale, int window, const int* table, const float* sinks) {                                    \
        grid_dependency_wait();                                                                                        \
        attn_prefill_mma<HD, BKV>(q, kc, vc, out, rows, n_heads, n_kv, max_ctx, start, scale, window, table, sinks);   \
    }
ATTN_PREFILL_MMA(64, 64)
ATTN_PREFILL_MMA(128, 32)

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


// The largest (m, i) over the warp, ties to the lowest index; every lane gets it.
static __device__ __forceinline__ void warp_argmax(float& m, int& i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float om = __shfl_xor_sync(FULL_MASK, m, o);
        const int oi = __shfl_xor_sync(FULL_MASK, i, o);
        if (om > m || (om == m && oi < i)) {
            m = om;
            i = oi;
        }
    }
}

// What a perplexity run needs of each scored row of logits, without copying the rows to the
// host: nll[r] = log Σ exp(x) − x[target[r]] (NaN when the row holds a non-finite value or
// the target is out of range) and top[r], the first index of the row's maximum. One block
// per row: a pass for the maximum (and its first index), a pass for the sum of exp(x − max).
extern "C" __global__ void score_rows(const float* __restrict__ logits, int vocab, const int* __restrict__ target,
                                      float* __restrict__ nll, int* __restrict__ top) {
    grid_dependency_wait();
    __shared__ float sm[32];
    __shared__ int si[32];
    __shared__ int bad;
    const size_t row = blockIdx.x;
    const float* x = logits + row * (size_t)vocab;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    if (threadIdx.x == 0) bad = 0;
    float m = -INFINITY;
    int mi = 0x7fffffff;
    bool finite = true;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = x[i];
        finite &= isfinite(v);
        if (v > m) {
            m = v;
            mi = i;
        }
    }
    // Block-wide maximum, ties to the lowest index.
    warp_argmax(m, mi);
    __syncthreads();
    if (!finite) bad = 1;
    if (lane == 0) {
        sm[warp] = m;
        si[warp] = mi;
    }
    __syncthreads();
    if (warp == 0) {
        m = lane < nwarps ? sm[lane] : -INFINITY;
        mi = lane < nwarps ? si[lane] : 0x7fffffff;
        warp_argmax(m, mi);
        if (lane == 0) {
            sm[0] = m;
            si[0] = mi;
        }
    }
    __syncthreads();
    const float max = sm[0];
    const int arg = si[0];
    float s = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) s += expf(x[i] - max);
    s = block_sum(s, sm);
    if (threadIdx.x == 0) {
        const int t = target[row];
        const bool ok = !bad && t >= 0 && t < vocab;
        nll[row] = ok ? max + logf(s) - x[t] : __int_as_float(0x7fffffff);
        top[row] = arg;
    }
}
