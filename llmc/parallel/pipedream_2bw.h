// pipedream_2bw.h — PipeDream-2BW: the gradient of a step taken on the weights one version older,
// two weight versions per stage ("double-buffered weights"). --pipeline-schedule 2bw.
//
// What it teaches. A pipeline that never flushes (PipeDream, Narayanan et al., SOSP 2019) has
// micro-batches of two optimizer steps in flight at once: stage 0 starts the forwards of step t+1
// while the last stage still runs the backwards of step t. A backward must use the weights its
// forward used (or the gradient is of no function at all), so PipeDream kept one weight version per
// micro-batch in flight: up to p versions on stage 0. PipeDream-2BW (Narayanan et al., ICML 2021,
// "Memory-Efficient Pipeline-Parallel DNN Training", section 3.1) coalesces the gradients of m >= p
// micro-batches into one update, so a new version appears only every m micro-batches, and a
// micro-batch's forward and backward on a stage are at most p - 1 <= m - 1 micro-batches apart: they
// straddle at most one version change. So two versions are enough, and the update becomes
//
//     W(t+1) = W(t) - lr * grad f(W(t-1))                      (the paper's equation, plain SGD)
//
// the gradient of step t+1 is taken on the weights one version older than those it updates. With
// AdamW the step's moments take that gradient, and its update (including the decoupled weight decay,
// lr * wd * W(t)) is applied to W(t). The paper shows this one-step delay trains to the same
// accuracy as the synchronous update (its section 3.2 and figure 6); it is not the same arithmetic:
// the test compares it with a one-rank run of the same rule, not with 1F1B.
//
// The first step has no older version: W(-1) = W(0), so step 1 is exactly the synchronous step
// (the paper's convention). A step the trainer skips (a NaN loss or norm, step_is_sound) leaves the
// weights at W(t) and, since the older copy was refreshed to W(t) too, the next step's gradient is
// taken at W(t): a skipped step collapses the two versions into one.
//
// The schedule (llmc/parallel/pipeline_schedule.h, pipeline_2bw_steps): 1F1B's steady state carried
// across the step boundary, no flush. Stage s's update of step t comes after its last backward of
// step t, and by then it already ran the first p-1-s forwards of step t+1: on W(t-1), the version
// step t+1 reads, which is the newer of the two the stage holds while step t's backwards still read
// W(t-2). Forward and backward of one micro-batch read the same version (weight stashing), labelled
// on every action of the list. What is left of the bubble: the trainer's update sums the loss and
// the gradient norm over all stages (clipping needs the global norm), a blocking meeting of the
// stages after each one's last backward; the first stage gets there p-1 backwards after the last
// one. So the last stages wait there (p-1) B per step, where 1F1B's flush costs (p-1)(F+B)
// (test_pipeline_schedule derives it on the unit clock; docs/parallelism.md measures it). The
// paper's stages update on their own and wait for no one. --pipeline-schedule 2bw-flush runs each
// step to its end instead (1F1B's list): the same arithmetic, bit for bit, and 1F1B's bubble.
//
// How, with two buffers and no third: `params` holds the newer version W(t-1) and `older` W(t-2)
// while step t runs. An action that reads the older one swaps the two element by element first
// (pipedream_2bw_read), one that reads the newer swaps them back: the lists alternate the two only in
// the step's last p-1-s forward-backward pairs, so stage s swaps at most 2(p-s) times a step, each
// a pass over its weights (a forward's work is B T times that). After the passes (pipedream_2bw_
// after_passes) params holds W(t-1) again and older takes a copy of it: W(t-2) is no longer read by
// anyone, and the optimizer then moves params to W(t) while older keeps W(t-1), the next step's older
// version, with no copy made at the update. A pipeline's last stage versions its copy of the tied
// embedding (its LM head) with the rest, in the same buffer.
//
// Memory: one more copy of the stage's parameters, 4 bytes each (the padded flat array, plus the
// last stage's copy of wte): the size table's older_weights row (llmc/memory/cpu_buffers.h), in
// --estimate. The paper's 2W against PipeDream's up to pW; with AdamW's 16 bytes a parameter here
// (weights, gradient, m, v), 2BW adds a quarter.
//
// Checkpoint: the older version is state (a resumed run that lost it would take its next gradient
// at W(t), not W(t-1)): every rank writes it, pipedream_2bw_rank<r>.bin (docs/formats.md), and a
// 2bw run resumes only from a checkpoint of a 2bw run on the same grid.
//
// Checkpoints, evaluations and samples see a drained pipeline: the step before one runs the drain
// (its list ends with 1F1B's cool-down) and the step after it the warm-up, so a checkpoint holds no
// micro-batch in flight, only the two versions, and a resumed run continues bit for bit.
//
// Hook points: none inside the layers. The schedule interpreter (llmc/run/schedule_run.h) walks
// pipeline_2bw_steps' list and calls pipedream_2bw_read before each forward and backward; step_end
// calls pipedream_2bw_after_passes after forward_backward; the optimizer is the usual one.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>
#include "llmc/utils.h"

// What 2BW does not combine with (ZeRO-2/3, tensor parallelism, MoE; on the GPU graphs, offload, fp8 without the
// flush) is rows of llmc/run/compatibility.h, checked before anything is allocated.

