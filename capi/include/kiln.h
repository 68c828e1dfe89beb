/* kiln's C API. Generated from capi/src/lib.rs by cbindgen; do not edit. */

#ifndef KILN_H
#define KILN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

// `major << 16 | minor` of this API (see [`kiln_c_api_version`]).
#define KILN_C_API_VERSION (1 << 16)

// What a call did. Hosts branch on these; [`kiln_last_error`] has the words.
typedef enum KilnStatus {
  KILN_STATUS_OK = 0,
  // A null or malformed argument, or a value out of range.
  KILN_STATUS_INVALID_ARGUMENT = 1,
  // The model file is malformed.
  KILN_STATUS_FORMAT = 2,
  // The model uses an architecture, weight type or feature kiln does not run.
  KILN_STATUS_UNSUPPORTED = 3,
  // Prompt plus generation do not fit the context.
  KILN_STATUS_CONTEXT_EXCEEDED = 4,
  // No backend can run the model (or the one named cannot).
  KILN_STATUS_NO_BACKEND = 5,
  // A backend failed.
  KILN_STATUS_BACKEND = 6,
  KILN_STATUS_OUT_OF_MEMORY = 7,
  // Reading a file failed.
  KILN_STATUS_IO = 8,
  KILN_STATUS_TOKENIZER = 9,
  // An output buffer is too small; the call said how much it needs.
  KILN_STATUS_BUFFER_TOO_SMALL = 10,
  // A Rust panic was caught at the boundary (a kiln bug; the message says where).
  KILN_STATUS_PANIC = 11,
  KILN_STATUS_OTHER = 12,
} KilnStatus;

// Why a generation ended.
typedef enum KilnFinish {
  // An end-of-sequence token or a stop string.
  KILN_FINISH_STOP = 0,
  // `max_tokens` reached.
  KILN_FINISH_LENGTH = 1,
  // The context is full.
  KILN_FINISH_CONTEXT_FULL = 2,
  // The callback returned false.
  KILN_FINISH_CANCELLED = 3,
} KilnFinish;

// A model serving many generations at once on its own thread (kiln's continuous batch):
// any number of host threads submit to it at the same time (opaque).
typedef struct KilnBatcher KilnBatcher;

// A model loaded on a backend (opaque).
typedef struct KilnModel KilnModel;

// One submitted generation's text, read piece by piece by one host thread (opaque).
typedef struct KilnStream KilnStream;

// One chat message: `role` is `system`, `user`, `assistant` (whatever the model's
// template knows); `content` is read as text, never as control tokens.
typedef struct KilnChatMessage {
  const char *role;
  const char *content;
} KilnChatMessage;

// How to generate. Start from [`kiln_generate_params_default`] and change fields.
typedef struct KilnGenerateParams {
  // `sizeof(KilnGenerateParams)` as the host was compiled with it.
  uint32_t struct_size;
  // Tokens to generate at most.
  uint32_t max_tokens;
  // 0 is greedy.
  float temperature;
  // 0 keeps every token.
  uint32_t top_k;
  float top_p;
  float min_p;
  // 1 is none.
  float repeat_penalty;
  uint64_t seed;
  // Stop at the model's end-of-sequence tokens (true by default).
  bool stop_on_eos;
} KilnGenerateParams;

// Receives each piece of text as it becomes final (UTF-8, `len` bytes, not
// NUL-terminated; never half a character); returns false to stop the generation.
typedef bool (*KilnTextCallback)(const char *text, size_t len, void *user);

// What a generation did.
typedef struct KilnGenerationResult {
  uint32_t prompt_tokens;
  // Prompt tokens prefilled (the rest were cached from an earlier call).
  uint32_t prefilled_tokens;
  uint32_t generated_tokens;
  enum KilnFinish finish;
  double prompt_tokens_per_second;
  double generated_tokens_per_second;
} KilnGenerationResult;

