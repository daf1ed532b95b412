// generate.h — using a trained model: continue a prompt, token by token, with a KV cache.
//
// `--generate "Call me Ishmael."` (or `--prompt-file F`) turns either trainer into a generator: it
// reads the weights (--model FILE or --resume CKPT; no data, no optimizer state, no output folder),
// tokenizes the prompt, draws --num-samples continuations of --sample-tokens tokens each
// (llmc/run/sampler.h: --temperature, --top-k, --top-p; sample i from seed --seed + i, so the same
// seed gives the same text), prints them (--json: one line per sample) and exits. This file is the
// host-side loop, shared by both trainers; each hands in its model as one callback, `next_logits`.
//
// Why a KV cache. A causal model's position t depends only on positions <= t, so when a token is
// appended nothing computed for the earlier positions changes. In attention, a new token's query
// meets the keys and values of every earlier position:
//     out_t = sum_{u <= t} softmax_u(q_t . k_u / sqrt(hs)) v_u
// and k_u, v_u are the same numbers every time. Recomputing the whole window for each new token
// costs a full forward pass over t positions per token (O(t) matmul rows, O(t^2) attention), so a
// sample of n tokens costs O(n^2) rows. Keeping each layer's k and v rows (the cache) makes a new
// token one row through every matmul and one row of attention against the cache: O(1) rows and
// O(t) attention per token. The price is memory: 2 (k and v) x L layers x T positions x C floats per
// sequence (GPT-2 124M at T = 1024: 2 x 12 x 1024 x 768 x 4 B = 72 MiB in fp32), and the prompt is
// run once as a batch of rows ("prefill") that fills the cache, after which each step is "decode".
// The math is the same; only the order of floating-point sums may differ, so at temperature 0 the
// cached path must pick the same tokens as the full recomputation (test/test_generate.py; each
// trainer's recomputing path is its training forward pass, --kv-cache 0).
//
// The context. A model has positions 0 .. T-1 (T = max_seq_len). A prompt longer than T tokens is
// refused (exit 2, saying how long it is). When prompt and sample together outgrow T, the window
// slides in halves: the cache is emptied and the newest T/2 tokens are run again as a new prefill at
// positions 0 .. T/2-1 (positions must restart: wpe has T rows). Both paths slide at the same
// tokens, because this loop decides it, so they stay equal.
//
// Tokens. A model with GPT-2's vocabulary (50257) reads and writes text through GPT-2's tokenizer
// (llmc/io/tokenizer.h; --tokenizer DIR, scripts/get_vocab.sh fetches it): a prompt that is not
// valid UTF-8 is refused rather than silently changed. A model with another vocabulary (the tests'
// small ones) takes its prompt as token ids separated by spaces and prints token ids.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>
#include "llmc/run/checkpoint.h"
#include "llmc/run/cli.h"
#include "llmc/run/metrics.h"
#include "llmc/run/plan.h"
#include "llmc/run/sampler.h"
#include "llmc/io/tokenizer.h"
#include "llmc/model/model.h"
#include "llmc/utils.h"

// The model to generate from: the shape of --model FILE's or --resume CKPT's weights (*resume_dir:
// the checkpoint, or ""). Generation runs the whole model in one process (`where`: "one rank", "one
// GPU"): mpirun and the grid flags are refused, and so is a descriptor (there are no weights to use).
// A mixture-of-experts file (version 7) is read when the --moe-* flags name its experts, top-k and
// every, as training checks them (llmc/run/plan.h's moe_file_problem); its MoE blocks route without
// dropping (llmc/model/moe.h, moe_forward_new_rows, says why), so --moe-capacity-factor is unused.
inline GPT2Config generation_model(const TrainOptions& o, int world_size, const char* where, std::string* resume_dir) {
    if (world_size > 1) usage_fail("--generate runs on %s: run it without mpirun", where);
    if (o.tensor_parallel > 1 || o.pipeline_parallel > 1 || o.zero_stage > 0 || o.expert_parallel > 1) {
        usage_fail("--generate runs the whole model on %s: drop --tensor-parallel, --pipeline-parallel, --zero and --expert-parallel",
                   where);
    }
    *resume_dir = resolve_resume_dir(o);
    GPT2Config cfg;
    bool new_model = false;
    ModelHeader file;
    std::string source = load_model_config(o, *resume_dir, &cfg, &new_model, &file);
    if (new_model) usage_fail("--generate needs trained weights: --model FILE or --resume CKPT, not the descriptor '%s'", o.model.c_str());
    std::string why = moe_file_problem(file, o, source);
    if (!why.empty()) usage_fail(why);
    return cfg;
}