// The two versions of one stage: `older` holds W(t-1) of the flat parameters (params.size() floats)
// followed by that of the last stage's wte copy (lent.size() floats; empty elsewhere).
struct PipeDream2BW {
    bool on = false;
    std::vector<float> older;  // sized from the size table's older_weights row
    bool swapped = false;      // during the passes: params holds the older version, `older` the newer
};

// Step 1 has no older version: both are W(0) (after the weights were loaded and shared).
inline void pipedream_2bw_start(PipeDream2BW* v, const std::vector<float>& params, const std::vector<float>& lent) {
    if (!v->on) return;
    if (v->older.size() != params.size() + lent.size())
        fail("internal: the older weight version holds %zu floats, the stage %zu", v->older.size(), params.size() + lent.size());
    std::copy(params.begin(), params.end(), v->older.begin());
    std::copy(lent.begin(), lent.end(), v->older.begin() + (std::ptrdiff_t)params.size());
}

// Before a compute action of the step's list: the version it reads in params (the layers know only
// params). older_one: the older of the two, W(t-2) in step t (the list's label: version t - 2).
inline void pipedream_2bw_read(PipeDream2BW* v, bool older_one, std::vector<float>* params, std::vector<float>* lent) {
    if (!v->on || older_one == v->swapped) return;
    std::swap_ranges(params->begin(), params->end(), v->older.begin());
    std::swap_ranges(lent->begin(), lent->end(), v->older.begin() + (std::ptrdiff_t)params->size());
    v->swapped = older_one;
}

// After the step's passes: params holds the newer version W(t-1) again, for the optimizer to update
// into W(t), and older takes its copy: the step's forwards of step t+1 already read it, and so will
// their backwards and the rest of step t+1.
inline void pipedream_2bw_after_passes(PipeDream2BW* v, std::vector<float>* params, std::vector<float>* lent) {
    if (!v->on) return;
    pipedream_2bw_read(v, false, params, lent);
    std::copy(params->begin(), params->end(), v->older.begin());
    std::copy(lent->begin(), lent->end(), v->older.begin() + (std::ptrdiff_t)params->size());
}

// ---- the checkpoint's file: a header, then `older` (docs/formats.md)
constexpr int32_t PIPEDREAM_2BW_MAGIC = 20260126;
constexpr int32_t PIPEDREAM_2BW_VERSION = 1;

struct PipeDream2BWHeader {
    int32_t magic = PIPEDREAM_2BW_MAGIC;
    int32_t version = PIPEDREAM_2BW_VERSION;
    int32_t rank = 0, world = 0;    // the world rank that wrote it, of how many
    int64_t step = 0;               // the checkpoint's step: older is W(step - 1)
    int64_t floats = 0;             // older's length
};

inline std::string pipedream_2bw_file(const std::string& dir, int rank) {
    return dir + strprintf("/pipedream_2bw_rank%d.bin", rank);
}

inline void pipedream_2bw_save(const PipeDream2BW& v, const std::string& dir, int rank, int world, int step) {
    if (!v.on) return;
    PipeDream2BWHeader h;
    h.rank = rank, h.world = world, h.step = step, h.floats = (int64_t)v.older.size();
    AtomicFile out(pipedream_2bw_file(dir, rank), "PipeDream-2BW older-weights file");
    out.write(&h, sizeof(h));
    out.write(v.older.data(), v.older.size() * sizeof(float));
    out.commit();
}

// Resuming: the older version is read back, so the next step's gradient is taken at W(t-1) as in the
// run that wrote it. A checkpoint without it (a run of another schedule), or of another grid, is
// refused: starting both versions at W(t) would silently change the run.
inline void pipedream_2bw_load(PipeDream2BW* v, const std::string& dir, int rank, int world, int64_t step) {
    if (!v->on) return;
    std::string path = pipedream_2bw_file(dir, rank);
    if (!file_exists(path))
        fail("checkpoint '%s' has no older weight version (%s): it was not written by a --pipeline-schedule 2bw run; resume it "
             "with the schedule that wrote it", dir.c_str(), path.c_str());
    FILE* f = open_for_reading(path, "PipeDream-2BW older-weights file");
    PipeDream2BWHeader h;
    read_exactly(f, &h, sizeof(h), path, "PipeDream-2BW older-weights file");
    if (h.magic != PIPEDREAM_2BW_MAGIC || h.version != PIPEDREAM_2BW_VERSION)
        fail("'%s' is not a PipeDream-2BW older-weights file of version %d: resume from a checkpoint written by this program",
             path.c_str(), PIPEDREAM_2BW_VERSION);
    if (h.world != world || h.rank != rank || h.floats != (int64_t)v->older.size() || h.step != step)
        fail("'%s' holds rank %d of %d's older weights (%lld floats, step %lld), this is rank %d of %d (%zu floats, step %lld): "
             "resume a --pipeline-schedule 2bw checkpoint on the grid that wrote it", path.c_str(), h.rank, h.world,
             (long long)h.floats, (long long)h.step, rank, world, v->older.size(), (long long)step);
    read_exactly(f, v->older.data(), v->older.size() * sizeof(float), path, "PipeDream-2BW older-weights file");
    fclose(f);
}
