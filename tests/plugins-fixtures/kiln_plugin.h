/* kiln plugin ABI 1.3 in C: the same layout as kiln_core::plugin_abi (docs/plugins.md).
 * For plugins written without the Rust SDK. The tests compile their deliberately broken
 * plugins against it and check that every struct here has the size Rust gives it. */
#ifndef KILN_PLUGIN_H
#define KILN_PLUGIN_H

#include <stddef.h>
#include <stdint.h>

#define KILN_ABI_MAJOR 1
#define KILN_ABI_MINOR 3
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

typedef struct {
    uint32_t struct_size, _reserved;
    const kiln_model_config *config;
    const kiln_tensor_desc *tensors; size_t n_tensors;
    kiln_str source;
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
