// Decode attention for one new query per head over the f16 KV cache, split over the
// context (flash-decoding): each (head, split) block takes a run of positions and writes an
// unnormalised partial result with its running max and sum; the last block of a head to
// finish (counted in `counters`, which it leaves at zero) merges the head's splits, so the
// whole attention is one launch. The context length is read from device memory and the
// split length follows it (short splits while the context is short, so that many blocks
// keep the GPU busy; longer ones as it grows; the rule is in attn_partial_impl), so a grid
// of a bounded number of splits serves every length up to the cache's. Blocks past the
// end return at once; since scheduling them is not free, the executor launches a grid
// only as wide as the lengths its graph serves need (Kernels::attention_grid_splits).
//
// Grouped-query attention: query head h reads KV head h / (n_heads / n_kv). The `pairs`
// kernel computes the heads of a group in pairs (GM = 2): one block scores each K row
// against both queries and adds each V row into both sums, reading the cache once for the
// two. It wins on long contexts only (the executor switches to it from 16,384 positions):
// below, the launch is one block's latency, which a second head lengthens. Measured on an
// H200 (llama3.2-1b, groups of 4; docs/log/2026-11-to-12.md): pairs lose 5% at 8,192 positions,
// win 4% at 16,384 and 14% at 32,768; groups of 4 a block lose at every length. The
// batched step's grid holds a block per row as well, so there pairs pay from 16 rows at any
// context (the executor's batch_shape).
//
// Sliding-window layers (`window` > 0) attend to the last `window` positions only, and
// their cache is a ring of `max_ctx` rows per KV head (position p in row p % max_ctx). The
// other layers are paged (common.cuh, kv_row): `max_ctx` is the pool's rows a head, and the
// sequence's block table maps each 32 positions to a block of 32 rows. A warp's 32
// positions start at a multiple of 32 there (splits are multiples of 32 from 0), so they lie
// in one block: one table entry a chunk, loaded a chunk ahead.
// A warp takes 32 positions at a time: lane l scores position p0 + l with a whole-row dot
// product (16-byte K loads, q broadcast from shared memory), the warp updates its running
// softmax once per 32 positions, then accumulates the 32 V rows with lane l owning
// elements [l·E, l·E + E) — independent loads throughout, instead of one dependent
// reduction per position.

// The positions a split block of a decode attention takes over a span of `span`: at least
// `split`, aiming at 16 splits a head up to 256 positions each (4,096 of context; a split of
// 128+ keeps all four warps busy), at most the grid's `nsplit`: split 64 at 1,024 positions,
// 256 from 4,096 to 32,768, then longer. The points measured best on an H200
// (docs/architecture.md). Kernels::attention_split_len mirrors this rule: the executor sizes
// each graph's grid from it, so the two must change together.
static __device__ __forceinline__ int attn_split_len(int span, int split, int nsplit) {
    const int even = min(256, ((span + 15) / 16 + 31) / 32 * 32);
    const int most = ((span + nsplit - 1) / nsplit + 31) / 32 * 32;
    return max(split, max(even, most));
}

