/* A minimal plugin in C, compiled by tests/tests/plugins.rs once per FIXTURE_* variant.
 * FIXTURE_VALID is a well-formed plugin (backend "c-null", which runs no model); every
 * other variant breaks exactly one rule of the ABI, and the host must refuse it with a
 * message naming the file and the cause, and keep running. */
#include <stdlib.h>
#include <string.h>

#include "kiln_plugin.h"

/* Layout check: the test compares these with Rust's size_of for the same structs. */
const size_t kiln_fixture_sizes[] = {
    sizeof(kiln_plugin_api),   sizeof(kiln_backend_info), sizeof(kiln_support),
    sizeof(kiln_model_config), sizeof(kiln_tensor_desc),  sizeof(kiln_model_desc),
    sizeof(kiln_load_options), sizeof(kiln_executor_info), sizeof(kiln_decode_item),
};

static kiln_owned_str owned(const char *msg) {
    kiln_owned_str s;
    s.len = strlen(msg);
    s.ptr = malloc(s.len ? s.len : 1);
    memcpy(s.ptr, msg, s.len);
    return s;
}

static void free_string(kiln_owned_str s) { free(s.ptr); }

static int backend_token;

static kiln_status create_backend(uint32_t host_abi, kiln_backend **out, kiln_owned_str *err) {
    (void)host_abi;
#ifdef FIXTURE_INIT_FAIL
    *err = owned("no accelerator found");
    return KILN_ERROR;
#else
    (void)err;
    *out = (kiln_backend *)&backend_token;
    return KILN_OK;
#endif
}

static void destroy_backend(kiln_backend *b) { (void)b; }

static const uint32_t qtypes[] = {0, 1,
#ifdef FIXTURE_BAD_QTYPE
                                  999
#else
                                  8
#endif
};

static kiln_str str(const char *s, size_t len) {
    kiln_str r;
    r.ptr = (const uint8_t *)s;
    r.len = len;
    return r;
}

static kiln_status describe(kiln_backend *b, kiln_backend_info *out, kiln_owned_str *err) {
    (void)b;
#ifdef FIXTURE_DESCRIBE_FAIL
    *err = owned("describe exploded");
    return KILN_ERROR;
#endif
    (void)err;
#if defined(FIXTURE_NULL_NAME)
    out->name = str(NULL, 0);
#elif defined(FIXTURE_NON_UTF8)
    out->name = str("c-\xff\xfe", 4);
#elif defined(FIXTURE_LONG_NAME)
    /* Claims far more bytes than exist: the host must check the length before reading. */
    out->name = str("c-null", 100000);
#else
    out->name = str("c-null", 6);
#endif
    out->version = str("0.0.1", 5);
    out->description = str("plugin written in C that runs no model", 38);
    out->qtypes = qtypes;
    out->n_qtypes = sizeof qtypes / sizeof qtypes[0];
    out->architectures = NULL;
    out->n_architectures = 0;
    return KILN_OK;
}

static kiln_status probe(kiln_backend *b, kiln_owned_str *device, kiln_owned_str *err) {
    (void)b;
    (void)err;
    *device = owned("nothing at all");
    return KILN_OK;
}

static kiln_status supports(kiln_backend *b, const kiln_model_desc *m, kiln_support *out, kiln_owned_str *err) {
    (void)b;
    (void)err;
    out->supported = 0;
    out->score = 0;
    out->message = owned(m->n_tensors ? "c-null runs no model" : "empty model");
    return KILN_OK;
}

static kiln_status load(kiln_backend *b, const kiln_model_desc *m, const kiln_load_options *o, kiln_executor **out,
                        kiln_executor_info *info, kiln_owned_str *err) {
    (void)b, (void)m, (void)out, (void)info;
    /* A 1.1 field: a 1.0 host's options end before it. */
    uint32_t flags = o->struct_size >= offsetof(kiln_load_options, flags) + sizeof o->flags ? o->flags : 0;
    *err = owned(flags & KILN_LOAD_QUANTIZED_ACTIVATIONS ? "c-null runs no model, quantized or not"
                                                         : "c-null runs no model");
    return KILN_UNSUPPORTED;
}

static void free_executor(kiln_executor *e) { (void)e; }

#define NO_EXECUTOR                                                                                                    \
    {                                                                                                                  \
        *err = owned("no executor exists");                                                                            \
        return KILN_INVALID_ARGUMENT;                                                                                  \
    }
static kiln_status new_sequence(kiln_executor *e, uint32_t *o, kiln_owned_str *err) { (void)e, (void)o; NO_EXECUTOR }
static kiln_status free_sequence(kiln_executor *e, uint32_t s, kiln_owned_str *err) { (void)e, (void)s; NO_EXECUTOR }
static kiln_status sequence_len(kiln_executor *e, uint32_t s, uint64_t *o, kiln_owned_str *err) {
    (void)e, (void)s, (void)o;
    NO_EXECUTOR
}
static kiln_status truncate_sequence(kiln_executor *e, uint32_t s, uint64_t l, kiln_owned_str *err) {
    (void)e, (void)s, (void)l;
    NO_EXECUTOR
}
static kiln_status prefill(kiln_executor *e, uint32_t s, const uint32_t *t, size_t n, float *l, size_t nl,
                           kiln_owned_str *err) {
    (void)e, (void)s, (void)t, (void)n, (void)l, (void)nl;
    NO_EXECUTOR
}
static kiln_status decode(kiln_executor *e, const kiln_decode_item *i, size_t n, float *l, size_t nl,
                          kiln_owned_str *err) {
    (void)e, (void)i, (void)n, (void)l, (void)nl;
    NO_EXECUTOR
}

static const kiln_plugin_api api = {
#ifdef FIXTURE_ABI_MAJOR
    ((uint32_t)2 << 16) | 3,
#elif defined(FIXTURE_V1_2)
    ((uint32_t)1 << 16) | 2,
#else
    KILN_ABI_VERSION,
#endif
#ifdef FIXTURE_TOO_SMALL
    /* Header plus three entries: a table cut short. */
    8 + 3 * sizeof(void *),
#elif defined(FIXTURE_V1_2)
    /* A plugin built before ABI 1.3: its table ends before decode_sample. */
    offsetof(kiln_plugin_api, decode_sample),
#else
    sizeof(kiln_plugin_api),
#endif
    free_string, create_backend, destroy_backend, describe, probe, supports, load, free_executor, new_sequence,
    free_sequence, sequence_len, truncate_sequence, prefill,
#ifdef FIXTURE_NULL_FN
    NULL,
#else
    decode,
#endif
};

#if defined(FIXTURE_NO_ENTRY)
int kiln_fixture_placeholder(void) { return api.abi_version != 0; }
#elif defined(FIXTURE_DATA_ENTRY)
/* The entry's name on a data object (the header declares it a function, so the data gets
   the name at the assembler level): calling it would jump into data. */
const unsigned char kiln_fixture_data_entry[64] __asm__("kiln_plugin_entry") = {0xff, 0xff, 0xff, 0xff};
int kiln_fixture_placeholder(void) { return api.abi_version != 0; }
#else
const kiln_plugin_api *kiln_plugin_entry(void) {
#ifdef FIXTURE_NULL_TABLE
    return NULL;
#else
    return &api;
#endif
}
#endif
