/* kiln's C batcher: four threads submit chat prompts to one model at once and read their
 * replies piece by piece; a prompt longer than the context is refused with a status.
 * Built and run by capi/tests/c_example.rs:
 *
 *   cc batch.c -I ../include -L <target dir> -lkiln_capi -pthread -o batch
 *   ./batch MODEL.gguf
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kiln.h"

#define THREADS 4

struct job {
    KilnBatcher *batcher;
    const char *question;
    int pieces;
    size_t bytes;
    KilnGenerationResult result;
    KilnStatus status;
};

static void *ask(void *arg) {
    struct job *j = arg;
    KilnChatMessage chat[] = {{"user", j->question}};
    uint32_t ids[512];
    size_t n = 0;
    if ((j->status = kiln_batcher_chat_prompt(j->batcher, chat, 1, ids, 512, &n)) != KILN_STATUS_OK) return NULL;
    KilnGenerateParams p = kiln_generate_params_default();
    p.temperature = 0.0f;
    p.max_tokens = 24;
    KilnStream *s = NULL;
    if ((j->status = kiln_batcher_submit(j->batcher, ids, n, &p, &s)) != KILN_STATUS_OK) return NULL;
    for (;;) {
        const char *text = NULL;
        size_t len = 0;
        bool done = false;
        if ((j->status = kiln_stream_next(s, &text, &len, &done, &j->result)) != KILN_STATUS_OK) break;
        if (done) break;
        j->pieces++;
        j->bytes += len;
    }
    kiln_stream_free(s);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODEL\n", argv[0]);
        return 2;
    }
    KilnBatcher *b = NULL;
    KilnStatus s = kiln_batcher_open(argv[1], NULL, 1024, THREADS, &b);
    if (s != KILN_STATUS_OK) {
        fprintf(stderr, "open: %s\n", kiln_last_error());
        return 1;
    }
    const char *questions[THREADS] = {"What is the capital of France?", "Name a colour.", "Count to three.",
                                      "Say hello."};
    struct job jobs[THREADS];
    pthread_t threads[THREADS];
    for (int i = 0; i < THREADS; i++) {
        memset(&jobs[i], 0, sizeof jobs[i]);
        jobs[i].batcher = b;
        jobs[i].question = questions[i];
        pthread_create(&threads[i], NULL, ask, &jobs[i]);
    }
    int ok = 0;
    for (int i = 0; i < THREADS; i++) {
        pthread_join(threads[i], NULL);
        printf("thread %d: status %d, %d pieces, %zu bytes, %u tokens, finish %d\n", i, (int)jobs[i].status,
               jobs[i].pieces, jobs[i].bytes, jobs[i].result.generated_tokens, (int)jobs[i].result.finish);
        ok += jobs[i].status == KILN_STATUS_OK && jobs[i].result.generated_tokens > 0;
    }
    /* A prompt as long as the context is refused with a status, not a crash. */
    size_t long_n = 2000;
    uint32_t *long_prompt = calloc(long_n, sizeof *long_prompt);
    for (size_t i = 0; i < long_n; i++) long_prompt[i] = 100;
    KilnStream *none = NULL;
    s = kiln_batcher_submit(b, long_prompt, long_n, NULL, &none);
    printf("long prompt: status %d (%s)\n", (int)s, kiln_last_error());
    free(long_prompt);
    kiln_batcher_free(b);
    printf("%d of %d threads answered\n", ok, THREADS);
    return ok == THREADS ? 0 : 1;
}
