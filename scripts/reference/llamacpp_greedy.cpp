// Reference logits from llama.cpp for kiln's fixtures: reads prompts as token ids (one
// prompt per line, ids separated by spaces; kiln's tokenizer made them, so the comparison
// is of the forward pass alone), and for each prints one JSON line: the prompt, the first
// step's logits at the probe ids (its 256 highest and every 1021st id), and the greedy
// continuation of `steps` tokens with llama.cpp's top-2 logit gap at each step (for
// near-tie accounting). Build and use: scripts/reference/gemma3_fixture.sh.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "llama.h"

static void fail(const char* what) {
    std::fprintf(stderr, "llamacpp_greedy: %s\n", what);
    std::exit(1);
}

int main(int argc, char** argv) {
    if (argc != 3) fail("usage: llamacpp_greedy MODEL.gguf STEPS < prompts.txt");
    const int steps = std::atoi(argv[2]);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    llama_model* model = llama_model_load_from_file(argv[1], mp);
    if (!model) fail("cannot load the model");
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    std::string line;
    while (std::getline(std::cin, line)) {
        std::vector<llama_token> prompt;
        std::istringstream in(line);
        for (long id; in >> id;) prompt.push_back((llama_token)id);
        if (prompt.empty()) continue;
        llama_context_params cp = llama_context_default_params();
        cp.n_ctx = prompt.size() + steps + 8;
        cp.n_batch = cp.n_ubatch = prompt.size();
        cp.n_threads = cp.n_threads_batch = 2;
        llama_context* ctx = llama_init_from_model(model, cp);
        if (!ctx) fail("cannot make a context");
        std::vector<llama_token> batch = prompt;
        std::vector<llama_token> greedy;
        std::vector<float> gaps;
        std::vector<std::pair<int, float>> probe;
        for (int s = 0; s < steps; ++s) {
            if (llama_decode(ctx, llama_batch_get_one(batch.data(), (int)batch.size()))) fail("decode failed");
            const float* logits = llama_get_logits_ith(ctx, -1);
            std::vector<int> order(n_vocab);
            std::iota(order.begin(), order.end(), 0);
            std::partial_sort(order.begin(), order.begin() + 256, order.end(),
                              [&](int a, int b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
            if (s == 0) {
                for (int i = 0; i < 256; ++i) probe.emplace_back(order[i], logits[order[i]]);
                for (int id = 0; id < n_vocab; id += 1021) probe.emplace_back(id, logits[id]);
            }
            greedy.push_back(order[0]);
            gaps.push_back(logits[order[0]] - logits[order[1]]);
            batch.assign(1, order[0]);
        }
        std::printf("{\"prompt\":[");
        for (size_t i = 0; i < prompt.size(); ++i) std::printf("%s%d", i ? "," : "", prompt[i]);
        std::printf("],\"probe\":[");
        for (size_t i = 0; i < probe.size(); ++i) std::printf("%s[%d,%.6g]", i ? "," : "", probe[i].first, probe[i].second);
        std::printf("],\"greedy\":[");
        for (size_t i = 0; i < greedy.size(); ++i) std::printf("%s%d", i ? "," : "", greedy[i]);
        std::printf("],\"top2_gap\":[");
        for (size_t i = 0; i < gaps.size(); ++i) std::printf("%s%.5g", i ? "," : "", gaps[i]);
        std::printf("]}\n");
        std::fflush(stdout);
        llama_free(ctx);
    }
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