// After a split block has written its heads' partials (part_o, part_ml at split s): counts
// the block in `counter` (left at zero by the last), and the last of the `n` split blocks of
// heads h0 .. h0 + nh merges every split of them into `out` (and its quantised or packed
// forms when given). With `sinks` (gpt-oss), head h's softmax also holds the logit
// sinks[h], which attends to nothing: e^(sink − max) joins the denominator only. Every
// thread of the block calls it.
static __device__ __forceinline__ void attn_merge_splits(const float* __restrict__ part_o,
                                                         const float2* __restrict__ part_ml, u32* __restrict__ counter,
                                                         float* __restrict__ out, i8* __restrict__ oq,
                                                         i8* __restrict__ olo, float2* __restrict__ ods,
                                                         const ActPack& pack, int h0, int nh, int hd, int nsplit,
                                                         int n, int row_chunks, const float* __restrict__ sinks) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    // Publish this split, then count it; the last split of the block's heads merges them.
    __threadfence();
    __syncthreads();
    __shared__ int is_last;
    if (threadIdx.x == 0) {
        const u32 done = atomicAdd(counter, 1u) + 1;
        is_last = done == (u32)n;
        if (is_last) *counter = 0;
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    // Other blocks' partials: read through L2 (ld.cg), never a stale L1 line, and many at
    // a time: the merge is the launch's serial tail, so it must not wait on one load per
    // split. A warp takes 32 consecutive values of one head (hd is a multiple of 32),
    // which is also a quantisation block of the output.
    for (int i0 = warp * 32; i0 < nh * hd; i0 += nwarps * 32) {
        const int head = h0 + i0 / hd, d = i0 % hd + lane;
        const float* po = part_o + (size_t)head * nsplit * hd + d;
        const float2* pml = part_ml + (size_t)head * nsplit;
        float Mh = -INFINITY;
#pragma unroll 8
        for (int j = 0; j < n; ++j) Mh = fmaxf(Mh, __ldcg(&pml[j].x));
        float o = 0.0f, L = 0.0f;
#pragma unroll 8
        for (int j = 0; j < n; ++j) {
            const float2 ml = __ldcg(&pml[j]);
            const float wj = ml.x == -INFINITY ? 0.0f : expf(ml.x - Mh);
            L += ml.y * wj;
            o += __ldcg(&po[(size_t)j * hd]) * wj;
        }
        if (sinks) L += expf(sinks[head] - Mh);
        const float v = o / L;
        const size_t i = (size_t)head * hd + d;
        out[i] = v;
        if (oq) quantize_block_warp(v, oq, olo, ods, i, i / 32);
        if (pack.x) pack_chunk_warp(v, lane, pack.row, pack.rows, row_chunks, (int)(i / 32), pack.x, pack.s, pack.h);
    }
}

