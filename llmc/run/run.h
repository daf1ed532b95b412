// run.h — the parts of a training run that are not the model's math, written once for both trainers:
// leaving on a grid that cannot work, the validation loop, HellaSwag, and the sampling loop with its
// decoder. (Checkpoints are llmc/run/checkpoint.h's; the loop that calls these, llmc/run/train_loop.h's;
// the pipeline schedule's interpreter, llmc/run/schedule_run.h's.) Each trainer hands
// in its forward pass as a callback (a lambda), so the loops here see only tokens in and a loss or
// logits out, wherever the model's bytes live.
//
// On a grid whose forward pass spans several ranks (tensor or pipeline parallelism, ZeRO-3: the
// trainers call it `model_parallel`), every rank runs every forward pass, in step; the loss is on
// the last pipeline stage, and the logits are split over its tensor ranks by vocabulary rows.
// Otherwise rank 0 alone evaluates and samples.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>
#include "llmc/run/cli.h"
#include "llmc/parallel/comm.h"
#include "llmc/io/dataloader.h"
#include "llmc/run/hellaswag.h"
#include "llmc/run/metrics.h"
#include "llmc/parallel/process_grid.h"
#include "llmc/run/sampler.h"
#include "llmc/io/tokenizer.h"
#include "llmc/utils.h"
#include "llmc/parallel/zero.h"

// A grid this model or batch cannot use: every rank reaches the same verdict; rank 0 says why,
// and every rank leaves with exit code 2 (a command-line problem).
[[noreturn]] inline void grid_usage_fail(Comm* world, const std::string& why) {
    if (world->rank == 0) fprintf(stderr, "error: %s\n", why.c_str());
    fflush(stderr);
    comm_barrier(world, "stopping on a bad grid");
    comm_finalize(world);
    exit(EXIT_BAD_USAGE);
}

// The validation loss: the mean next-token loss over the split's first `windows` windows of T+1
// tokens (llmc/io/dataloader.h), the same windows whatever B is. They are scored B at a time; the
// last forward pass takes the rows that are left (with `fixed_shape`, a trainer that runs only its
// full (B, T), the rest of the rows are zeros and not counted). `losses(rows)` runs the model on the
// first `rows` rows of val->inputs and val->targets and returns their per-position losses (null on a
// rank without the head); `world_sum` adds a number over all ranks (the trainer's own collective).
// The per-position losses are summed in double, so B changes only the float rounding of the forward
// passes' order, not what is scored. On a model-parallel grid the last stage's tensor rank 0 of
// data-parallel rank 0 reports, and every rank gets the result; otherwise the caller's own mean.
inline float evaluate_loss(DataLoader* val, int64_t windows, bool fixed_shape, const ProcessGrid& g, bool model_parallel,
                           const std::function<const float*(int rows)>& losses,
                           const std::function<double(double)>& world_sum) {
    int B = val->B, T = val->T;
    WindowCursor cursor;
    double total = 0.0;
    for (int64_t first = 0; first < windows; first += B) {
        int rows = (int)std::min<int64_t>(B, windows - first);
        for (int r = 0; r < rows; r++) validation_read_window(val, &cursor, r);
        if (fixed_shape) {
            std::fill(val->inputs.begin() + (size_t)rows * T, val->inputs.end(), 0);
            std::fill(val->targets.begin() + (size_t)rows * T, val->targets.end(), 0);
        }
        const float* loss = losses(fixed_shape ? B : rows);
        if (loss) for (size_t i = 0; i < (size_t)rows * T; i++) total += loss[i];
    }
    double mean = total / ((double)windows * T);
    if (!model_parallel) return (float)mean;
    bool reporter = g.pp_rank == g.pp - 1 && g.tp_rank == 0 && g.dp_rank == 0;
    return (float)world_sum(reporter ? mean : 0.0);
}

// HellaSwag at `step`, reported by rank 0. Data parallelism: every rank scores its share of the
// examples, and the counts are summed. On a model-parallel grid every rank takes part in every
// forward pass (in batches of the training shape, which the grid was checked for) and the last
// stage's tensor rank 0 of data-parallel rank 0 reports. `losses(inputs, targets, rows, Tp)` runs
// the forward pass and returns the per-position losses, or nullptr on a stage without the head;
// `fixed_shape`: the trainer can only run its full (B, T) (llmc/run/hellaswag.h).
template <typename LossFn>
inline void hellaswag_report(const HellaSwagSet& set, int B, int T, bool fixed_shape, const ProcessGrid& g,
                             bool model_parallel, int step, MetricsLog* mlog, LossFn&& losses,
                             const std::function<double(double)>& world_sum) {
    std::vector<float> no_losses((size_t)B * T, 0.0f);  // what a stage without the head scores with (unused)
    bool split = !model_parallel;
    HellaSwagResult r = hellaswag_evaluate(set, B, T, fixed_shape, split ? g.rank : 0, split ? g.world : 1,
        [&](const int* in, const int* tg, int rows, int Tp) {
            const float* mine = losses(in, tg, rows, Tp);
            return mine ? mine : (const float*)no_losses.data();
        });
    bool reports = split || (g.pp_rank == g.pp - 1 && g.tp_rank == 0 && g.dp_rank == 0);
    for (int64_t* count : {&r.examples, &r.correct, &r.correct_sum}) *count = (int64_t)world_sum(reports ? (double)*count : 0.0);
    if (g.rank == 0) report_hellaswag(mlog, step, r);
}

