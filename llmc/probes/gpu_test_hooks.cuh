// gpu_test_hooks.cuh — the GPU trainer's test machinery, kept off its lesson path: skip it on a
// first reading. Each piece is called from one line of train_gpt.cu.
//
// --dump-state FILE writes what the tests compare against PyTorch, the CPU trainer and the one-rank
// run (llmc/probes/state_dump.h's DumpState): the first step's first micro-batch's logits and loss, the first
// step's summed (unclipped) gradient, every step's loss, and the weights after the last step. Every
// rank takes part; rank 0 collects every rank's elements in global coordinates (process_grid.h's
// gather_to_rank0), which also checks that every copy of an element, on every rank that holds one,
// is the same to the bit: replicas that drift apart fail the dump. On several ranks that needs MPI.
//
// LLMC_TEST_FP8_STATE=<dir> (--precision fp8): every rank writes its delayed-scaling state after every
// step (fp8_test_dump_state below), so that test_fp8.py can check that data-parallel ranks agree.
//
// The other test hooks: LLMC_TEST_FAULT (a rank that hangs, exits or fails at a given step:
// llmc/probes/fault_injection.h's comm_inject_fault) and, beside what it disturbs, LLMC_TEST_PIPE_DELAY_MS
// (compute made of sleeps, to measure the pipeline bubble: llmc/parallel/pipeline_parallel.h's pipeline_test_delay).
#pragma once

#include <cstring>
#include <string>
#include <vector>
#include "llmc/kernels/fp8.cuh"
#include "llmc/parallel/comm_nccl.cuh"
#include "llmc/parallel/process_grid.h"
#include "llmc/probes/state_dump.h"
#include "llmc/parallel/zero.h"

// The dump is llmc/probes/state_dump.h's StateDump, `dump_probe`, as in the CPU trainer: the step
// keeps the first logits and loss in it (dump_keep_logits), and these collect the rest.

// After the first step's gradient sum: the logits and loss kept above, and the summed gradient where
// each rank's AdamW reads it (ZeRO-0: the whole flat array; ZeRO-1: its shard of it; ZeRO-2/3: its
// gradient shards), all on rank 0. `grads` is this rank's GB_GRADS, widened; `reports`: this rank
// holds the loss (the last stage, tensor rank 0 of data-parallel rank 0).
inline void dump_collect_first_step(StateDump* d, Comm* world, GpuComm* world_gpu, const Zero& plan, const GPT2Config& cfg,
                                    const ModelSlice& slice, size_t rows, bool reports, const std::vector<float>& grads) {
    dump_gather_logits(world, cfg, slice, plan.grid.dp_rank, d->first_logits, rows, &d->state.logits);
    d->state.loss = (float)gpu_comm_sum(world_gpu, reports ? d->first_loss : 0.0, "the first loss");
    dump_gather_runs(world, zero_state_runs(plan, slice_runs(cfg, slice), false), grads.data(), plan.stage >= 2,
                     param_layout(cfg).total, &d->state.grads, "collecting the gradients");
    d->first_step = false;
}

// After the last step: the weights (the fp32 master weights, every element from the ranks that keep
// its state, or without master weights the bf16 weights `bf16`, already collected on rank 0 and
// checked for identical copies), then rank 0 writes the file. `master` is this rank's GB_MASTER
// (null without master weights). `more`: weights that follow the dense ones (--moe-experts, one GPU:
// the MoE table's, as the CPU trainer's dump has them).
inline void dump_finish(StateDump* d, Comm* world, const Zero& plan, const GPT2Config& cfg, const ModelSlice& slice,
                        std::vector<float> bf16, const std::vector<float>* master, const std::string& path, int B, int T,
                        const std::vector<float>& more = {}) {
    if (!master) {
        d->state.params = std::move(bf16);
    } else {
        dump_gather_runs(world, zero_state_runs(plan, slice_runs(cfg, slice), false), master->data(), true,
                         param_layout(cfg).total, &d->state.params, "collecting the master weights");
    }
    if (world->rank != 0) return;
    d->state.params.insert(d->state.params.end(), more.begin(), more.end());
    write_dump_state(path, d->state, cfg, B, T, "gpu");
    printf("dumped state to %s\n", path.c_str());
}

// LLMC_TEST_FP8_STATE=<dir>: this rank's fp8 amax histories, scales and inverse scales after step `step`
// (fp8_download_state's floats), raw fp32, to <dir>/fp8_step<s>_rank<r>.f32. A no-op without it.
inline void fp8_test_dump_state(const Comm* world, int step, const Fp8Matmuls* f) {
    static const char* dir = getenv("LLMC_TEST_FP8_STATE");
    if (!dir || !*dir || !f->on) return;
    std::vector<float> values = fp8_download_state(f);
    AtomicFile out(std::string(dir) + strprintf("/fp8_step%d_rank%d.f32", step, world->rank), "fp8 state dump");
    out.write(values.data(), values.size() * sizeof(float));
    out.commit();
}