// KV is the cache's format (KvF16 or KvQ8, common.cuh). The block is query head `bx`'s
// (`bx` the first of a pair with GM = 2), split `s` of `nsplit`: blockIdx.x, blockIdx.y and
// gridDim.y of the launch. Blocks have at most NWMAX warps.
template <int E, int GM, class KV, int NWMAX = 4>
static __device__ __forceinline__ void attn_partial_impl(const float* __restrict__ q, const KV kc, const KV vc,
                                                         const int* __restrict__ len_ptr, const int* __restrict__ table,
                                                         int n_heads, int n_kv, int max_ctx, int split, float scale,
                                                         int window, float* __restrict__ part_o, float2* __restrict__ part_ml,
                                                         u32* __restrict__ counters, float* __restrict__ out,
                                                         i8* __restrict__ oq, i8* __restrict__ olo,
                                                         float2* __restrict__ ods, int bx, int s, int nsplit,
                                                         const float* __restrict__ sinks,
                                                         const ActPack pack = ActPack{}) {
    const int hd = E * 32;
    const int len = *len_ptr;
    const int lo = window > 0 ? max(0, len - window) : 0;
    const int span = len - lo;
    // Block x is query head x's. With GM = 2 the first block of each pair of heads of a KV
    // group computes both (the other returns), reading each K/V row once for the two.
    const int group = n_heads / n_kv, kvh = bx / group, gi = bx % group;
    if (gi % GM != 0) return;
    const int h0 = bx, nh = min(GM, group - gi);
    split = attn_split_len(span, split, nsplit);
    const int start = lo + s * split;
    if (start >= len) return;
    const int end = min(len, start + split);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    // The block's queries, pre-scaled: head j's at qs[j · hd / 4].
    __shared__ float4 qs[GM * E * 8];
    for (int i = threadIdx.x; i < nh * hd; i += blockDim.x) ((float*)qs)[i] = q[(size_t)h0 * hd + i] * scale;
    __syncthreads();
    float acc[GM][E], m[GM], l[GM];
#pragma unroll
    for (int j = 0; j < GM; ++j) {
        m[j] = -INFINITY;
        l[j] = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[j][e] = 0.0f;
    }
    const KV kbase = kc.at((size_t)kvh * max_ctx * hd);
    const KV vbase = vc.at((size_t)kvh * max_ctx * hd);
    // Position q of the current chunk is in row q + shift (paged), or q % max_ctx (a ring).
    const int step = nwarps * 32;
    int next_block = table && start + warp * 32 < end ? table[(start + warp * 32) >> 5] : 0;
    for (int p0 = start + warp * 32; p0 < end; p0 += step) {
        const int p = p0 + lane;
        const int shift = next_block * 32 - p0;
        if (table && p0 + step < end) next_block = table[(p0 + step) >> 5];
        const auto row_of = [&](int pos) { return table ? pos + shift : pos % max_ctx; };
        // Each K row is read once and scored against every query head of the block.
        float score[GM];
#pragma unroll
        for (int j = 0; j < GM; ++j) score[j] = p < end ? 0.0f : -INFINITY;
        if (p < end) {
            const size_t krow = (size_t)row_of(p) * hd;
#pragma unroll
            for (int i = 0; i < E * 4; ++i) {
                float k[8];
                kbase.load8(krow + i * 8, k);
#pragma unroll
                for (int j = 0; j < GM; ++j) {
                    if (j < nh) {
                        const float4 a = qs[j * E * 8 + 2 * i], b = qs[j * E * 8 + 2 * i + 1];
                        score[j] += a.x * k[0] + a.y * k[1] + a.z * k[2] + a.w * k[3] + b.x * k[4] + b.y * k[5] +
                                    b.z * k[6] + b.w * k[7];
                    }
                }
            }
        }
        float pw[GM];
#pragma unroll
        for (int j = 0; j < GM; ++j) {
            pw[j] = 0.0f;
            if (j < nh) {
                const float m_new = fmaxf(m[j], warp_max(score[j]));
                const float corr = expf(m[j] - m_new);
                pw[j] = p < end ? expf(score[j] - m_new) : 0.0f;
                l[j] = l[j] * corr + warp_sum(pw[j]);
#pragma unroll
                for (int e = 0; e < E; ++e) acc[j][e] *= corr;
                m[j] = m_new;
            }
        }
        // V rows in batches of VB positions, every load of a batch issued before the
        // first is used: the loop is bound by memory latency, not bandwidth, so what
        // matters is how many loads are in flight. Positions past the end weigh 0 and
        // read the last valid row (in bounds).
        constexpr int VB = E <= 4 ? 16 : 8;
#pragma unroll
        for (int jb = 0; jb < 32; jb += VB) {
            if (p0 + jb >= end) break;
            float v[VB][E];
#pragma unroll
            for (int i = 0; i < VB; ++i)
                vbase.template load<E>((size_t)row_of(min(p0 + jb + i, end - 1)) * hd + lane * E, v[i]);
#pragma unroll
            for (int i = 0; i < VB; ++i) {
#pragma unroll
                for (int j = 0; j < GM; ++j) {
                    if (j < nh) {
                        const float wi = __shfl_sync(FULL_MASK, pw[j], jb + i);
#pragma unroll
                        for (int e = 0; e < E; ++e) acc[j][e] += wi * v[i][e];
                    }
                }
            }
        }
    }
    // Merge the warps of this block, one head at a time.
    __shared__ float sm_m[NWMAX], sm_l[NWMAX];
    __shared__ float sm_o[NWMAX * E * 32];
    // (Every index into the per-head arrays is a compile-time constant, so they stay in
    // registers: a loop the compiler could not unroll would put them in local memory.)
#pragma unroll
    for (int j = 0; j < GM; ++j) {
        if (j < nh) {  // uniform over the block: the barriers inside are safe
            const int head = h0 + j;
            if (j > 0) __syncthreads();  // the previous head's readers are done
            if (lane == 0) { sm_m[warp] = m[j]; sm_l[warp] = l[j]; }
#pragma unroll
            for (int e = 0; e < E; ++e) sm_o[warp * hd + lane * E + e] = acc[j][e];
            __syncthreads();
            float M = -INFINITY;
            for (int w = 0; w < nwarps; ++w) M = fmaxf(M, sm_m[w]);
            for (int d = threadIdx.x; d < hd; d += blockDim.x) {
                float o = 0.0f;
                for (int w = 0; w < nwarps; ++w)
                    if (sm_m[w] != -INFINITY) o += sm_o[w * hd + d] * expf(sm_m[w] - M);
                part_o[((size_t)head * nsplit + s) * hd + d] = o;
            }
            if (threadIdx.x == 0) {
                float L = 0.0f;
                for (int w = 0; w < nwarps; ++w)
                    if (sm_m[w] != -INFINITY) L += sm_l[w] * expf(sm_m[w] - M);
                part_ml[(size_t)head * nsplit + s] = make_float2(M, L);
            }
        }
    }
    attn_merge_splits(part_o, part_ml, &counters[bx], out, oq, olo, ods, pack, h0, nh, hd, nsplit,
                      min(nsplit, (len - lo + split - 1) / split), n_heads * E, sinks);
}