// The logits of one position, collected on rank 0 of `world` from the ranks that hold a slice of
// the vocabulary (`holds`: this rank's `row` covers tokens [vocab_begin, vocab_begin + vocab_real)).
inline void collect_logits_row(Comm* world, bool holds, const ModelSlice& s, const float* row, int vocab_size,
                               std::vector<float>* out) {
    std::vector<GlobalRun> runs;
    std::vector<float> mine;
    if (holds) {
        runs.push_back({(size_t)s.vocab_begin, (size_t)s.vocab_real});
        mine.assign(row, row + s.vocab_real);
    }
    gather_to_rank0(world, runs, mine, out, (size_t)vocab_size, "collecting the logits of a sample");
}

// Samples: generated from <|endoftext|>, printed as text through GPT-2's tokenizer when its files are
// in --tokenizer DIR (scripts/get_vocab.sh puts them in data/gpt2), else as token ids.

// Samples are drawn every --sample-every steps after the first, and once more at the end. A resumed
// run samples at the same steps as an uninterrupted one (its RNG state comes from the checkpoint).
inline bool is_sample_step(const TrainOptions& o, int step) {
    return o.sample_every > 0 && step > 0 && step % o.sample_every == 0;
}

// PipeDream-2BW without the flush (llmc/parallel/pipedream_2bw.h) runs the next step's first forwards
// inside this step's list. Step `step` (from 1) drains instead (pipeline_2bw_steps' `drain`) where
// nothing may be in flight after it: every step of --pipeline-schedule 2bw-flush, the run's last step,
// a checkpoint, and the validation, HellaSwag or sample that the training loop runs before the next
// step (the loop's own conditions, asked at step + 1). Both trainers' loops ask it.
inline bool pipeline_drains_after(const TrainOptions& o, int step, int steps, bool have_val, const HellaSwagSet& hellaswag,
                                  bool evaluator) {
    return o.pipeline_schedule == "2bw-flush" || step == steps || (o.checkpoint_every > 0 && step % o.checkpoint_every == 0) ||
           (have_val && step % o.val_every == 0) || hellaswag_due(o, hellaswag, step) || (evaluator && is_sample_step(o, step));
}

// Samples print as text when the tokenizer is there, and as token ids (with a line saying why) when not.
inline void sample_decoder_init(TokenText* d, const TrainOptions& o, const GPT2Config& cfg) {
    if (o.sample_every <= 0) return;
    std::string problem = token_text_init(d, o.tokenizer_dir, cfg.vocab_size);
    if (cfg.vocab_size != GPT2_VOCAB_SIZE) {
        printf("samples: the model's vocabulary (%d) is not GPT-2's; printing token ids\n", cfg.vocab_size);
    } else if (!problem.empty()) {
        printf("samples: %s; printing token ids\n", problem.c_str());
    }
}

inline void print_sample_text(const TokenText& d, const std::vector<int>& generated) {
    printf("sample: %s\n--------\n", decode_tokens(d, generated).c_str());
    fflush(stdout);
}

// Generates o.sample_tokens tokens after <|endoftext|>, one forward pass per token over the last
// `window` tokens (no key/value cache: simple, and cheap enough at these sizes), and rank 0 prints
// them. `next_logits(tokens, len)` runs the forward pass on the last `len` of `tokens` and returns
// the logits of the last one, over the whole vocabulary, on rank 0 (elsewhere anything). Rank 0
// draws the token; on a model-parallel grid it tells the others.
inline void sample_and_print(const TrainOptions& o, int vocab_size, int window, bool model_parallel, Comm* world,
                             const TokenText& decoder, uint64_t* rng,
                             const std::function<const float*(const std::vector<int>& tokens, int len)>& next_logits) {
    std::vector<int> tokens = {50256 < vocab_size ? 50256 : 0};
    for (int i = 0; i < o.sample_tokens; i++) {
        int len = std::min((int)tokens.size(), window);
        const float* logits = next_logits(tokens, len);
        int next = 0;
        if (world->rank == 0) next = sample_token(logits, vocab_size, o.temperature, o.top_k, rng, o.top_p);
        if (model_parallel) comm_broadcast(world, &next, sizeof(int), 0, "broadcast of a sampled token");
        tokens.push_back(next);
    }
    if (world->rank == 0) print_sample_text(decoder, std::vector<int>(tokens.begin() + 1, tokens.end()));
}

// The training data, checked before the model is allocated (a shard shorter than one step is refused
// now): each data-parallel rank reads its own slice of every step. --eval-only needs none.
inline void open_training_data(DataLoader* train, const TrainOptions& o, const GPT2Config& cfg, const ProcessGrid& g) {
    if (o.eval_only) return;
    int T = o.seq_len > 0 ? std::min(o.seq_len, cfg.max_seq_len) : cfg.max_seq_len;
    dataloader_init(train, o.train_data, o.batch_size, T, g.dp_rank, g.dp, cfg.vocab_size, "training data", "--train-data");
}
