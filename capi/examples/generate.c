/* kiln's C API from a C program: which backends can run a model, load it on the best,
 * build a chat prompt with its template, and stream a reply that the callback stops
 * after a number of pieces. Built and run by capi/tests/c_example.rs:
 *
 *   cc generate.c -I ../include -L <target dir> -lkiln_capi -o generate
 *   ./generate MODEL.gguf "Say hello." 8
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kiln.h"

struct budget {
    int left;
    int pieces;
};

/* Prints each piece; returning false stops the generation. */
static bool on_text(const char *text, size_t len, void *user) {
    struct budget *b = user;
    fwrite(text, 1, len, stdout);
    fflush(stdout);
    b->pieces++;
    return --b->left > 0;
}

static int fail(const char *what, KilnStatus s) {
    fprintf(stderr, "%s: status %d: %s\n", what, (int)s, kiln_last_error());
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s MODEL PROMPT [PIECES]\n", argv[0]);
        return 2;
    }
    if (kiln_c_api_version() >> 16 != KILN_C_API_VERSION >> 16) {
        fprintf(stderr, "kiln C API %u, built against %u\n", kiln_c_api_version(), KILN_C_API_VERSION);
        return 1;
    }

    /* Errors are codes with a message, never a crash. */
    KilnModel *missing = NULL;
    KilnStatus s = kiln_model_open("/nonexistent/model.gguf", NULL, 0, &missing);
    printf("open a missing file: status %d (%s)\n", (int)s, s == KILN_STATUS_IO ? "io" : "?");

    char *verdicts = NULL;
    if ((s = kiln_backends_json(argv[1], &verdicts)) != KILN_STATUS_OK) return fail("backends", s);
    printf("backends: %s\n", verdicts);
    kiln_string_free(verdicts);

    KilnModel *model = NULL;
    if ((s = kiln_model_open(argv[1], NULL, 2048, &model)) != KILN_STATUS_OK) return fail("open", s);
    printf("loaded on %s, vocabulary of %u\n", kiln_model_backend(model), kiln_model_vocab_size(model));

    KilnChatMessage chat[] = {{"system", "You are terse."}, {"user", argv[2]}};
    size_t n = 0;
    /* First ask how many ids the prompt takes, then fill a buffer of that size. */
    s = kiln_chat_prompt(model, chat, 2, NULL, 0, &n);
    if (s != KILN_STATUS_BUFFER_TOO_SMALL && s != KILN_STATUS_OK) return fail("chat prompt size", s);
    uint32_t *ids = malloc(n * sizeof *ids);
    if ((s = kiln_chat_prompt(model, chat, 2, ids, n, &n)) != KILN_STATUS_OK) return fail("chat prompt", s);
    printf("prompt: %zu tokens\n", n);

    KilnGenerateParams params = kiln_generate_params_default();
    params.temperature = 0.0f;
    params.max_tokens = 64;
    struct budget b = {argc > 3 ? atoi(argv[3]) : 1000, 0};
    KilnGenerationResult r;
    printf("reply: ");
    if ((s = kiln_generate(model, ids, n, &params, on_text, &b, &r)) != KILN_STATUS_OK) return fail("generate", s);
    printf("\nfinish %d after %u tokens (%d pieces), %.1f tok/s\n", (int)r.finish, r.generated_tokens, b.pieces,
           r.generated_tokens_per_second);

    /* A bad argument is a status too. */
    s = kiln_generate(model, NULL, 3, &params, NULL, NULL, NULL);
    printf("null prompt: status %d\n", (int)s);

    free(ids);
    kiln_model_free(model);
    return 0;
}