// One decode-attention entry point: `NAME` computes GM query heads a block over a cache of
// format KV, whose two planes KK and VV build from the parameters (kd, vd: q8_0's scales,
// unused by the f16 entries, which take the same parameter list). KK and VV are
// function-like macros, so that their names pass through ATTN_ONE_AND_PAIRS unexpanded
// (the q8_0 ones hold a comma).
#define KV_F16_K() KvF16{kc}
#define KV_F16_V() KvF16{vc}
#define KV_Q8_K() KvQ8{(const i8*)kc, kd}
#define KV_Q8_V() KvQ8{(const i8*)vc, vd}
#define ATTN_KERNEL(NAME, E, GM, KV, KK, VV)                                                                           \
    extern "C" __global__ void __launch_bounds__(128) NAME(                                                            \
        const float* q, const u16* kc, const u16* vc, const u16* kd, const u16* vd, const int* len_ptr,                \
        const int* table, int n_heads, int n_kv, int max_ctx, int split, float scale, int window, float* part_o,       \
        float2* part_ml, u32* counters, float* out, i8* oq, i8* olo, float2* ods, const float* sinks) {                \
        grid_dependency_wait();                                                                                        \
        attn_partial_impl<E, GM, KV>(q, KK(), VV(), len_ptr, table, n_heads, n_kv, max_ctx, split, scale, window,     \
                                     part_o, part_ml, counters, out, oq, olo, ods, blockIdx.x, blockIdx.y, gridDim.y,  \
                                     sinks);                                                                           \
    }

// Both forms of an entry point: ONE (one query head a block) and PAIRS (two heads of a GQA
// group a block, reading each K/V row once for both), made by KERNEL (ATTN_KERNEL or
// ATTN_BATCH_KERNEL).
#define ATTN_ONE_AND_PAIRS(KERNEL, ONE, PAIRS, E, KV, KK, VV) KERNEL(ONE, E, 1, KV, KK, VV) KERNEL(PAIRS, E, 2, KV, KK, VV)

