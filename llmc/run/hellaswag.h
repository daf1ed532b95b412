// hellaswag.h — HellaSwag: can the model tell how a situation continues? Shared by both trainers.
//
// An example is a context and four endings, one of them right ("A man is sitting on a roof. he" ->
// "starts pulling up roofing on a roof."). A language model answers without any training for the
// task: it scores each ending by how surprised it is to read it after the context, and picks the
// least surprising. With the context's tokens c and an ending's tokens e_1..e_n,
//     loss(ending) = -1/n * sum_i log p(e_i | c, e_1..e_{i-1})      (the mean token loss)
//     prediction   = argmin over the four endings of loss(ending)
// accuracy = the fraction of examples where the prediction is the label. Chance is 25%: the
// endings are written to fool models that match surface statistics, so small models score little
// above it and the number climbs slowly with scale and training tokens.
//
// Two flavours, both reported:
//   acc      by the MEAN token loss (above): the headline number. llm.c calls it "acc_norm".
//   acc_sum  by the SUMMED token loss (the ending's total log-likelihood): it favours short
//            endings, since every token can only add loss. llm.c calls it "acc".
// (lm-evaluation-harness's "acc_norm" divides by the ending's length in bytes instead: close, not
// identical.)
//
// The file is JSON Lines, one example per line, as the original dataset ships it:
//   {"ctx": "...", "endings": ["...", "...", "...", "..."], "label": 3, ...}
// Other fields are ignored. Without "ctx", the context is "ctx_a" + " " + "ctx_b" (the dataset's
// two halves). "label" is an integer or a string holding one ("3"), as some copies store it.
// Tokens: the context is encoded as is, each ending with a leading space (" " + ending), as the
// reference evaluations do: the ending is a continuation of the sentence, and GPT-2's vocabulary
// folds the space into the next word's token.
//
// Batching: an example is four rows, context + ending each; rows are packed B at a time into the
// trainer's micro-batch (B = 4 runs one example per forward pass). Attention is causal, so the
// padding after a short row never changes its losses. A row longer than T + 1 tokens loses context
// tokens from the left. With several ranks, rank r evaluates examples r, r + world, ...; the
// trainer sums the counts.
#pragma once

#include <array>
#include <string>
#include <vector>
#include "llmc/run/cli.h"
#include "llmc/io/json.h"
#include "llmc/run/metrics.h"
#include "llmc/model/model.h"
#include "llmc/io/tokenizer.h"
#include "llmc/utils.h"

constexpr int HELLASWAG_ENDINGS = 4;

struct HellaSwagExample {
    std::vector<int> context;
    std::array<std::vector<int>, HELLASWAG_ENDINGS> endings;
    int label = 0;
};

struct HellaSwagSet {
    std::string path;
    std::vector<HellaSwagExample> examples;
    int truncated = 0;   // examples whose context was cut to fit the sequence length
};

// ----------------------------------------------------------------------------------------------
// Reading the file

// Parses one line into text fields; returns "" or what is wrong with it.
inline std::string hellaswag_parse_line(const std::string& line, std::string* context, std::array<std::string, 4>* endings,
                                        int* label) {
    JsonValue v;
    std::string error;
    if (!json_parse(line, &v, &error)) {
        if (error.rfind("line 1, ", 0) == 0) error = error.substr(8);
        return "not valid JSON (" + error + ")";
    }
    if (!v.is_object()) return std::string("expected a JSON object, found ") + json_type_name(v.type);
    const JsonValue* ctx = v.find("ctx");
    if (ctx) {
        if (!ctx->is_string()) return std::string("\"ctx\" must be a string, found ") + json_type_name(ctx->type);
        *context = ctx->string;
    } else {
        const JsonValue* a = v.find("ctx_a");
        const JsonValue* b = v.find("ctx_b");
        if (!a || !a->is_string()) return "no \"ctx\" (the context) and no \"ctx_a\" string to build it from";
        *context = a->string;
        if (b && b->is_string() && !b->string.empty()) *context += " " + b->string;
    }
    const JsonValue* ends = v.find("endings");
    if (!ends || !ends->is_array()) return "no \"endings\" array";
    if (ends->array.size() != HELLASWAG_ENDINGS) {
        return strprintf("\"endings\" has %zu entries; an example needs exactly %d", ends->array.size(), HELLASWAG_ENDINGS);
    }
    for (int i = 0; i < HELLASWAG_ENDINGS; i++) {
        if (!ends->array[i].is_string()) return strprintf("ending %d is not a string", i);
        (*endings)[i] = ends->array[i].string;
    }
    const JsonValue* lab = v.find("label");
    long long value = -1;
    if (!lab || (lab->is_string() && lab->string.empty())) {
        return "no \"label\" (the test split hides its labels: evaluate on the validation split)";
    } else if (lab->is_number() && lab->is_integer) {
        value = lab->integer;
    } else if (lab->is_string() && lab->string.find_first_not_of("0123456789") == std::string::npos &&
               lab->string.size() < 10) {
        value = atoll(lab->string.c_str());
    } else {
        return "\"label\" must be an integer (the index of the right ending)";
    }
    if (value < 0 || value >= HELLASWAG_ENDINGS) {
        return strprintf("\"label\" is %lld; it must be 0, 1, 2 or 3 (the index of the right ending)", value);
    }
    *label = (int)value;
    return "";
}

