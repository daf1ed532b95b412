// sampler.h — turning a model's next-token distribution into text.
//
// The model gives logits z over the vocabulary. Sampling with temperature tau draws from
// softmax(z / tau): tau < 1 sharpens toward the most likely tokens, tau > 1 flattens. Top-k keeps
// only the k most likely tokens before drawing, which cuts the long tail of unlikely tokens that
// makes samples from small models wander. Top-p ("nucleus", Holtzman et al. 2019, "The Curious Case
// of Neural Text Degeneration") keeps the smallest set of most likely tokens whose probabilities
// (at this temperature) add up to at least p: a cut that adapts to the distribution, few tokens
// where the model is sure and many where it is not. Both cuts apply when both are given (top-k
// first, as Hugging Face does). tau = 0 is greedy decoding (always the argmax).
//
// The random numbers come from xorshift64*: tiny state (one uint64, saved in checkpoints so a
// resumed run samples the same text) and good enough statistics for sampling.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>
#include "llmc/io/tokenizer.h"
#include "llmc/utils.h"

inline uint64_t xorshift64star(uint64_t* state) {
    uint64_t x = *state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    return x * 0x2545F4914F6CDD1Dull;
}

// Uniform in [0, 1) with 24 bits of resolution.
inline float random_unit_float(uint64_t* state) {
    return (float)(xorshift64star(state) >> 40) / 16777216.0f;
}

// Draws a token from logits[0 .. vocab_size) (padded logits must not be passed in).
inline int sample_token(const float* logits, int vocab_size, float temperature, int top_k, uint64_t* rng,
                        float top_p = 1.0f) {
    if (temperature <= 0.0f) return (int)(std::max_element(logits, logits + vocab_size) - logits);
    std::vector<int> candidates(vocab_size);
    for (int i = 0; i < vocab_size; i++) candidates[i] = i;
    // most likely first; equal logits by token id, so the order (and the draw) is the same everywhere
    auto more_likely = [&](int a, int b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
    int k = (top_k > 0 && top_k < vocab_size) ? top_k : vocab_size;
    if (k < vocab_size) {
        std::partial_sort(candidates.begin(), candidates.begin() + k, candidates.end(), more_likely);
        candidates.resize(k);
    }
    if (top_p < 1.0f && k == vocab_size) std::sort(candidates.begin(), candidates.end(), more_likely);
    float max_logit = -INFINITY;
    for (int i : candidates) max_logit = std::max(max_logit, logits[i]);
    std::vector<double> weights(candidates.size());
    double total = 0.0;
    for (size_t j = 0; j < candidates.size(); j++) {
        weights[j] = std::exp((double)(logits[candidates[j]] - max_logit) / temperature);
        total += weights[j];
    }
    if (top_p < 1.0f) {  // the nucleus: the shortest prefix (candidates are sorted) holding top_p of the mass
        double kept = 0.0;
        size_t n = 0;
        while (n < candidates.size() && kept < top_p * total) kept += weights[n++];
        candidates.resize(n);
        weights.resize(n);
        total = kept;
    }
    double r = random_unit_float(rng) * total;
    for (size_t j = 0; j < candidates.size(); j++) {
        r -= weights[j];
        if (r <= 0.0) return candidates[j];
    }
    return candidates.back();
}

// ---- how tokens read: GPT-2's vocabulary as text through its tokenizer, any other as token ids

constexpr int GPT2_VOCAB_SIZE = 50257;

struct TokenText {
    Tokenizer tokenizer;
    bool text = false;  // false: token ids separated by spaces
};

// Loads GPT-2's tokenizer from `dir` when the vocabulary is GPT-2's. Returns what went wrong, or ""
// when nothing did: the caller decides whether ids will do (samples during training) or not
// (--generate, whose prompt is text).
inline std::string token_text_init(TokenText* t, const std::string& dir, int vocab_size) {
    t->text = false;
    if (vocab_size != GPT2_VOCAB_SIZE) return "";
    std::string encoder = dir + "/encoder.json", merges = dir + "/vocab.bpe";
    if (!file_exists(encoder) || !file_exists(merges)) {
        return "no GPT-2 tokenizer in '" + dir + "' (scripts/get_vocab.sh fetches it; --tokenizer DIR points elsewhere)";
    }
    std::string error;
    if (!t->tokenizer.load(encoder, merges, &error)) return "could not load the tokenizer: " + error;
    t->text = true;
    return "";
}

inline std::string decode_tokens(const TokenText& t, const std::vector<int>& tokens) {
    // a byte-level model can emit a lone piece of a multi-byte character: show it as U+FFFD
    if (t.text) return utf8_replace_invalid(t.tokenizer.decode(tokens));
    std::string out;
    for (size_t i = 0; i < tokens.size(); i++) out += (i ? " " : "") + std::to_string(tokens[i]);
    return out;
}