// attn_decode_{E} and attn_decode_pairs_{E} over an f16 cache; attn_decode_q8_{E} and
// attn_decode_pairs_q8_{E} over a q8_0 one (the format's suffix, `KvFormat::kernel_suffix`,
// before the head size, as in every KV kernel's name).
#define ATTN_ENTRY(E) ATTN_ONE_AND_PAIRS(ATTN_KERNEL, attn_decode_##E, attn_decode_pairs_##E, E, KvF16, KV_F16_K, KV_F16_V)
#define ATTN_Q8_ENTRY(E) \
    ATTN_ONE_AND_PAIRS(ATTN_KERNEL, attn_decode_q8_##E, attn_decode_pairs_q8_##E, E, KvQ8, KV_Q8_K, KV_Q8_V)

// The batched decode step's attention: grid.z is the row of the batch. Row z attends over
// positions 0..len[z] of sequence slot slot[z]: in a paged layer through the slot's block
// table (`table_stride` entries a slot; slot_stride 0), in a sliding-window layer in the
// slot's ring (slots `slot_stride` values apart; table null). Its partials, counters and
// output are row z's own. A padding row (len 0) writes zeros.
#define ATTN_BATCH_KERNEL(NAME, E, GM, KV, KK, VV)                                                                     \
    extern "C" __global__ void __launch_bounds__(128) NAME(                                                            \
        const float* q, const u16* kc, const u16* vc, const u16* kd, const u16* vd, const int* lens, const int* slot,  \
        long long slot_stride, const int* table, int table_stride, int n_heads, int n_kv, int max_ctx, int split,      \
        float scale, int window, float* part_o, float2* part_ml, u32* counters, float* out, uint4* px, float2* ps,     \
        u16* ph, int pack_rows, const float* sinks) {                                                                  \
        grid_dependency_wait();                                                                                        \
        const int z = blockIdx.z, hd = 32 * E, nsplit = gridDim.y;                                                     \
        const size_t qd = (size_t)n_heads * hd;                                                                        \
        if (lens[z] <= 0) {                                                                                            \
            if (blockIdx.y == 0)                                                                                       \
                for (int d = threadIdx.x; d < hd; d += blockDim.x) out[z * qd + (size_t)blockIdx.x * hd + d] = 0.0f;   \
            if (blockIdx.y == 0 && px)                                                                                 \
                for (int c = threadIdx.x >> 5; c < E; c += blockDim.x >> 5)                                            \
                    pack_chunk_warp(0.0f, threadIdx.x & 31, z, pack_rows, (int)(qd / 32), blockIdx.x * E + c, px, ps,   \
                                    ph);                                                                               \
            return;                                                                                                    \
        }                                                                                                              \
        const size_t cache = (size_t)slot[z] * (size_t)slot_stride;                                                    \
        const KV k_all = KK(), v_all = VV();                                                                           \
        const int* tab = table ? table + (size_t)slot[z] * table_stride : nullptr;                                     \
        attn_partial_impl<E, GM, KV>(q + z * qd, k_all.at(cache), v_all.at(cache), lens + z, tab, n_heads, n_kv,       \
                                    max_ctx, split, scale, window, part_o + z * qd * nsplit,                           \
                                    part_ml + (size_t)z * n_heads * nsplit, counters + z * n_heads, out + z * qd,      \
                                    nullptr, nullptr, nullptr, blockIdx.x, blockIdx.y, nsplit, sinks,                  \
                                    ActPack{px, ps, ph, z, pack_rows});                                                \
    }
// The batched step's decode attention on tensor cores, a GQA group a block: block (KV head,
// split s, row z). The group's G = n_heads / n_kv queries (G ≤ 16) are the rows of
// m16n8k16 tiles, so each K/V row is read once for all of them, and the scores and the
// weighted values are mma (f16 in, f32 accumulate; P rounded to f16) by the prefill's flash
// attention steps (flash_softmax, flash_pv: common.cuh). The split's positions go in tiles
// of 16 to the block's 4 warps in turn; each warp copies its tiles' K and V rows into its
// own shared memory (cp.async, two tiles deep, no block barrier) and keeps an online
// softmax (base 2) for its rows; the warps merge in shared memory at the end, and the
// splits as attn_partial_impl's do (attn_merge_splits, counted at the group's first head).
// Positions past the split's end are zero rows weighing 0. Dynamic shared memory:
// ATTN_GROUP_SMEM(E) bytes.
#define ATTN_GROUP_TILE 16
#define ATTN_GROUP_SMEM(E) (4 * 4 * ATTN_GROUP_TILE * (32 * (E) + 8) * 2)
template <int E>
static __device__ __forceinline__ void attn_group_mma(const float* __restrict__ q, const u16* __restrict__ kc,
                                                      const u16* __restrict__ vc, int len, const int* __restrict__ table,
                                                      int n_heads, int n_kv, int max_ctx, int split, float scale,
                                                      int window, float* __restrict__ part_o,
                                                      float2* __restrict__ part_ml, u32* __restrict__ counters,
                                                      float* __restrict__ out, i8* __restrict__ oq,
                                                      i8* __restrict__ olo, float2* __restrict__ ods,
                                                      const ActPack& pack, int kvh, int s, int nsplit,
                                                      const float* __restrict__ sinks) {
    constexpr int HD = 32 * E, LD = HD + 8, KSTEPS = HD / 16, ON = HD / 8, CHUNKS = HD / 8, TILE = ATTN_GROUP_TILE;
    extern __shared__ __align__(16) u8 attn_smem[];
    const int lo = window > 0 ? max(0, len - window) : 0;
    const int span = len - lo;
    split = attn_split_len(span, split, nsplit);
    const int start = lo + s * split;
    if (start >= len) return;
    const int end = min(len, start + split);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int g = lane >> 2, t4 = lane & 3, mi = lane >> 3, r8 = lane & 7;
    const int group = n_heads / n_kv, h0 = kvh * group;
    const float qscale = scale * 1.4426950408889634f;  // exp(x) = exp2(x · log2 e)

    // The queries' A fragments: rows g and g + 8 of the tile are queries h0 + g, h0 + g + 8
    // (zero past the group), k the head's dimensions.
    u32 qa[KSTEPS][4];
#pragma unroll
    for (int k = 0; k < KSTEPS; ++k) {
#pragma unroll
        for (int h = 0; h < 4; ++h) {
            const int r = g + (h & 1) * 8, c = k * 16 + 2 * t4 + (h >> 1) * 8;
            float x = 0.0f, y = 0.0f;
            if (r < group) {
                const float* src = q + (size_t)(h0 + r) * HD + c;
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

    // This warp's tiles: K in buffers 0 and 1, V in 2 and 3, TILE rows of LD each.
    u16* const tiles = (u16*)attn_smem + (size_t)warp * 4 * TILE * LD;
    const u16* K = kc + (size_t)kvh * max_ctx * HD;
    const u16* V = vc + (size_t)kvh * max_ctx * HD;
    auto load_tile = [&](int p0, int buf) {
        u16* kd0 = tiles + buf * TILE * LD;
        u16* vd0 = tiles + (2 + buf) * TILE * LD;
#pragma unroll
        for (int c = lane; c < TILE * CHUNKS; c += 32) {
            const int r = c / CHUNKS, ch = c % CHUNKS, p = p0 + r;
            u16* kd = kd0 + r * LD + ch * 8;
            u16* vd = vd0 + r * LD + ch * 8;
            if (p < end) {
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

    const int stride = nwarps * TILE;
    int buf = 0;
    if (start + warp * TILE < end) load_tile(start + warp * TILE, 0);
    for (int p0 = start + warp * TILE; p0 < end; p0 += stride, buf ^= 1) {
        if (p0 + stride < end) {
            load_tile(p0 + stride, buf ^ 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncwarp();  // every lane's copies of this tile are visible to the warp
        // S = Q·Kᵀ over the tile's 16 keys: two n-blocks of 8.
        float sc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
        const u16* kt = tiles + buf * TILE * LD;
#pragma unroll
        for (int k = 0; k < KSTEPS; ++k) {
            // Matrices: keys 0.. at dims k·16 and k·16 + 8, then keys 8.. likewise.
            u32 b0, b1, b2, b3;
            ldsm_x4(kt + ((mi >> 1) * 8 + r8) * LD + k * 16 + (mi & 1) * 8, b0, b1, b2, b3);
            mma_f16(sc[0], qa[k], b0, b1);
            mma_f16(sc[1], qa[k], b2, b3);
        }
        // Keys past the end weigh nothing.
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (p0 + n * 8 + 2 * t4 + (e & 1) >= end) sc[n][e] = -INFINITY;
        flash_softmax(sc, m, l, o);
        flash_pv<2, ON, LD>(sc, tiles + (2 + buf) * TILE * LD, o);
        __syncwarp();  // this buffer takes the tile after next
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(FULL_MASK, l[h], 1);
        l[h] += __shfl_xor_sync(FULL_MASK, l[h], 2);
    }

    // The warps' results merge in the tile memory: [warp][16 rows][HD] outputs, then each
    // warp's row maxima (base 2; -inf for a warp that had no tile) and sums.
    __syncthreads();
    float* so = (float*)attn_smem;
    float* sm = so + (size_t)nwarps * 16 * HD;
    float* sl = sm + nwarps * 16;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = g + 8 * h;
        float* dst = so + ((size_t)warp * 16 + row) * HD + 2 * t4;
#pragma unroll
        for (int n = 0; n < ON; ++n) *(float2*)(dst + n * 8) = make_float2(o[n][2 * h], o[n][2 * h + 1]);
        if (t4 == 0) {
            sm[warp * 16 + row] = m[h];
            sl[warp * 16 + row] = l[h];
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < group * HD; i += blockDim.x) {
        const int row = i / HD, d = i % HD, head = h0 + row;
        float M = -INFINITY;
        for (int w = 0; w < nwarps; ++w) M = fmaxf(M, sm[w * 16 + row]);
        float acc = 0.0f, L = 0.0f;
        for (int w = 0; w < nwarps; ++w) {
            const float mw = sm[w * 16 + row];
            if (mw == -INFINITY) continue;
            const float wgt = exp2f(mw - M);
            acc += so[((size_t)w * 16 + row) * HD + d] * wgt;
            L += sl[w * 16 + row] * wgt;
        }
        part_o[((size_t)head * nsplit + s) * HD + d] = acc;
        // The split merge works in natural units: e^(M ln 2) = 2^M.
        if (d == 0) part_ml[(size_t)head * nsplit + s] = make_float2(M * 0.6931471805599453f, L);
    }
    attn_merge_splits(part_o, part_ml, &counters[h0], out, oq, olo, ods, pack, h0, group, HD, nsplit,
                      min(nsplit, (span + split - 1) / split), n_heads * E, sinks);
}

// attn_decode_batch_group_{E}: the kernel above for head sizes 32·E up to 128 (E ≤ 4; its
// accumulators grow with the head), over an f16 cache, with the batched kernels' parameters
// (ATTN_BATCH_KERNEL). Grid (n_kv, splits, rows). attn_decode_group_{E}: the same for the
// one-sequence step, with attn_decode_{E}'s parameters (the output also quantised for the O
// GEMV when oq is set). Grid (n_kv, splits).
#define ATTN_GROUP_KERNEL(E)                                                                                           \
    extern "C" __global__ void __launch_bounds__(128) attn_decode_batch_group_##E(                                     \
        const float* q, const u16* kc, const u16* vc, const u16* kd, const u16* vd, const int* lens, const int* slot,  \
        long long slot_stride, const int* table, int table_stride, int n_heads, int n_kv, int max_ctx, int split,      \
        float scale, int window, float* part_o, float2* part_ml, u32* counters, float* out, uint4* px, float2* ps,     \
        u16* ph, int pack_rows, const float* sinks) {                                                                  \
        grid_dependency_wait();                                                                                        \
        const int z = blockIdx.z, hd = 32 * E, nsplit = gridDim.y, group = n_heads / n_kv;                            \
        const size_t qd = (size_t)n_heads * hd;                                                                        \
        if (lens[z] <= 0) {                                                                                            \
            if (blockIdx.y == 0) {                                                                                     \
                const size_t first = z * qd + (size_t)blockIdx.x * group * hd;                                         \
                for (int d = threadIdx.x; d < group * hd; d += blockDim.x) out[first + d] = 0.0f;                      \
                if (px)                                                                                                \
                    for (int c = threadIdx.x >> 5; c < group * E; c += blockDim.x >> 5)                                \
                        pack_chunk_warp(0.0f, threadIdx.x & 31, z, pack_rows, (int)(qd / 32),                          \
                                        blockIdx.x * group * E + c, px, ps, ph);                                       \
            }                                                                                                          \
            return;                                                                                                    \
        }                                                                                                              \
        const size_t cache = (size_t)slot[z] * (size_t)slot_stride;                                                    \
        const int* tab = table ? table + (size_t)slot[z] * table_stride : nullptr;                                     \
        attn_group_mma<E>(q + z * qd, kc + cache, vc + cache, lens[z], tab, n_heads, n_kv, max_ctx, split, scale,      \
                          window, part_o + z * qd * nsplit, part_ml + (size_t)z * n_heads * nsplit,                    \
                          counters + z * n_heads, out + z * qd, nullptr, nullptr, nullptr,                             \
                          ActPack{px, ps, ph, z, pack_rows}, blockIdx.x, blockIdx.y, nsplit, sinks);                   \
    }                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(128) attn_decode_group_##E(                                           \
        const float* q, const u16* kc, const u16* vc, const u16* kd, const u16* vd, const int* len_ptr,                \
        const int* table, int n_heads, int n_kv, int max_ctx, int split, float scale, int window, float* part_o,       \
        float2* part_ml, u32* counters, float* out, i8* oq, i8* olo, float2* ods, const float* sinks) {                \
        grid_dependency_wait();                                                                                        \
        attn_group_mma<E>(q, kc, vc, *len_ptr, table, n_heads, n_kv, max_ctx, split, scale, window, part_o, part_ml,   \
                          counters, out, oq, olo, ods, ActPack{}, blockIdx.x, blockIdx.y, gridDim.y, sinks);           \
    }
#define ATTN_GROUP_ENTRY_1 ATTN_GROUP_KERNEL(1)
#define ATTN_GROUP_ENTRY_2 ATTN_GROUP_KERNEL(2)
#define ATTN_GROUP_ENTRY_3 ATTN_GROUP_KERNEL(3)
#define ATTN_GROUP_ENTRY_4 ATTN_GROUP_KERNEL(4)
#define ATTN_GROUP_ENTRY_5
#define ATTN_GROUP_ENTRY_6
#define ATTN_GROUP_ENTRY_7
#define ATTN_GROUP_ENTRY_8

// attn_decode_batch{_pairs}{_q8}_{E}, and over an f16 cache attn_decode_batch_group_{E}.
#define ATTN_BATCH_ENTRY(E)                                                                                            \
    ATTN_ONE_AND_PAIRS(ATTN_BATCH_KERNEL, attn_decode_batch_##E, attn_decode_batch_pairs_##E, E, KvF16, KV_F16_K,      \
                       KV_F16_V)                                                                                       \
    ATTN_GROUP_ENTRY_##E
#define ATTN_Q8_BATCH_ENTRY(E)                                                                                         \
    ATTN_ONE_AND_PAIRS(ATTN_BATCH_KERNEL, attn_decode_batch_q8_##E, attn_decode_batch_pairs_q8_##E, E, KvQ8, KV_Q8_K,  \
                       KV_Q8_V)
