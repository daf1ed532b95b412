// step.h — the shape of one training step, the same in both trainers.
//
// train_gpt_cpu.cpp and train_gpt.cu each have a train_step() that a reader can hold side by side,
// line for line. Both take the same arguments, count steps the same way and split the work at the
// same named points:
//
//   train_step(model, par, train, plan, o, step, bad_steps)     step = 1, 2, ... (AdamW's t, the
//                                                                checkpoint's number, the step line's)
//     zero_gradients(model)                  the step's gradient starts from zero
//     forward_backward(model, par, train, plan, step)
//                                            the micro-batches, in the pipeline schedule's order:
//                                            gpt2_forward, gpt2_loss, gpt2_backward on each; returns
//                                            this rank's mean loss (the last stage's; 0 elsewhere)
//     the step's loss                        summed over the world, divided by the data-parallel ranks
//     finish_gradients(model, par)           the gradient summed over everything that shares it
//                                            (the tied embedding, sequence-parallel LayerNorms, the
//                                            data-parallel ranks); returns the global norm
//     step_is_sound -> optimizer_step(model, par, o, step, lr, norm)
//                                            clipping and AdamW on what this rank owns, then the
//                                            ranks that share weights get them
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
#pragma once

struct StepResult {
    double loss = 0.0;     // the mean over every token of the step, all ranks together
    float norm = 0.0f;     // the global norm of the summed gradient, before clipping
    float lr = 0.0f;       // the learning rate the step used
    bool applied = false;  // false when the loss or the norm was not finite and the update was skipped
};
