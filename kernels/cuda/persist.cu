// The decode step as one persistent kernel: a program of instructions (one per launch the
// step would otherwise make: embedding, GEMVs, RoPE + KV write, attention, LM head) run by
// a grid that stays resident for the whole step, with a grid-wide barrier where an
// instruction needs the previous one's output. The instructions run the very device
// functions the separate launches do (gemv.cu, attention.cu, rope.cu), on virtual blocks:
// instruction i's block b is run by physical block b mod gridDim.x, so an instruction may
// have more or fewer blocks than the grid.
//
// The idea (issue 13): a decode step of a small model is ~100-200 dependent launches of a
// few µs each, where the work itself (weights at the HBM roofline) is a fraction of that;
// a barrier was to cost less than a kernel boundary, and a block that reaches it early asks
// L2 for the next instruction's first weights (gemv_prefetch) before waiting, so their
// latency overlaps the slowest block of the current instruction.
//
// Measured on an H200 (docs/log/2026-11-to-12.md, twelfth session) it is slower than the graph of
// launches with programmatic dependent launch: 1,053 against 1,349 tok/s on SmolLM2's shape,
// 1,123 against 1,494 on Llama-3.2-1B's, 326 against 447 on Llama-3-8B's. A grid barrier
// costs 1.3-1.6 µs, about what each instruction loses: with PDL a kernel boundary costs
// less than that, and the rest of an instruction's time (its dependent chain of L2 and HBM
// round trips) is the same either way. So the executor keeps the graph by default; this
// path is its parity-checked alternative (GpuExecutor::set_persistent_decode) and the base
// for a step whose instructions wait on finer dependencies than the whole grid.
//
// This module is common.cuh, gemv.cu, attention.cu, rope.cu and this file, followed by a
// generated suffix (the Rust `persist` module): `#define P_NW` (warps a block) and
// `#define P_CASES` (one `case` per distinct operation of the model's program, each a P_*
// macro below), then `PERSIST_KERNEL`.

// One instruction: which operation (a case of P_CASES), its virtual blocks, the second grid
// dimension the operation's blocks index (attention: splits a head), whether it must wait
// for everything before it, and the arguments of the launch it replaces, in that kernel's
// parameter order (pointers as they are, ints and floats in the low 32 bits). 16 + 192
// bytes: thirteen 16-byte loads.
struct PInstr {
    u32 op;
    u32 blocks;
    u32 grid_y;
    u32 wait;
    u64 a[24];
};

// Every block of the grid arrives before any leaves, and every write before the barrier is
// visible to every read after it (release on arrival, acquire on the wait). `count` only
// grows: a launch's k-th barrier completes when it reaches its next multiple of the grid,
// so nothing is ever reset (each program has its own counter, zeroed at creation). A
// barrier costs 1.3-1.6 µs on an H200 (400-800 blocks; docs/log/2026-11-to-12.md); a tree of
// group counters measured the same.
static __device__ __forceinline__ void grid_barrier(u64* count) {
    __syncthreads();
    if (threadIdx.x == 0) {
        u64 old, now;
        asm volatile("atom.add.acq_rel.gpu.global.u64 %0, [%1], 1;" : "=l"(old) : "l"(count) : "memory");
        const u64 target = (old / gridDim.x + 1) * gridDim.x;
        do {
            asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(now) : "l"(count) : "memory");
        } while (now < target);
    }
    __syncthreads();
}

// Copies instruction `src` into shared memory (threads 0..12, one 16-byte load each; the
// program is never written during a launch, so the read-only path is safe).
static __device__ __forceinline__ void stage_instr(PInstr* dst, const PInstr* src) {
    if (threadIdx.x < sizeof(PInstr) / 16) ((uint4*)dst)[threadIdx.x] = __ldg((const uint4*)src + threadIdx.x);
}

#define P_INT(i) ((int)(u32)a[i])
#define P_F32(i) __uint_as_float((u32)a[i])

// GEMV_PARAMS' order (gemv.cu). Prefetch is the part before the wait.
#define P_GEMV(T, A, R, S, SWIGLU, QOUT)                                                                               \
    {                                                                                                                  \
        const W w = {(const u8*)a[0], (const u32*)a[1], (const u8*)a[2]};                                              \
        const W w2 = {(const u8*)a[3], (const u32*)a[4], (const u8*)a[5]};                                             \
        const int nrows = P_INT(15), K = P_INT(16);                                                                    \
        if (prefetch) {                                                                                                \
            gemv_prefetch<T, R, S, P_NW, SWIGLU>(w, w2, nrows, K, vb);                                                 \
        } else {                                                                                                       \
            const XIn in = {(const float*)a[6], (const i8*)a[7], (const i8*)a[8], (const float2*)a[9],                 \
                            (const float*)a[10], P_F32(11)};                                                           \
            const GemvOut out = {(const float*)a[12], (const float*)a[13], (float*)a[14], (const float*)a[17],         \
                                 (i8*)a[18], (i8*)a[19], (float2*)a[20], (float*)a[21], P_INT(22), P_F32(23)};         \
            gemv_compute<T, A, R, S, P_NW, SWIGLU, QOUT>(w, w2, in, out, nrows, K, vb);                                \
        }                                                                                                              \
    }