#ifdef __cplusplus
extern "C" {
#endif // __cplusplus

// This API's version, `major << 16 | minor`: a host built against another major must not
// call the others.
uint32_t kiln_c_api_version(void);

// The message of this thread's last failed call ("" after a success). Valid until this
// thread's next kiln call; do not free it.
const char *kiln_last_error(void);

// Frees a string kiln returned. Null is allowed.
//
// # Safety
// `s` is null or a string from a kiln function, not freed before.
void kiln_string_free(char *s);

// Every backend's verdict on the model at `path`, best first, as a JSON array (free it
// with [`kiln_string_free`]): `{"name", "score"}` for those that can run it, `{"name",
// "refused"}` with the reason for the others. Plugins from `KILN_PLUGIN_PATH` count.
//
// # Safety
// `path` is a NUL-terminated string; `json_out` is writable.
enum KilnStatus kiln_backends_json(const char *path, char **json_out);

// Opens the model at `path` (GGUF or APR) and loads it on the backend named `backend`,
// or on the best-scoring one when `backend` is null. `context` is the longest context
// in tokens (0: the backend's default, at most the model's own).
//
// # Safety
// `path` is a NUL-terminated string; `backend` is null or one; `out` is writable.
enum KilnStatus kiln_model_open(const char *path,
                                const char *backend,
                                uint32_t context,
                                struct KilnModel **out);

// Frees a model (its device memory too). Null is allowed.
//
// # Safety
// `model` is null or from [`kiln_model_open`], not freed before.
void kiln_model_free(struct KilnModel *model);

// The name of the backend the model runs on (owned by the model; do not free).
//
// # Safety
// `model` is from [`kiln_model_open`].
const char *kiln_model_backend(const struct KilnModel *model);

// The model's vocabulary size (0 for a null model).
//
// # Safety
// `model` is null or from [`kiln_model_open`].
uint32_t kiln_model_vocab_size(const struct KilnModel *model);

// Tokenizes `text` into `ids` (room for `cap`); `*n_out` is the count, also when the
// buffer is too small (`KILN_STATUS_BUFFER_TOO_SMALL`: call again with that much).
// `add_special`: the BOS token where the model wants one, and special-token spellings
// read as those tokens.
//
// # Safety
// `model` from [`kiln_model_open`]; `text` NUL-terminated; `ids` holds `cap` `u32`s (may
// be null when `cap` is 0); `n_out` writable.
enum KilnStatus kiln_tokenize(const struct KilnModel *model,
                              const char *text,
                              bool add_special,
                              uint32_t *ids,
                              size_t cap,
                              size_t *n_out);

// The prompt of a chat (`messages`, `n` of them) ready for the assistant's turn: the
// model's template with its markup as control tokens and every content as text. Output
// as for [`kiln_tokenize`].
//
// # Safety
// `model` from [`kiln_model_open`]; `messages` holds `n` messages of NUL-terminated
// strings; `ids`, `cap`, `n_out` as for [`kiln_tokenize`].
enum KilnStatus kiln_chat_prompt(const struct KilnModel *model,
                                 const struct KilnChatMessage *messages,
                                 size_t n,
                                 uint32_t *ids,
                                 size_t cap,
                                 size_t *n_out);

// The defaults: 128 tokens, llama.cpp's sampler (temperature 0.8, top-k 40, top-p 0.95,
// min-p 0.05), no repetition penalty, seed 0, stop at end-of-sequence tokens.
struct KilnGenerateParams kiln_generate_params_default(void);

// Generates from `prompt` (`n` token ids): each piece of text goes to `callback` (which
// may be null, and may return false to stop: then `KILN_FINISH_CANCELLED`); `result` (may
// be null) gets the counts and the finish. Each call prefills its whole prompt (no KV
// cache is kept between calls in this version).
//
// # Safety
// `model` from [`kiln_model_open`]; `prompt` holds `n` ids; `params` is null (the
// defaults) or a [`KilnGenerateParams`]; `result` null or writable; `callback` is called
// on this thread with `user`.
enum KilnStatus kiln_generate(struct KilnModel *model,
                              const uint32_t *prompt,
                              size_t n,
                              const struct KilnGenerateParams *params,
                              KilnTextCallback callback,
                              void *user,
                              struct KilnGenerationResult *result);

// Opens the model at `path` on `backend` (null: the best) for `max_sequences` generations
// at once (more wait in a queue), each of up to `context` tokens (0: the backend's
// default).
//
// # Safety
// `path` NUL-terminated; `backend` null or NUL-terminated; `out` writable.
enum KilnStatus kiln_batcher_open(const char *path,
                                  const char *backend,
                                  uint32_t context,
                                  uint32_t max_sequences,
                                  struct KilnBatcher **out);

// Stops a batcher (queued work refused, running generations cancelled) and frees it.
// Free its streams first. Null is allowed.
//
// # Safety
// `batcher` null or from [`kiln_batcher_open`], not freed before, no call on it running.
void kiln_batcher_free(struct KilnBatcher *batcher);

// [`kiln_tokenize`] with the batcher's model.
//
// # Safety
// `batcher` from [`kiln_batcher_open`]; the rest as for [`kiln_tokenize`].
enum KilnStatus kiln_batcher_tokenize(const struct KilnBatcher *batcher,
                                      const char *text,
                                      bool add_special,
                                      uint32_t *ids,
                                      size_t cap,
                                      size_t *n_out);

// [`kiln_chat_prompt`] with the batcher's model.
//
// # Safety
// `batcher` from [`kiln_batcher_open`]; the rest as for [`kiln_chat_prompt`].
enum KilnStatus kiln_batcher_chat_prompt(const struct KilnBatcher *batcher,
                                         const struct KilnChatMessage *messages,
                                         size_t n,
                                         uint32_t *ids,
                                         size_t cap,
                                         size_t *n_out);

// Queues a generation from `prompt` (`n` ids) with `params` (null: the defaults; its
// `stop_on_eos` must be true) and gives its stream. Callable from any number of threads
// at once; blocks while the queue is full. A prompt that leaves no room in the context is
// `KILN_STATUS_CONTEXT_EXCEEDED`.
//
// # Safety
// `batcher` from [`kiln_batcher_open`]; `prompt` holds `n` ids; `params` null or a
// [`KilnGenerateParams`]; `out` writable.
enum KilnStatus kiln_batcher_submit(const struct KilnBatcher *batcher,
                                    const uint32_t *prompt,
                                    size_t n,
                                    const struct KilnGenerateParams *params,
                                    struct KilnStream **out);

// Waits for the stream's next piece of text: `*text` and `*len` (NUL-terminated, valid
// until the next call on this stream; never half a character) with `*done` false; at the
// end `*done` true, `*text` null, and `result` (may be null) gets the token counts and the
// finish (no speeds: the batch's steps are shared).
//
// # Safety
// `stream` from [`kiln_batcher_submit`], used by one thread at a time; `text`, `len`,
// `done` writable; `result` null or writable.
enum KilnStatus kiln_stream_next(struct KilnStream *stream,
                                 const char **text,
                                 size_t *len,
                                 bool *done,
                                 struct KilnGenerationResult *result);

// Frees a stream; a generation not at its end is cancelled. Null is allowed.
//
// # Safety
// `stream` null or from [`kiln_batcher_submit`], not freed before.
void kiln_stream_free(struct KilnStream *stream);

#ifdef __cplusplus
}  // extern "C"
#endif  // __cplusplus

#endif  /* KILN_H */
