// pipeline_parallel.cuh — pipeline stages on GPUs: activations and their gradients sent between
// neighbouring stages with NCCL (or through host memory), the tied embedding's exchange, and the
// busy time that measures the bubble.
//
// Read llmc/parallel/pipeline_parallel.h first: the bubble (p-1)/(m+p-1), why every stage runs its
// backward passes in micro-batch order, the tied embedding; and llmc/parallel/pipeline_schedule.h:
// each stage's list of actions. The schedule interpreter (llmc/run/schedule_run.h's run_schedule)
// walks that list for both trainers; this file moves the bytes. A run of sends and receives between two
// compute actions is one NCCL group, issued at the run's end (pipe_flush): GPipe's and 1F1B's runs
// hold at most one receive, interleaved 1F1B's two, and both must be posted before either is waited
// for (pipeline_schedule.h's pipe_group_ends says why).
//
// The difficulty is NCCL's sends. An NCCL send is a kernel on a stream that completes only when the
// peer receives, and the next operation on that stream waits for it. In 1F1B's steady state stage
// s sends the activation of micro-batch j to s+1 and then receives the gradient of micro-batch i
// from s+1, while s+1 sends that gradient and then receives that activation: each send waits for a
// receive queued behind the other's send, forever.
//
// The cure is Megatron's: a send and the receive that follows it go into ONE NCCL group, and the
// two progress together. Here a send is DEFERRED (pipe_send queues it) until the next receive
// (pipe_recv issues both, grouped), or, when the schedule's next action receives nothing (stage 0's
// forward passes, the last stage's backward passes), issued alone at once (pipe_flush). In the
// steady state that pairs "send activation j, receive gradient i" on one side with "send gradient
// i, receive activation j" on the other: a swap between neighbours. In the warm-up and the drain
// the groups chain in one direction only (forwards towards the last stage, gradients towards the
// first), which ends at a stage that only receives, so no cycle of waits can form.
//
// Host staging (MPI) takes the same path, and waits for its sends where NCCL's would complete.
// MPI's non-blocking send would not deadlock, but it moves a message larger than its eager limit
// only while the SENDER is inside an MPI call (Open MPI has no progress thread), so a send left in
// flight while the stage computes arrives one action late, and late again at every stage: on an
// H200 with 2 host-staged ranks, GPipe's bubble measured 50% against the predicted 20%, 1F1B's 29%
// (2026-11-26). Paired with the next receive, or waited for alone, the send progresses while the
// peer is there to take it.
//
// Buffers in flight. A stage keeps the activations of several micro-batches (a "slot" each,
// pipeline_live_micro_batches). A slot's sends must have completed before the next micro-batch
// overwrites it: an event per slot, recorded after its sends; the host waits for it
// (pipe_wait_slot). Host staging has received every send before the receive or flush that issued
// it returns, so its slots are always free.
//
// Cost per step, stage s of p with m micro-batches, R rows (B*T, or B*T/t with sequence
// parallelism) of C channels, bf16: m * R * C * 2 bytes to s+1 (activations) and as many to s-1
// (gradients); the first and last stages also Vp/t * C * 2 bytes of the tied embedding each way.
// The busy time (the compute stream synchronised after every action) against the schedule's wall
// time gives the measured bubble.
#pragma once

#include <vector>
#include "llmc/parallel/comm_nccl.cuh"
#include "llmc/kernels/cuda_common.cuh"
#include "llmc/parallel/pipeline_parallel.h"

struct PipelineGpu {
    GpuComm* comm = nullptr;             // the pipeline group: its ranks are the stages
    int stage = 0, stages = 1;
    PipelineSchedule schedule = PipelineSchedule::OneFOneB;
    struct Send {
        const void* data;
        size_t bytes;
        int peer, tag, slot;
    };
    std::vector<Send> deferred;          // NCCL: sends waiting to be issued with the next receive
    struct Recv {
        void* data;
        size_t bytes;
        int peer, tag;
    };
    std::vector<Recv> receives;          // the run's receives, issued with its sends at its end
    PipeSlots slots;                     // which activation slot each (micro-batch, chunk) holds (pipeline_parallel.h)
    std::vector<int> tokens;             // interleaved: each micro-batch's inputs and targets, for its chunks after 0
    std::vector<GpuStagedSend> staged;   // host staging: sends in flight (their host copies)
    std::vector<cudaEvent_t> slot_sent;  // NCCL: per activation slot, recorded after its last send
    cudaEvent_t ready = nullptr;         // compute stream -> pipeline stream
    double busy_seconds = 0, schedule_seconds = 0;  // all steps: computing / running the schedule
};

inline void pipe_gpu_init(PipelineGpu* pipe, GpuComm* comm, int stage, int stages, PipelineSchedule schedule, int slots) {
    pipe->comm = comm;
    pipe->stage = stage;
    pipe->stages = stages;
    pipe->schedule = schedule;
    pipe->slot_sent.assign((size_t)slots, nullptr);
    for (cudaEvent_t& e : pipe->slot_sent) CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&pipe->ready, cudaEventDisableTiming));
}

inline void pipe_gpu_destroy(PipelineGpu* pipe) {
    for (cudaEvent_t e : pipe->slot_sent) CUDA_CHECK(cudaEventDestroy(e));
    pipe->slot_sent.clear();
    if (pipe->ready) CUDA_CHECK(cudaEventDestroy(pipe->ready));
    pipe->ready = nullptr;
}

inline void pipe_follow(PipelineGpu* pipe, cudaStream_t compute) {
    CUDA_CHECK(cudaEventRecord(pipe->ready, compute));
    CUDA_CHECK(cudaStreamWaitEvent(pipe->comm->stream, pipe->ready, 0));
}

