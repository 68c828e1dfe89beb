// Rotary position embedding on the fused QKV projection output, with the rotated K and the
// V row written straight into the KV cache (f16 or q8_0), and optional per-head RMSNorm of Q and K
// before the rotation (Qwen3's QK-norm).
//
// qkv: [n_heads * hd | n_kv * hd | n_kv * hd] f32. One block per head: blocks
// [0, n_heads) handle Q (written to q_out), [n_heads, n_heads + n_kv) handle K and V.
// Thread i owns rotary pair i (i < hd / 2); `inv_freq` holds the rot_dims / 2 inverse
// frequencies, computed on the host exactly as the CPU reference does (scaling and
// per-pair factors included). The position is read from device memory so a captured graph
// serves every step.
// Cache layout: [n_kv][max_ctx][hd], position p in row kv_row(table, p, max_ctx) (common.cuh:
// a paged layer's block table, or a sliding-window layer's ring of max_ctx rows).

// One head of one token: `pos` its position; K and V go to the cache only when `write_kv`.
// Uniform over the block: every thread reaches the cache write. `head` is the block's
// (blockIdx.x).
template <bool Q8>
static __device__ __forceinline__ void rope_kv_head(const float* __restrict__ qkv, float* __restrict__ q_out,
                                                    void* __restrict__ kc, void* __restrict__ vc, u16* __restrict__ kd,
                                                    u16* __restrict__ vd, int pos, bool write_kv, int n_heads,
                                                    int n_kv, int hd, int rot_dims, const float* __restrict__ inv_freq,
                                                    int neox, const float* __restrict__ q_norm,
                                                    const float* __restrict__ k_norm, float eps, int max_ctx,
                                                    const int* __restrict__ table, int head) {
    __shared__ float scratch[32];
    const bool is_q = head < n_heads;
    const int kvh = head - n_heads;
    const float* src = is_q ? qkv + (size_t)head * hd : qkv + (size_t)(n_heads + kvh) * hd;
    const int i = threadIdx.x;
    const int half = hd / 2;
    const bool mine = i < half;
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
    if (mine) { xa = src[a]; xb = src[b]; }
    const float* norm = is_q ? q_norm : k_norm;
    if (norm) {
        const float ss = block_sum(xa * xa + xb * xb, scratch);
        const float s = rsqrtf(ss / (float)hd + eps);
        if (mine) { xa = xa * s * norm[a]; xb = xb * s * norm[b]; }
    }
    // Thread i's pair is rotary pair i in both layouts (ggml's theta index).
    if (mine && 2 * i < rot_dims) {
        float sn, cs;
        sincosf((float)pos * inv_freq[i], &sn, &cs);
        const float ra = xa * cs - xb * sn, rb = xa * sn + xb * cs;
        xa = ra; xb = rb;
    }
    if (is_q) {
        if (mine) {
            q_out[(size_t)head * hd + a] = xa;
            q_out[(size_t)head * hd + b] = xb;
        }
    } else if (write_kv) {
        const size_t off = ((size_t)kvh * max_ctx + kv_row(table, pos, max_ctx)) * hd;
        const float* v = qkv + (size_t)(n_heads + n_kv + kvh) * hd;
        store_kv<Q8>(kc, vc, kd, vd, off, hd, mine, a, b, xa, xb, mine ? v[a] : 0.0f, mine ? v[b] : 0.0f);
    }
}

// rope_kv (f16 cache) and rope_kv_q8 (q8_0: kd, vd are its scale planes; the f16 entries
// take and ignore them).
#define ROPE_KV_ENTRY(NAME, Q8)                                                                                        \
    extern "C" __global__ void NAME(const float* __restrict__ qkv, float* __restrict__ q_out, void* kc, void* vc,      \
                                    u16* kd, u16* vd, const int* __restrict__ pos_ptr, int n_heads, int n_kv, int hd,  \
                                    int rot_dims, const float* __restrict__ inv_freq, int neox,                        \
                                    const float* __restrict__ q_norm, const float* __restrict__ k_norm, float eps,     \
                                    int max_ctx, const int* __restrict__ table) {                                      \
        grid_dependency_wait();                                                                                        \
        rope_kv_head<Q8>(qkv, q_out, kc, vc, kd, vd, *pos_ptr, true, n_heads, n_kv, hd, rot_dims, inv_freq, neox,      \
                         q_norm, k_norm, eps, max_ctx, table, blockIdx.x);                                             \
    }
ROPE_KV_ENTRY(rope_kv, false)
ROPE_KV_ENTRY(rope_kv_q8, true)

// The batched decode step's RoPE: grid.y is the row of the batch. Row z's token is at
// position pos[z] of sequence slot slot[z]: in a paged layer through that slot's block table
// (`table_stride` entries a slot; slot_stride 0), in a sliding-window layer in the slot's
// ring (slots `slot_stride` values apart, table null). A padding row (pos < 0) rotates its
// Q at position 0 and writes nothing to any cache.
#define ROPE_KV_BATCH_ENTRY(NAME, Q8)                                                                                  \
    extern "C" __global__ void NAME(const float* __restrict__ qkv, float* __restrict__ q_out, void* kc, void* vc,      \
                                    u16* kd, u16* vd, const int* __restrict__ pos, const int* __restrict__ slot,       \
                                    long long slot_stride, int n_heads, int n_kv, int hd, int rot_dims,                \
                                    const float* __restrict__ inv_freq, int neox, const float* __restrict__ q_norm,    \
                                    const float* __restrict__ k_norm, float eps, int max_ctx,                          \
                                    const int* __restrict__ table, int table_stride) {                                 \
        grid_dependency_wait();                                                                                        \
        const int z = blockIdx.y;                                                                                      \
        const int p = pos[z];                                                                                          \
        const size_t cache = p < 0 ? 0 : (size_t)slot[z] * (size_t)slot_stride;                                        \
        const int* tab = table && p >= 0 ? table + (size_t)slot[z] * table_stride : nullptr;                           \
        const size_t elem = Q8 ? 1 : 2;                                                                                \
        rope_kv_head<Q8>(qkv + (size_t)z * (n_heads + 2 * n_kv) * hd, q_out + (size_t)z * n_heads * hd,                \
                         (u8*)kc + cache * elem, (u8*)vc + cache * elem, kd ? kd + cache / 32 : kd,                    \
                         vd ? vd + cache / 32 : vd, p < 0 ? 0 : p, p >= 0, n_heads, n_kv, hd, rot_dims, inv_freq,      \
                         neox, q_norm, k_norm, eps, max_ctx, tab, blockIdx.x);                                         \
    }
ROPE_KV_BATCH_ENTRY(rope_kv_batch, false)
ROPE_KV_BATCH_ENTRY(rope_kv_batch_q8, true)
