// Rotary position embedding on the fused QKV projection output, with the rotated K and the
// V row written straight into the KV cache (f16), and optional per-head RMSNorm of Q and K
// before the rotation (Qwen3's QK-norm).
//
// qkv: [n_heads * hd | n_kv * hd | n_kv * hd] f32. One block per head: blocks
// [0, n_heads) handle Q (written to q_out), [n_heads, n_heads + n_kv) handle K and V.
// Thread i owns rotary pair i (i < hd / 2); `inv_freq` holds the rot_dims / 2 inverse
// frequencies, computed on the host exactly as the CPU reference does (scaling and
// per-pair factors included). The position is read from device memory so a captured graph
// serves every step.
// Cache layout: [n_kv][max_ctx][hd], position p in row p % max_ctx (a sliding-window
// layer's cache is a ring shorter than the context; for the others the row is p).

// One head of one token: `pos` its position; K and V go to the cache only when `write_kv`.
static __device__ __forceinline__ void rope_kv_head(const float* __restrict__ qkv, float* __restrict__ q_out,
                                                    u16* __restrict__ kc, u16* __restrict__ vc, int pos, bool write_kv,
                                                    int n_heads, int n_kv, int hd, int rot_dims,
                                                    const float* __restrict__ inv_freq, int neox,
                                                    const float* __restrict__ q_norm, const float* __restrict__ k_norm,
                                                    float eps, int max_ctx) {
    __shared__ float scratch[32];
    const int head = blockIdx.x;
    const bool is_q = head < n_heads;
    const int kvh = head - n_heads;
    const float* src = is_q ? qkv + (size_t)head * hd : qkv + (size_t)(n_heads + kvh) * hd;
    const int i = threadIdx.x;
    const int half = hd / 2;
    // Indices of this thread's pair.
    int a, b;
    if (neox) {
        const int rhalf = rot_dims / 2;
        if (i < rhalf) { a = i; b = i + rhalf; }
        else { a = rot_dims + 2 * (i - rhalf); b = a + 1; }  // unrotated tail, any pairing
    } else {
        a = 2 * i; b = 2 * i + 1;
    }
    float xa = 0.0f, xb = 0.0f;
    if (i < half) { xa = src[a]; xb = src[b]; }
    const float* norm = is_q ? q_norm : k_norm;
    if (norm) {
        const float ss = block_sum(xa * xa + xb * xb, scratch);
        const float s = rsqrtf(ss / (float)hd + eps);
        if (i < half) { xa = xa * s * norm[a]; xb = xb * s * norm[b]; }
    }
    if (i >= half) return;
    // Thread i's pair is rotary pair i in both layouts (ggml's theta index).
    const int pair = i;
    if (2 * pair < rot_dims) {
        float sn, cs;
        sincosf((float)pos * inv_freq[pair], &sn, &cs);
        const float ra = xa * cs - xb * sn, rb = xa * sn + xb * cs;
        xa = ra; xb = rb;
    }
    if (is_q) {
        q_out[(size_t)head * hd + a] = xa;
        q_out[(size_t)head * hd + b] = xb;
    } else if (write_kv) {
        const size_t off = ((size_t)kvh * max_ctx + pos % max_ctx) * hd;
        kc[off + a] = f2h(xa);
        kc[off + b] = f2h(xb);
        const float* v = qkv + (size_t)(n_heads + n_kv + kvh) * hd;
        vc[off + a] = f2h(v[a]);
        vc[off + b] = f2h(v[b]);
    }
}

extern "C" __global__ void rope_kv(const float* __restrict__ qkv, float* __restrict__ q_out, u16* __restrict__ kc,
                                   u16* __restrict__ vc, const int* __restrict__ pos_ptr, int n_heads, int n_kv,
                                   int hd, int rot_dims, const float* __restrict__ inv_freq, int neox,
                                   const float* __restrict__ q_norm, const float* __restrict__ k_norm, float eps,
                                   int max_ctx) {
    grid_dependency_wait();
    rope_kv_head(qkv, q_out, kc, vc, *pos_ptr, true, n_heads, n_kv, hd, rot_dims, inv_freq, neox, q_norm, k_norm, eps,
                 max_ctx);
}

// The batched decode step's RoPE: grid.y is the row of the batch. Row z's token is at
// position pos[z] of cache slot slot[z] (slots `slot_stride` halves apart in `kc`/`vc`); a
// padding row (pos < 0) rotates its Q at position 0 and writes nothing to any cache.
extern "C" __global__ void rope_kv_batch(const float* __restrict__ qkv, float* __restrict__ q_out,
                                         u16* __restrict__ kc, u16* __restrict__ vc, const int* __restrict__ pos,
                                         const int* __restrict__ slot, long long slot_stride, int n_heads, int n_kv,
                                         int hd, int rot_dims, const float* __restrict__ inv_freq, int neox,
                                         const float* __restrict__ q_norm, const float* __restrict__ k_norm, float eps,
                                         int max_ctx) {
    grid_dependency_wait();
    const int z = blockIdx.y;
    const int p = pos[z];
    const size_t cache = p < 0 ? 0 : (size_t)slot[z] * (size_t)slot_stride;
    rope_kv_head(qkv + (size_t)z * (n_heads + 2 * n_kv) * hd, q_out + (size_t)z * n_heads * hd, kc + cache, vc + cache,
                 p < 0 ? 0 : p, p >= 0, n_heads, n_kv, hd, rot_dims, inv_freq, neox, q_norm, k_norm, eps, max_ctx);
}