// Issues the deferred sends (NCCL, inside the caller's group) and marks their slots.
inline void pipe_issue_deferred(PipelineGpu* pipe) {
    for (const PipelineGpu::Send& s : pipe->deferred)
        gpu_send(pipe->comm, s.data, s.bytes, s.peer, s.tag, &pipe->staged, "sending to a neighbouring pipeline stage");
}
inline void pipe_mark_slots(PipelineGpu* pipe) {
    for (const PipelineGpu::Send& s : pipe->deferred) CUDA_CHECK(cudaEventRecord(pipe->slot_sent[(size_t)s.slot], pipe->comm->stream));
    pipe->deferred.clear();
}

// Sends `bytes` of slot `slot`'s `data` (written by the compute stream) to stage `peer`, with the
// next pipe_recv or pipe_flush.
inline void pipe_send(PipelineGpu* pipe, const void* data, size_t bytes, int peer, int tag, int slot, cudaStream_t compute) {
    pipe->deferred.push_back({data, bytes, peer, tag, slot});
}

// Receives `bytes` from stage `peer` into `data` at the end of the run (pipe_flush), with its other
// receives and its sends, in one NCCL group.
inline void pipe_recv_later(PipelineGpu* pipe, void* data, size_t bytes, int peer, int tag) {
    pipe->receives.push_back({data, bytes, peer, tag});
}

// The end of a run: the deferred sends and the run's receives, now, in one group; returns when the
// receives are there (and, host-staged, the sends received: MPI moves them while we wait).
inline void pipe_flush(PipelineGpu* pipe, cudaStream_t compute) {
    if (pipe->stages == 1 || (pipe->deferred.empty() && pipe->receives.empty())) return;
    const char* what = "sending to and receiving from the neighbouring pipeline stages";
    pipe_follow(pipe, compute);
    gpu_group_begin(pipe->comm, what);
    pipe_issue_deferred(pipe);  // (host staging: all the sends are on their way before any receive blocks)
    for (const PipelineGpu::Recv& r : pipe->receives) gpu_recv(pipe->comm, r.data, r.bytes, r.peer, r.tag, what);
    gpu_group_end(pipe->comm, what);
    pipe_mark_slots(pipe);
    bool received = !pipe->receives.empty();
    pipe->receives.clear();
    if (pipe->comm->host_staged) gpu_wait_sends(pipe->comm, &pipe->staged);
    else if (received) gpu_comm_wait(pipe->comm, what);
}

// Receives `bytes` from stage `peer` into `data` now; returns when they are there. The deferred sends
// go with it, in one NCCL group (the tied embedding, evaluation: one receive at a time).
inline void pipe_recv(PipelineGpu* pipe, void* data, size_t bytes, int peer, int tag, cudaStream_t compute) {
    const char* what = "receiving from a neighbouring pipeline stage";
    pipe_follow(pipe, compute);
    gpu_group_begin(pipe->comm, what);
    pipe_issue_deferred(pipe);
    gpu_recv(pipe->comm, data, bytes, peer, tag, what);  // host staging: MPI moves the sends meanwhile
    gpu_group_end(pipe->comm, what);
    pipe_mark_slots(pipe);
    if (pipe->comm->host_staged) gpu_wait_sends(pipe->comm, &pipe->staged);
    else gpu_comm_wait(pipe->comm, what);
}

// Before slot `slot` is overwritten: its earlier sends have been received.
inline void pipe_wait_slot(PipelineGpu* pipe, int slot) {
    if (pipe->stages > 1 && !pipe->comm->host_staged) gpu_comm_wait_event(pipe->comm, pipe->slot_sent[(size_t)slot], "a pipeline send in flight");
}

// The end of a step's schedule: every send issued and received.
inline void pipe_finish(PipelineGpu* pipe, cudaStream_t compute) {
    if (pipe->stages == 1) return;
    pipe_flush(pipe, compute);
    if (pipe->comm->host_staged) gpu_wait_sends(pipe->comm, &pipe->staged);
    else gpu_comm_wait(pipe->comm, "the last pipeline sends of the step");
}

// ----------------------------------------------------------------------------------------------
// The tied embedding (llmc/parallel/pipeline_parallel.h): the first stage owns wte, the last stage keeps a
// copy for its LM head. n = Vp/t * C elements each way.

// After the backward pass: the last stage's LM-head gradient joins the first stage's wte gradient
// (received into `received`, then added, rounded once).
inline void pipe_tied_gradient(PipelineGpu* pipe, bool first, bool last, floatX* wte_grad, const floatX* lent_grad,
                               floatX* received, size_t n, cudaStream_t compute) {
    if (pipe->stages == 1) return;
    size_t bytes = n * sizeof(floatX);
    if (last) {
        pipe_send(pipe, lent_grad, bytes, 0, 0, 0, compute);
        pipe_finish(pipe, compute);
    }
    if (first) {
        pipe_recv(pipe, received, bytes, pipe->stages - 1, 0, compute);
        add_into(wte_grad, received, n, compute);
    }
}

// After the optimizer step: the first stage's updated wte replaces the last stage's copy.
inline void pipe_tied_weights(PipelineGpu* pipe, bool first, bool last, const floatX* wte, floatX* lent, size_t n,
                              cudaStream_t compute) {
    if (pipe->stages == 1) return;
    size_t bytes = n * sizeof(floatX);
    if (first) {
        pipe_send(pipe, wte, bytes, pipe->stages - 1, 1, 0, compute);
        pipe_finish(pipe, compute);
    }
    if (last) pipe_recv(pipe, lent, bytes, 0, 1, compute);
}
