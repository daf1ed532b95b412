// run.h — the parts of a training run that are not the model's math, written once for both trainers:
// leaving on a grid that cannot work, the validation loop, HellaSwag, the sampling loop and the
// checkpoint's files. Each trainer hands
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
#include "llmc/run/training.h"
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

// Mean loss over `batches` batches of the validation data, from its beginning. `forward` runs one
// batch and returns its mean loss (0 on a rank without the head); `world_sum` adds a number over
// all ranks (the trainer's own collective). On a model-parallel grid the last stage's tensor rank 0
// of data-parallel rank 0 reports, and every rank gets the result; otherwise the caller's own mean.
inline float evaluate_loss(DataLoader* val, int batches, const ProcessGrid& g, bool model_parallel,
                           const std::function<double(const int* inputs, const int* targets)>& forward,
                           const std::function<double(double)>& world_sum) {
    dataloader_reset(val);
    double total = 0.0;
    for (int i = 0; i < batches; i++) {
        dataloader_next_batch(val);
        total += forward(val->inputs.data(), val->targets.data());
    }
    if (!model_parallel) return (float)(total / batches);
    bool reporter = g.pp_rank == g.pp - 1 && g.tp_rank == 0 && g.dp_rank == 0;
    return (float)world_sum(reporter ? total / batches : 0.0);
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

// Generates o.sample_tokens tokens after <|endoftext|>, one forward pass per token over the last
// `window` tokens (no key/value cache: simple, and cheap enough at these sizes), and rank 0 prints
// them. `next_logits(tokens, len)` runs the forward pass on the last `len` of `tokens` and returns
// the logits of the last one, over the whole vocabulary, on rank 0 (elsewhere anything). Rank 0
// draws the token; on a model-parallel grid it tells the others.
inline void sample_and_print(const TrainOptions& o, int vocab_size, int window, bool model_parallel, Comm* world,
                             const SampleDecoder& decoder, uint64_t* rng,
                             const std::function<const float*(const std::vector<int>& tokens, int len)>& next_logits) {
    std::vector<int> tokens = {50256 < vocab_size ? 50256 : 0};
    for (int i = 0; i < o.sample_tokens; i++) {
        int len = std::min((int)tokens.size(), window);
        const float* logits = next_logits(tokens, len);
        int next = 0;
        if (world->rank == 0) next = sample_token(logits, vocab_size, o.temperature, o.top_k, rng);
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

// A checkpoint, every rank together (llmc/run/training.h: written into "<dir>.tmp", checksummed, then
// renamed into place, so a crash leaves no new checkpoint or a complete one). The files hold the
// model in global coordinates, so any grid can resume from them (read_state_runs):
//   model.bin          the weights; written by rank 0 when it holds them all (data parallelism,
//                      ZeRO-0..2), else assembled on rank 0 from every rank's
//   state.bin          ZeRO-0 data parallelism (and one rank): rank 0's optimizer state, for everything
//   state_rank<r>.bin  otherwise rank r's m and v, and weights (fp32 master weights, or the
//                      weights themselves when model.bin cannot come from rank 0 alone), for the
//                      elements it writes (zero_state_runs), as runs of the model
// What differs between the trainers is only where the bytes live, so they hand in three callbacks.
struct CheckpointParts {
    bool master_weights = false;  // the state files carry fp32 master weights beside m and v
    std::function<void(const std::string& path)> write_model_bin;     // rank 0, holding every weight
    std::function<void(TrainState* s)> fill_state;                     // this rank's share (zero_fill_state)
    std::function<void(const std::string& dir)> assemble_model_bin;   // every rank, when none holds them all
};

template <class Barrier>
inline void write_checkpoint(const ProcessGrid& g, const std::string& out_dir, int step, size_t num_params, const RunPlan& plan,
                             uint64_t sampler_rng, const LoaderPosition& train_position, const CheckpointParts& parts,
                             Barrier barrier) {
    bool leader = g.rank == 0;
    bool rank0_holds_weights = g.tp == 1 && g.pp == 1 && g.zero_stage <= 2;
    bool one_state_file = g.tp == 1 && g.pp == 1 && g.zero_stage == 0;
    std::string tmp = open_checkpoint_together(out_dir, step, g.rank, barrier);
    if (leader && rank0_holds_weights) parts.write_model_bin(tmp + "/model.bin");
    if (leader || !one_state_file) {
        TrainState s;
        s.header = train_state_header(step, num_params, ShardRange{}, g.rank, g.world, g.zero_stage, plan, sampler_rng,
                                      train_position);
        s.header.has_master_weights = parts.master_weights || !rank0_holds_weights;
        parts.fill_state(&s);
        write_train_state(tmp + "/" + (one_state_file ? std::string("state.bin") : strprintf("state_rank%d.bin", g.rank)), s);
    }
    if (!rank0_holds_weights) parts.assemble_model_bin(tmp);
    publish_checkpoint_together(out_dir, step, g.rank, barrier);
}
