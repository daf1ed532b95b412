// step.h — one training step, the same in both trainers: its shape, its result, the verdict on a
// step that went wrong, and its one line.
//
// train_gpt_cpu.cpp and train_gpt.cu each have a train_step() that a reader can hold side by side,
// line for line. Both take the same arguments, count steps the same way and split the work at the
// same named points:
//
//   train_step(model, par, train, plan, o, step, bad_steps)     step = 1, 2, ... (AdamW's t, the
//                                                                checkpoint's number, the step line's)
//     step_begin                  the step's own state: fp16's loss scale S (GPU), MoE's statistics
//     zero_gradients              the step's gradient starts from zero
//     forward_backward            the micro-batches: gpt2_forward, gpt2_loss, gpt2_backward on each, in
//                                 the pipeline schedule's order (llmc/run/schedule_run.h walks it for
//                                 both trainers); returns this rank's mean loss (the last stage's)
//     step_end                    after the passes: PipeDream-2BW's weight versions, MoE's routing
//                                 statistics over the ranks, fp8's amax history (GPU)
//     the step's loss             summed over the world, divided by the data-parallel ranks
//     finish_gradients            each gradient group summed over everything that shares it, then its
//                                 share of the global norm; returns the norm
//     step_is_sound -> optimizer_step
//                                 clipping and each parameter group's optimizer on what this rank
//                                 owns, then share_updated_weights
//
// THE HOOKS. Every technique other than the plain one-device step enters at one of these points. The
// core calls each in one line, with a comment naming what fills it; each does the plain thing when no
// technique is on, and which implementation runs is decided once from the run's flags (a switch, or a
// table of function pointers, in the technique's file), never by a class hierarchy. The names are the
// same in both trainers, except the step's groups (the GPU's tables / the CPU's per-group functions):
//
//   per layer, in the passes
//     unit_weights, release_unit_weights    the layer's weights: a view of the flat array, or ZeRO-3's
//                                           all-gather and free (llmc/parallel/zero.h, zero.cuh). The CPU
//                                           asks by layer (layer_weights, layer_grads: ZeRO's units stay
//                                           in the hook); the GPU by ZeRO's unit, naming the next to prefetch
//     layer_rows                            where the layer's activations live: --recompute's one-layer
//                                           scratch (llmc/model/recompute.h), a pipeline's micro-batch
//                                           slot, interleaved 1F1B's chunk
//     linear_forward, linear_backward       a matmul: bf16 or fp8 (llmc/kernels/fp8.cuh); tensor and
//                                           sequence parallelism's cut with its gather or sum
//                                           (llmc/parallel/tensor_parallel.h, .cuh); ZB-H1's deferred
//                                           weight gradient (llmc/model/zero_bubble_backward.h, .cuh)
//     mlp_forward, mlp_backward             the dense GELU MLP, or a mixture of experts' block
//                                           (llmc/model/moe_step.h, moe_gpu.cuh) with expert
//                                           parallelism's exchange (llmc/parallel/expert_parallel.h, .cuh)
//     keep_for_backward, recall_for_backward   what the layer keeps for its backward: the narrower stash
//                                           (llmc/memory/stash_precision.h, .cuh), recompute's rebuild
//     unit_grads, unit_grads_done           (CPU: layer_grads, layer_grads_done) the layer's gradient: ZeRO-2/3's bucket, reduce-scattered
//                                           when the unit is done (ZeRO only; the rest is a group's)
//   per step
//     gradient groups                       the dense table and the MoE table, each with its sum (the
//                                           all-reduce, ZeRO's reduce-scatter, PowerSGD or bf16 sums:
//                                           llmc/parallel/grad_compression.h; the parameter server) and
//                                           its share of the norm. GPU: gradient_groups() -> GradientGroup
//                                           {sum, norm_share, share}; CPU: sum_gradient_group,
//                                           add_gradient_squares
//     parameter groups                      each group's optimizer: AdamW with fp32 or bf16 moments
//                                           (llmc/optim/adamw*.h, .cuh), Adafactor, SM3, the offloads
//                                           (llmc/optim/offload.cuh, disk_offload.h). GPU: param_groups()
//                                           -> ParamGroupUpdate; CPU: group_optimizer() -> GroupUpdate
//     share_updated_weights                 ZeRO's all-gather, the pipeline's tied wte, PowerSGD's commit,
//                                           the parameter server's send
//
// One fused path crosses two hooks: the GELU in cuBLASLt's matmul epilogue (GPU) is taken only when the
// linear is bf16 (not fp8) and --recompute 0 keeps GELU's output; mlp_forward says so where it chooses.
// Test and measurement probes (--dump-state, --trace, --profile, fault injection) are one line each,
// their code in llmc/probes/.
//
// and return the same StepResult. The learning rate is the schedule's for the steps already taken
// (llmc/optim/schedule.h counts from 0: step n runs at learning_rate(n - 1)). Test probes
// (--dump-state) are not in these signatures: the step reports to llmc/probes/state_dump.h's
// dump_probe, set up once in main.
//
// Below forward_backward the passes' own arguments differ only where the memory does: the CPU's
// gpt2_forward/gpt2_loss/gpt2_backward take the tokens and the shape (B, T) of each call, since it
// also runs smaller forwards (a sample's window); the GPU's read the micro-batch uploaded into the
// activation slot m->slot and always run the (B, T) they were planned for (one cuBLASLt/cuDNN plan
// per shape), and its gpt2_loss also writes the logits' gradient in the same kernel.
//
// What both trainers then do with a step's loss and norm is here too: whether its update may be
// applied (a step that went wrong is skipped, and too many in a row stop the run before a
// checkpoint could save bad weights), and its one printed line, whose MFU is measured against the
// GPU's peak from the table below; the same in both, so that their logs read alike and scripts
// parse either.
#pragma once