// The model, as the loop sees it: the logits (vocab_size floats, read before the next call) of the
// token that follows tokens[first ..], where tokens[first + j] sits at position j. The keys and
// values of tokens[first .. first + cached) are in the cache from earlier calls: only the rest is
// new (cached = 0: the cache starts afresh). A path without a cache ignores `cached`.
using NextLogits = std::function<const float*(const std::vector<int>& tokens, int first, int cached)>;

// GPT-2's vocabulary needs the tokenizer's files (a missing or damaged file is exit 1, naming it):
// the prompt is text; any other vocabulary reads and writes ids.
inline void prompt_text_init(TokenText* codec, const TrainOptions& o, const GPT2Config& cfg) {
    std::string problem = token_text_init(codec, o.tokenizer_dir, cfg.vocab_size);
    if (!problem.empty()) fail("--generate: %s", problem.c_str());
}

// The prompt's text: --generate's, or the whole of --prompt-file's file (exit 1 when it cannot be
// read or is empty: a bad file).
inline std::string read_prompt(const TrainOptions& o) {
    if (!flag_given(o, "prompt-file")) return o.generate;
    FILE* f = fopen(o.prompt_file.c_str(), "rb");
    if (!f) fail("--prompt-file '%s': cannot read it", o.prompt_file.c_str());
    std::string text;
    char buf[65536];
    for (size_t n; (n = fread(buf, 1, sizeof buf, f)) > 0;) text.append(buf, n);
    fclose(f);
    if (text.empty()) fail("--prompt-file '%s' is empty: there is nothing to continue", o.prompt_file.c_str());
    return text;
}

// The prompt's tokens, checked: not empty, every id in the vocabulary, no longer than the context.
inline std::vector<int> encode_prompt(const TokenText& codec, const std::string& text, const GPT2Config& cfg) {
    std::vector<int> tokens;
    if (codec.text) {
        size_t bad = utf8_first_invalid(text);
        if (bad != text.size()) usage_fail("--generate: the prompt is not valid UTF-8 (byte %zu); GPT-2's tokenizer reads UTF-8 text", bad);
        tokens = codec.tokenizer.encode(text);
    } else {
        for (size_t i = 0; i < text.size();) {
            size_t end = text.find_first_of(" \t\r\n", i);
            if (end == std::string::npos) end = text.size();
            if (end > i) {
                std::string word = text.substr(i, end - i);
                char* rest = nullptr;
                long id = strtol(word.c_str(), &rest, 10);
                if (*rest || id < 0 || id >= cfg.vocab_size) {
                    usage_fail("--generate: this model's vocabulary is not GPT-2's (%d tokens), so the prompt is token ids "
                               "0..%d separated by spaces; '%s' is not one", cfg.vocab_size, cfg.vocab_size - 1, word.c_str());
                }
                tokens.push_back((int)id);
            }
            i = end + 1;
        }
    }
    if (tokens.empty()) usage_fail("--generate: the prompt has no tokens; give some text to continue");
    if ((int)tokens.size() > cfg.max_seq_len) {
        usage_fail("--generate: the prompt is %zu tokens, longer than the model's context of %d; shorten it",
                   tokens.size(), cfg.max_seq_len);
    }
    return tokens;
}

// Sample i's random stream: its own seed, so that one sample does not depend on how many were drawn
// before it. The multiplier spreads nearby seeds apart; xorshift's state must not be zero.
inline uint64_t sample_rng_seed(uint64_t seed, int i) {
    uint64_t s = (seed + (uint64_t)i) * 0x9E3779B97F4A7C15ull ^ 0x5DEECE66Dull;
    return s ? s : 1;
}