// EMBED_ENTRY's order (gemv.cu).
#define P_EMBED(T)                                                                                                     \
    if (!prefetch) {                                                                                                   \
        const W w = {(const u8*)a[0], (const u32*)a[1], (const u8*)a[2]};                                              \
        const GemvOut out = {nullptr,     nullptr,     (float*)a[4],  (const float*)a[7], (i8*)a[8],                   \
                             (i8*)a[9], (float2*)a[10], (float*)a[11], 0, 1.0f};                                        \
        embed<T>(w, (const int*)a[3], out, P_INT(5), P_INT(6), P_F32(12), vb);                                         \
    }

// ROPE_KV_ENTRY's order (rope.cu).
#define P_ROPE(Q8)                                                                                                     \
    if (!prefetch)                                                                                                     \
        rope_kv_head<Q8>((const float*)a[0], (float*)a[1], (void*)a[2], (void*)a[3], (u16*)a[4], (u16*)a[5],           \
                         *(const int*)a[6], true, P_INT(7), P_INT(8), P_INT(9), P_INT(10), (const float*)a[11],        \
                         P_INT(12), (const float*)a[13], (const float*)a[14], P_F32(15), P_INT(16),                    \
                         (const int*)a[17], vb);

// ATTN_KERNEL's order (attention.cu); virtual block vb is head vb mod n_heads of split
// vb / n_heads. KK and VV build the cache's planes from kc, vc, kd, vd (KV_F16_K() ...).
#define P_ATTN(E, GM, KV, KK, VV)                                                                                      \
    if (!prefetch) {                                                                                                   \
        const u16 *kc = (const u16*)a[1], *vc = (const u16*)a[2], *kd = (const u16*)a[3], *vd = (const u16*)a[4];      \
        const int n_heads = P_INT(7);                                                                                  \
        attn_partial_impl<E, GM, KV, P_NW>((const float*)a[0], KK(), VV(), (const int*)a[5], (const int*)a[6],         \
                                           n_heads, P_INT(8), P_INT(9), P_INT(10), P_F32(11), P_INT(12),               \
                                           (float*)a[13], (float2*)a[14], (u32*)a[15], (float*)a[16], (i8*)a[17],      \
                                           (i8*)a[18], (float2*)a[19], vb % n_heads, vb / n_heads, (int)ins->grid_y);  \
    }

// decode_persistent: runs instructions 0..n of `prog`. Blocks of P_NW warps, as many as
// can be resident at once (a cooperative launch); `count` is the program's barrier counter.
// persist_op runs virtual block vb of instruction `ins`: its
// prefetch (before the barrier) or its work. Both are made after the generated P_NW and
// P_CASES. Instruction i + 1 is staged into shared memory while instruction i runs.
#define PERSIST_KERNEL                                                                                                 \
    static __device__ __forceinline__ void persist_op(const PInstr* ins, int vb, bool prefetch) {                     \
        const u64* a = ins->a;                                                                                         \
        switch (ins->op) { P_CASES }                                                                                   \
    }                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(P_NW * 32)                                                            \
        decode_persistent(const PInstr* prog, int n, u64* count) {                                                     \
        grid_dependency_wait(); /* a no-op unless launched as a dependent launch */                                   \
        __shared__ PInstr staged[2];                                                                                   \
        stage_instr(&staged[0], prog);                                                                                 \
        __syncthreads();                                                                                               \
        for (int i = 0; i < n; ++i) {                                                                                  \
            const PInstr* ins = &staged[i & 1];                                                                        \
            if (i + 1 < n) stage_instr(&staged[(i + 1) & 1], prog + i + 1);                                            \
            const u32 blocks = ins->blocks;                                                                            \
            if (i > 0 && ins->wait) {                                                                                  \
                if (blockIdx.x < blocks) persist_op(ins, blockIdx.x, true);                                            \
                grid_barrier(count);                                                                                   \
            }                                                                                                          \
            for (u32 vb = blockIdx.x; vb < blocks; vb += gridDim.x) {                                                  \
                /* this block's next virtual block's first weights, while this one runs */                             \
                if (vb + gridDim.x < blocks) persist_op(ins, vb + gridDim.x, true);                                    \
                persist_op(ins, vb, false);                                                                            \
                __syncthreads(); /* the block's shared memory is the next virtual block's */                          \
            }                                                                                                          \
            __syncthreads(); /* the next instruction is staged; this one's slot is free */                            \
        }                                                                                                              \
    }
