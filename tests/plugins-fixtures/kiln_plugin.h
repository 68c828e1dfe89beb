/* kiln plugin ABI 1.4 in C: the same layout as kiln_core::plugin_abi (docs/plugins.md).
 * For plugins written without the Rust SDK. The tests compile their deliberately broken
 * plugins against it and check that every struct here has the size Rust gives it. */
#ifndef KILN_PLUGIN_H
#define KILN_PLUGIN_H

#include <stddef.h>
#include <stdint.h>

#define KILN_ABI_MAJOR 1
#define KILN_ABI_MINOR 4
#define KILN_ABI_VERSION ((uint32_t)KILN_ABI_MAJOR << 16 | KILN_ABI_MINOR)

typedef int32_t kiln_status;
enum {
    KILN_OK = 0,
    KILN_ERROR = 1,
    KILN_INVALID_ARGUMENT = 2,
    KILN_UNSUPPORTED = 3,
    KILN_OUT_OF_MEMORY = 4,
    KILN_PANIC = 5,
    KILN_UNAVAILABLE = 6,
    KILN_INVALID_SHAPE = 7,
    KILN_FORMAT = 8,
};

typedef struct { const uint8_t *ptr; size_t len; } kiln_str;       /* borrowed UTF-8 */
typedef struct { uint8_t *ptr; size_t len; } kiln_owned_str;       /* plugin-owned */

typedef struct kiln_backend kiln_backend;                          /* opaque */
typedef struct kiln_executor kiln_executor;                        /* opaque */

typedef struct {
    uint32_t struct_size, _reserved;
    kiln_str name, version, description;
    const uint32_t *qtypes; size_t n_qtypes;
    const uint32_t *architectures; size_t n_architectures;
} kiln_backend_info;

typedef struct { uint32_t supported, score; kiln_owned_str message; } kiln_support;

typedef struct {
    uint32_t struct_size, arch;
    uint64_t vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, head_dim, ffn_size,
        context_length, rotary_dims;
    uint32_t norm, activation, rope_kind, rope_scaling;
    float norm_eps, rope_theta, rope_scaling_factor;
    uint32_t flags;
} kiln_model_config;

typedef struct {
    kiln_str name;
    uint32_t role, layer, qtype, n_dims;
    uint64_t dims[4];
    const uint8_t *data;
    uint64_t len;
} kiln_tensor_desc;

/* (1.4) The model program: the forward pass as the host's architecture builder made it.
 * Weights are indices into kiln_model_desc.tensors; KILN_NO_TENSOR marks an empty slot.
 *   x  = embedding_scale * embedding[token]
 *   x += branch.scale * post_norm(sum of op(norm(x)))   for each branch, in order
 *   logits = logit_scale * output(head_norm(x))
 * A plugin refuses an op kind it does not know. */
#define KILN_NO_TENSOR UINT32_MAX
#define KILN_ROLE_OTHER 63 /* (1.4) a tensor only the program names */

typedef struct { uint32_t kind, weight, bias; float eps; } kiln_norm_desc; /* post_norm.weight NO_TENSOR: none */

enum {
    /* tensors: q, q bias, k, k bias, v, v bias, out, out bias, q head norm, k head norm;
     * values: score scale, head-norm eps; ints: window (0: whole context), local rope (0/1). */
    KILN_OP_ATTENTION = 0,
    /* tensors: gate (NO_TENSOR: ungated), up, down; ints: activation id. */
    KILN_OP_FEED_FORWARD = 1,
};

typedef struct {
    uint32_t kind, layer;
    uint32_t tensors[12];
    float values[4];
    uint64_t ints[4];
} kiln_op_desc;

typedef struct {
    kiln_norm_desc norm, post_norm;
    float scale;
    uint32_t first_op, n_ops;
} kiln_branch_desc;

typedef struct {
    uint32_t struct_size, _reserved;
    uint32_t embedding; float embedding_scale;
    kiln_norm_desc head_norm;
    uint32_t output; float logit_scale;
    uint32_t rope_freqs; float local_rope_theta;
    uint64_t sliding_window, sliding_global_every;
    const kiln_branch_desc *branches; size_t n_branches;
    const kiln_op_desc *ops; size_t n_ops;
} kiln_program_desc;