// log p(token) under the model's distribution (softmax of the raw logits, before temperature and
// cuts): what --json reports per token, and what lets the tests compare two paths more finely than
// by the tokens they pick.
inline double token_logprob(const float* logits, int vocab_size, int token) {
    float max_logit = *std::max_element(logits, logits + vocab_size);
    double total = 0.0;
    for (int i = 0; i < vocab_size; i++) total += std::exp((double)logits[i] - max_logit);
    return (double)logits[token] - max_logit - std::log(total);
}

// `count` tokens after `prompt`, each drawn from next_logits (the window policy above), and each
// one's log-probability into *logprobs.
inline std::vector<int> generate_tokens(const std::vector<int>& prompt, int count, int context, int vocab_size,
                                        const TrainOptions& o, uint64_t* rng, const NextLogits& next_logits,
                                        std::vector<double>* logprobs) {
    std::vector<int> tokens = prompt;
    logprobs->clear();
    int first = 0, cached = 0;
    for (int i = 0; i < count; i++) {
        if ((int)tokens.size() - first > context) {  // the window is full: keep its newest half
            first = (int)tokens.size() - context / 2;
            cached = 0;
        }
        const float* logits = next_logits(tokens, first, cached);
        cached = (int)tokens.size() - first;
        tokens.push_back(sample_token(logits, vocab_size, o.temperature, o.top_k, rng, o.top_p));
        logprobs->push_back(token_logprob(logits, vocab_size, tokens.back()));
    }
    return std::vector<int>(tokens.begin() + (ptrdiff_t)prompt.size(), tokens.end());
}

inline std::string json_int_list(const std::vector<int>& v) {
    std::string out = "[";
    for (size_t i = 0; i < v.size(); i++) out += (i ? "," : "") + std::to_string(v[i]);
    return out + "]";
}

// The whole mode: the prompt, --num-samples samples printed as they come (text after the prompt,
// then a line of dashes; or --json lines), and the speed on stderr (stdout stays the samples).
// `path` names the model path for that line ("KV cache" or "recomputing the window").
inline void run_generation(const TrainOptions& o, const GPT2Config& cfg, const char* path, const NextLogits& next_logits) {
    TokenText codec;
    prompt_text_init(&codec, o, cfg);
    std::string text = read_prompt(o);
    std::vector<int> prompt = encode_prompt(codec, text, cfg);
    double seconds = 0.0;
    for (int i = 0; i < o.num_samples; i++) {
        uint64_t rng = sample_rng_seed(o.seed, i);
        auto start = std::chrono::steady_clock::now();
        std::vector<double> logprobs;
        std::vector<int> generated = generate_tokens(prompt, o.sample_tokens, cfg.max_seq_len, cfg.vocab_size, o, &rng,
                                                     next_logits, &logprobs);
        seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        std::string continuation = decode_tokens(codec, generated);
        if (o.json) {
            std::string lp = "[";
            for (size_t j = 0; j < logprobs.size(); j++) lp += strprintf("%s%.9g", j ? "," : "", logprobs[j]);
            printf("{\"sample\":%d,\"seed\":%llu,\"prompt\":%s,\"prompt_tokens\":%s,\"tokens\":%s,\"text\":%s,\"logprobs\":%s]}\n",
                   i, (unsigned long long)(o.seed + (uint64_t)i), json_quote(utf8_replace_invalid(text)).c_str(),
                   json_int_list(prompt).c_str(), json_int_list(generated).c_str(), json_quote(continuation).c_str(), lp.c_str());
        } else {
            printf("%s%s%s\n--------\n", codec.text ? text.c_str() : decode_tokens(codec, prompt).c_str(), codec.text ? "" : " | ",
                   continuation.c_str());
        }
        fflush(stdout);
    }
    long long tokens = (long long)o.num_samples * o.sample_tokens;
    fprintf(stderr, "generated %d sample%s of %d tokens after a %zu-token prompt in %.3f s: %.1f tokens/s (%s)\n",
            o.num_samples, o.num_samples == 1 ? "" : "s", o.sample_tokens, prompt.size(), seconds,
            seconds > 0 ? tokens / seconds : 0.0, path);
}