// Reads and tokenizes every example. Rows must fit T + 1 tokens (T inputs and T targets): longer
// contexts are cut from the left. Every error names the file and the line.
inline HellaSwagSet hellaswag_load(const std::string& path, const Tokenizer& tokenizer, int T) {
    HellaSwagSet set;
    set.path = path;
    std::vector<char> bytes = read_whole_file(path, "HellaSwag file");
    std::string text(bytes.begin(), bytes.end());
    int line_number = 0;
    for (size_t start = 0; start < text.size();) {
        size_t end = text.find('\n', start);
        if (end == std::string::npos) end = text.size();
        std::string line = text.substr(start, end - start);
        start = end + 1;
        line_number++;
        if (line.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank lines are allowed
        std::string context;
        std::array<std::string, 4> endings;
        HellaSwagExample ex;
        std::string problem = hellaswag_parse_line(line, &context, &endings, &ex.label);
        if (!problem.empty()) fail("HellaSwag file '%s', line %d: %s", path.c_str(), line_number, problem.c_str());
        ex.context = tokenizer.encode(context);
        if (ex.context.empty()) fail("HellaSwag file '%s', line %d: the context is empty", path.c_str(), line_number);
        size_t longest = 0;
        for (int i = 0; i < HELLASWAG_ENDINGS; i++) {
            ex.endings[i] = tokenizer.encode(" " + endings[i]);
            longest = std::max(longest, ex.endings[i].size());
        }
        if (longest >= (size_t)T) {
            fail("HellaSwag file '%s', line %d: an ending of %zu tokens does not fit the sequence length %d; "
                 "evaluate with a longer --seq-len", path.c_str(), line_number, longest, T);
        }
        if (ex.context.size() + longest > (size_t)T + 1) {  // keep the last context tokens, those nearest the ending
            ex.context.erase(ex.context.begin(), ex.context.end() - (T + 1 - longest));
            set.truncated++;
        }
        set.examples.push_back(std::move(ex));
    }
    if (set.examples.empty()) fail("HellaSwag file '%s' has no examples", path.c_str());
    return set;
}

// What a trainer calls at start: loads GPT-2's tokenizer from --tokenizer and the --hellaswag file
// (an empty set when there is no --hellaswag). T is the sequence length the model will run at;
// every rank loads the set (each evaluates its share), the leader says so.
inline HellaSwagSet hellaswag_open(const TrainOptions& o, const GPT2Config& cfg, int T, bool leader) {
    if (o.hellaswag.empty()) return HellaSwagSet();
    Tokenizer tokenizer;
    std::string error;
    if (!tokenizer.load(o.tokenizer_dir + "/encoder.json", o.tokenizer_dir + "/vocab.bpe", &error)) {
        fail("--hellaswag needs the tokenizer the model was trained with, in --tokenizer '%s': %s",
             o.tokenizer_dir.c_str(), error.c_str());
    }
    if (tokenizer.vocab_size > cfg.vocab_size) {
        fail("--hellaswag: the tokenizer in '%s' has %d tokens, more than the model's vocabulary of %d: pass the "
             "tokenizer the model was trained with (--tokenizer DIR)", o.tokenizer_dir.c_str(), tokenizer.vocab_size,
             cfg.vocab_size);
    }
    HellaSwagSet set = hellaswag_load(o.hellaswag, tokenizer, T);
    if (!leader) return set;
    printf("hellaswag: %zu examples from %s", set.examples.size(), o.hellaswag.c_str());
    if (set.truncated) printf(" (%d with their context cut to fit T=%d)", set.truncated, T);
    printf("\n");
    return set;
}

// ----------------------------------------------------------------------------------------------
// Scoring

struct HellaSwagResult {
    int64_t examples = 0, correct = 0, correct_sum = 0;  // correct: by mean token loss; correct_sum: by summed loss
};

// Evaluates this rank's share of the examples. `losses(inputs, targets, rows, Tp)` runs the model on
// `rows` rows of Tp tokens (row-major) and returns the per-position losses (rows x Tp). With
// `fixed_shape` the trainer can only run its full (B, T) (the GPU's plans are built for one shape):
// every call gets B rows of T tokens, unused ones zero. Otherwise (CPU) it gets just the rows in
// use, cut to the longest of them.
template <typename LossFn>
inline HellaSwagResult hellaswag_evaluate(const HellaSwagSet& set, int B, int T, bool fixed_shape, int rank, int world,
                                          LossFn&& losses) {
    struct Row { int example, ending; };
    std::vector<Row> rows;
    for (int e = rank; e < (int)set.examples.size(); e += world)
        for (int k = 0; k < HELLASWAG_ENDINGS; k++) rows.push_back({e, k});
    std::vector<double> sum((size_t)rows.size(), 0.0), mean((size_t)rows.size(), 0.0);
    ProgressBar bar;
    progress_begin(&bar, "hellaswag", rank == 0 ? (int64_t)rows.size() / HELLASWAG_ENDINGS : 0);
    std::vector<int> inputs, targets;
    for (size_t first = 0; first < rows.size(); first += B) {
        size_t count = std::min(rows.size() - first, (size_t)B);
        int Tp = 0;
        for (size_t r = 0; r < count; r++) {
            const HellaSwagExample& ex = set.examples[rows[first + r].example];
            Tp = std::max(Tp, (int)(ex.context.size() + ex.endings[rows[first + r].ending].size()) - 1);
        }
        int batch_rows = fixed_shape ? B : (int)count;
        if (fixed_shape) Tp = T;
        inputs.assign((size_t)batch_rows * Tp, 0);
        targets.assign((size_t)batch_rows * Tp, 0);
        for (size_t r = 0; r < count; r++) {  // row = context + ending; inputs are its tokens, targets the next ones
            const HellaSwagExample& ex = set.examples[rows[first + r].example];
            std::vector<int> tokens = ex.context;
            const std::vector<int>& ending = ex.endings[rows[first + r].ending];
            tokens.insert(tokens.end(), ending.begin(), ending.end());
            for (size_t t = 0; t + 1 < tokens.size(); t++) {
                inputs[r * Tp + t] = tokens[t];
                targets[r * Tp + t] = tokens[t + 1];
            }
        }
        const float* loss = losses(inputs.data(), targets.data(), batch_rows, Tp);
        for (size_t r = 0; r < count; r++) {  // the ending's tokens are predicted at positions ctx-1 .. ctx+n-2
            const HellaSwagExample& ex = set.examples[rows[first + r].example];
            size_t n = ex.endings[rows[first + r].ending].size(), from = ex.context.size() - 1;
            double s = 0.0;
            for (size_t t = from; t < from + n; t++) s += loss[r * Tp + t];
            sum[first + r] = s;
            mean[first + r] = s / (double)n;
        }
        progress_update(&bar, (int64_t)(first + count) / HELLASWAG_ENDINGS);
    }
    progress_end(&bar);
    HellaSwagResult result;
    for (size_t r = 0; r < rows.size(); r += HELLASWAG_ENDINGS) {
        int best = 0, best_sum = 0;
        for (int k = 1; k < HELLASWAG_ENDINGS; k++) {
            if (mean[r + k] < mean[r + best]) best = k;
            if (sum[r + k] < sum[r + best_sum]) best_sum = k;
        }
        int label = set.examples[rows[r].example].label;
        result.examples++;
        result.correct += best == label;
        result.correct_sum += best_sum == label;
    }
    return result;
}

// Prints and logs the result of all ranks together (rank 0).
inline void report_hellaswag(MetricsLog* log, int step, const HellaSwagResult& r) {
    double acc = (double)r.correct / r.examples, acc_sum = (double)r.correct_sum / r.examples;
    printf("step %5d | hellaswag %.2f%% (%lld/%lld, by mean token loss; %.2f%% by summed loss)\n", step, 100 * acc,
           (long long)r.correct, (long long)r.examples, 100 * acc_sum);
    fflush(stdout);
    log->last_hellaswag = acc;
    metrics_write_line(log, strprintf("{\"type\":\"hellaswag\",\"step\":%d,\"tokens\":%lld,\"acc\":%s,\"acc_sum\":%s,"
                                      "\"correct\":%lld,\"examples\":%lld}", step, (long long)(step * log->tokens_per_step),
                                      json_number(acc).c_str(), json_number(acc_sum).c_str(), (long long)r.correct,
                                      (long long)r.examples));
}

// During training: every --hellaswag-every steps (the final evaluation after the last step is separate).
inline bool hellaswag_due(const TrainOptions& o, const HellaSwagSet& set, int step) {
    return !set.examples.empty() && o.hellaswag_every > 0 && step % o.hellaswag_every == 0;
}