typedef struct {
    uint32_t struct_size, _reserved;
    const kiln_model_config *config;
    const kiln_tensor_desc *tensors; size_t n_tensors;
    kiln_str source;
    /* 1.4: absent when struct_size < offsetof(kiln_model_desc, program) + sizeof(void *), i.e.
     * from a 1.3 host; NULL from a 1.4 host only to a plugin older than 1.4. */
    const kiln_program_desc *program;
} kiln_model_desc;

typedef void (*kiln_progress_fn)(void *user, uint64_t done, uint64_t total);

/* Bits of kiln_load_options.flags (ABI 1.1): permissions a backend may decline; ignore
 * unknown bits. */
#define KILN_LOAD_QUANTIZED_ACTIVATIONS (1u << 0)

typedef struct {
    uint32_t struct_size, _reserved;
    uint64_t max_context, max_sequences, threads;
    kiln_progress_fn progress; void *progress_user;
    /* ABI 1.1: absent (read as 0) when struct_size < offsetof(kiln_load_options, flags) + 4,
     * i.e. from a 1.0 host. */
    uint32_t flags, _reserved1;
} kiln_load_options;

typedef struct { uint32_t struct_size, _reserved; uint64_t max_context, max_sequences; } kiln_executor_info;
typedef struct { uint32_t seq, token; } kiln_decode_item;

/* (1.3) One sequence's sampler for decode_sample: settings, SplitMix64 state (in and out),
 * recent tokens for the repetition penalty (borrowed for the call). */
typedef struct {
    float temperature, top_p, min_p, repeat_penalty;
    uint64_t top_k, repeat_last_n, seed, rng_state;
    const uint32_t *recent;
    uint64_t n_recent;
} kiln_sampler_state;

typedef struct {
    uint32_t abi_version, struct_size;
    void (*free_string)(kiln_owned_str s);
    kiln_status (*create_backend)(uint32_t host_abi, kiln_backend **out, kiln_owned_str *err);
    void (*destroy_backend)(kiln_backend *b);
    kiln_status (*describe)(kiln_backend *b, kiln_backend_info *out, kiln_owned_str *err);
    kiln_status (*probe)(kiln_backend *b, kiln_owned_str *device, kiln_owned_str *err);
    kiln_status (*supports)(kiln_backend *b, const kiln_model_desc *m, kiln_support *out, kiln_owned_str *err);
    kiln_status (*load)(kiln_backend *b, const kiln_model_desc *m, const kiln_load_options *o,
                        kiln_executor **out, kiln_executor_info *info, kiln_owned_str *err);
    void (*free_executor)(kiln_executor *e);
    kiln_status (*new_sequence)(kiln_executor *e, uint32_t *out, kiln_owned_str *err);
    kiln_status (*free_sequence)(kiln_executor *e, uint32_t seq, kiln_owned_str *err);
    kiln_status (*sequence_len)(kiln_executor *e, uint32_t seq, uint64_t *out, kiln_owned_str *err);
    kiln_status (*truncate_sequence)(kiln_executor *e, uint32_t seq, uint64_t len, kiln_owned_str *err);
    kiln_status (*prefill)(kiln_executor *e, uint32_t seq, const uint32_t *tokens, size_t n_tokens,
                           float *logits, size_t n_logits, kiln_owned_str *err);
    kiln_status (*decode)(kiln_executor *e, const kiln_decode_item *items, size_t n_items,
                          float *logits, size_t n_logits, kiln_owned_str *err);
    /* 1.3; NULL: the host samples the logits of decode itself. */
    kiln_status (*decode_sample)(kiln_executor *e, const kiln_decode_item *items, size_t n_items,
                                 kiln_sampler_state *samplers, size_t n_samplers, uint32_t *tokens,
                                 size_t n_tokens, kiln_owned_str *err);
} kiln_plugin_api;

/* The one exported symbol. */
const kiln_plugin_api *kiln_plugin_entry(void);

#endif
