// llama.cpp as a reference for kiln's fixtures (built and run by
// scripts/reference/gemma3_fixture.sh), two modes:
//
//   llamacpp_reference greedy MODEL STEPS < ids.txt
//     prompts as token ids (one per line, ids separated by spaces; kiln's tokenizer made
//     them, so the comparison is of the forward pass alone); for each one JSON line: the
//     prompt, the first step's logits at the probe ids (its 256 highest and every 1021st
//     id), the greedy continuation of STEPS tokens and llama.cpp's top-2 logit gap at each
//     step (for near-tie accounting).
//   llamacpp_reference tokenize MODEL < strings.jsonl
//     one JSON string per line; for each one JSON line {"text": …, "ids": […]} with the
//     special tokens (BOS) the model adds.
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
    std::fprintf(stderr, "llamacpp_reference: %s\n", what);
    std::exit(1);
}

// The text of one JSON string literal (the escapes JSON has; \u with surrogate pairs).
static std::string json_string(const std::string& line) {
    size_t i = line.find('"');
    if (i == std::string::npos) fail("a line is not a JSON string");
    std::string out;
    auto put = [&](unsigned cp) {
        if (cp < 0x80) out += (char)cp;
        else if (cp < 0x800) { out += (char)(0xC0 | cp >> 6); out += (char)(0x80 | (cp & 0x3F)); }
        else if (cp < 0x10000) { out += (char)(0xE0 | cp >> 12); out += (char)(0x80 | (cp >> 6 & 0x3F)); out += (char)(0x80 | (cp & 0x3F)); }
        else { out += (char)(0xF0 | cp >> 18); out += (char)(0x80 | (cp >> 12 & 0x3F)); out += (char)(0x80 | (cp >> 6 & 0x3F)); out += (char)(0x80 | (cp & 0x3F)); }
    };
    for (++i; i < line.size() && line[i] != '"'; ++i) {
        if (line[i] != '\\') { out += line[i]; continue; }
        const char e = line[++i];
        switch (e) {
            case 'n': out += '\n'; break;
            case 't': out += '\t'; break;
            case 'r': out += '\r'; break;
            case 'b': out += '\b'; break;
            case 'f': out += '\f'; break;
            case 'u': {
                unsigned cp = std::stoul(line.substr(i + 1, 4), nullptr, 16);
                i += 4;
                if (cp >= 0xD800 && cp < 0xDC00 && line.compare(i + 1, 2, "\\u") == 0) {
                    const unsigned lo = std::stoul(line.substr(i + 3, 4), nullptr, 16);
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                    i += 6;
                }
                put(cp);
                break;
            }
            default: out += e;
        }
    }
    return out;
}

static int tokenize(llama_model* model) {
    const llama_vocab* vocab = llama_model_get_vocab(model);
    std::string line;
    while (std::getline(std::cin, line)) {
        if (line.empty()) continue;
        const std::string text = json_string(line);
        std::vector<llama_token> ids(text.size() + 8);
        const int n = llama_tokenize(vocab, text.data(), (int)text.size(), ids.data(), (int)ids.size(), true, false);
        if (n < 0) fail("tokenize failed");
        std::printf("{\"text\":%s,\"ids\":[", line.c_str());
        for (int i = 0; i < n; ++i) std::printf("%s%d", i ? "," : "", ids[i]);
        std::printf("]}\n");
    }
    return 0;
}

int main(int argc, char** argv) {
    if (argc < 3) fail("usage: llamacpp_reference greedy MODEL.gguf STEPS < ids.txt | tokenize MODEL.gguf < strings.jsonl");
    const std::string mode = argv[1];
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    llama_model* model = llama_model_load_from_file(argv[2], mp);
    if (!model) fail("cannot load the model");
    if (mode == "tokenize") return tokenize(model);
    if (mode != "greedy" || argc != 4) fail("usage: llamacpp_reference greedy MODEL.gguf STEPS < ids.txt");
    const int steps = std::atoi(argv[3]);
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