#include <chrono>
#include <cstdint>
#include <cmath>
#include <cstdio>
#include <string>
#include "llmc/utils.h"

struct StepResult {
    double loss = 0.0;     // the mean over every token of the step, all ranks together
    float norm = 0.0f;     // the global norm of the summed gradient, before clipping
    float lr = 0.0f;       // the learning rate the step used
    bool applied = false;  // false when the loss or the norm was not finite and the update was skipped
    float loss_scale = 1.0f;  // the S of this step's backward (fp16, llmc/optim/loss_scaler.h; 1 otherwise)
};

// ----------------------------------------------------------------------------------------------
// A step that went wrong

// A loss or gradient norm that is not finite (an overflow in one micro-batch, a learning rate far too
// high) would write NaN into every weight the update touches, and the next checkpoint would save
// them: a run that cannot be resumed. So such a step's update is skipped: the weights and AdamW's
// state stay those of the last sound step, and the step counts as done (the schedule and the data
// move on, as they would have). One bad batch is survived; --max-bad-steps in a row (default 3) mean
// the run has diverged, and it stops, naming the step, before a checkpoint could be written from bad
// weights. Every rank sees the same all-reduced loss and norm, so every rank decides the same.
// AdamW's t is part of that state: it counts the updates applied, so a skipped step leaves it too (as
// PyTorch's GradScaler skips optimizer.step()), and the count of skipped steps goes into checkpoints.
struct BadSteps {
    int in_a_row = 0;
    int skipped = 0;  // updates skipped in the whole run (a resumed run starts from its checkpoint's)
};

// AdamW's t for step `step` (and the factored optimizers' step count): the updates applied, this one
// included: the step, less the skipped ones, less fp16's overflow skips (llmc/optim/loss_scaler.h).
inline int optimizer_t(int step, const BadSteps& b, int64_t overflows = 0) { return (int)(step - b.skipped - overflows); }

// Whether to apply this step's update (`step` counts from 1); prints a line when skipping (`leader`),
// fails when the run has diverged.
inline bool step_is_sound(BadSteps* b, int step, double loss, float norm, int max_bad_steps, bool leader) {
    if (std::isfinite(loss) && std::isfinite(norm)) {
        b->in_a_row = 0;
        return true;
    }
    b->in_a_row++;
    b->skipped++;
    if (b->in_a_row >= max_bad_steps) {
        fail("step %d: the loss is %g and the gradient norm %g, %d step%s in a row (--max-bad-steps %d): training diverged; "
             "stopped before any update or checkpoint from non-finite values. Lower --lr, raise --warmup-steps, or check "
             "--grad-clip", step, loss, (double)norm, b->in_a_row, b->in_a_row == 1 ? "" : "s", max_bad_steps);
    }
    if (leader) {
        printf("step %d: the loss is %g and the gradient norm %g: update skipped, the weights are kept (%d of --max-bad-steps %d "
               "in a row)\n", step, loss, (double)norm, b->in_a_row, max_bad_steps);
    }
    return false;
}

// ----------------------------------------------------------------------------------------------
// Reporting

inline double seconds_since(std::chrono::steady_clock::time_point start) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// "step    3/10 | loss 10.951200 | lr 1.00e-04 | norm 1.2345[ | scale 65536] | 812.3 ms | 315 tok/s[ | MFU 48.1% | ETA 1h02m]"
// (scripts parse "<number> ms" and "<number> tok/s" from this line). The scale: fp16's loss scale,
// when `loss_scale` > 0; `extra` ends the line with a technique's own numbers (--moe-experts').
inline void print_step_line(int step, int steps, double loss, float lr, float norm, double seconds, int64_t tokens,
                            double mfu_percent, double eta_seconds, float loss_scale = 0.0f,
                            const std::string& extra = "") {
    printf("step %5d/%d | loss %.6f | lr %.2e | norm %.4f", step, steps, loss, lr, norm);
    if (loss_scale > 0) printf(" | scale %.0f", (double)loss_scale);  // a power of two >= 1: exact
    printf(" | %.1f ms | %.0f tok/s", seconds * 1e3, tokens / seconds);
    if (mfu_percent >= 0) printf(" | MFU %.1f%%", mfu_percent);
    if (eta_seconds >= 0) {
        int s = (int)eta_seconds;
        if (s >= 3600) printf(" | ETA %dh%02dm", s / 3600, (s % 3600) / 60);
        else printf(" | ETA %dm%02ds", s / 60, s % 60);
    }
    printf("%s\n", extra.c_str());  // a technique's own numbers (--moe-experts: its auxiliary losses and loads)
    fflush(stdout);
}

// Dense bf16 tensor-core peak of the GPUs we know, in TFLOP/s, by CUDA device name (0 = unknown):
// the denominator of MFU. "H100 80GB HBM3" is the SXM part.
inline double gpu_peak_bf16_tflops(const std::string& name) {
    auto has = [&](const char* s) { return name.find(s) != std::string::npos; };
    if (has("H200")) return 989.0;
    if (has("H100") && has("PCIe")) return 756.0;
    if (has("H100") && (has("SXM") || has("HBM3"))) return 989.0;
    if (has("A100")) return 312.0;
    return 0.0;
}
