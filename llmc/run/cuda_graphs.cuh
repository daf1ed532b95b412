// cuda_graphs.cuh — --cuda-graphs: the step's device work captured once into CUDA graphs and
// replayed at every later step (GPU trainer only; the CPU trainer launches no kernels).
//
// What it teaches. Every kernel launch costs host time: the driver checks and packs the
// arguments and pushes the launch to the GPU. A GPU step is a long chain of short kernels; where a
// kernel runs for less time than the host takes to launch the next, the GPU waits for the host.
// A d12 step (12 layers, --attention simple) is 541 kernels, cuBLAS's matmuls among them, and 2
// memsets: 44 launches per layer and 15 around them, counted by the emulation from the captured
// graph (the line print_graphs_captured prints; cuDNN's fused attention, not emulated, replaces
// some of each layer's). Every step launches the same ones with the same arguments. A CUDA graph records that chain once (stream capture: between
// cudaStreamBeginCapture and cudaStreamEndCapture the stream's work is recorded, not run),
// instantiates it, and cudaGraphLaunch then submits the whole chain with one call. The GPU's
// arithmetic is unchanged, so a graphed run equals an eager one bit for bit (test/test_cuda_graphs.py);
// only the launches are cheaper. This is what torch.compile's "reduce-overhead" mode and
// Megatron's --enable-cuda-graph do; NVIDIA's CUDA Programming Guide, "CUDA Graphs", is the reference.
//
// The catch: a graph replays its kernels with the arguments they had at capture. A value passed by
// value that changes from step to step (the learning rate of a schedule, AdamW's step count and bias
// corrections, the stochastic-rounding seed's step) would be baked in: every replay would use the
// captured step's. So every per-step value lives in device memory (AdamWStep, llmc/optim/adamw.cuh,
// in the GB_STEP_VALUES buffer), written by a cudaMemcpyAsync before the launch, and the kernels read
// it there. Pointers are baked in too: the graph reads and writes the same buffers every step, which
// the trainer's size table guarantees (one allocation for the whole run, and on one rank the
// micro-batch always lands in slot 0).
//
// What cannot be captured, and why: anything that waits for the GPU or allocates (a synchronous
// cudaMemcpy, cudaStreamSynchronize, cudaMalloc: the real runtime refuses them during a capture with
// cudaErrorStreamCaptureUnsupported and invalidates it, and the emulation does the same), and any
// host decision in the middle of the step. Our step has two: the loss and the gradient norm are
// read by the host to decide whether the update may be applied (step_is_sound, llmc/run/step.h).
// So the step is two graphs with the host's reads between them:
//   upload the batch (host -> device, eager)
//   graph "passes":  zero the gradient, forward, loss, backward, the norm's partial sums
//   host: read the loss and the partial sums, step_is_sound
//   upload AdamWStep (cudaMemcpyAsync)
//   graph "update":  AdamW
// The first step of a run is eager (it also builds cuBLASLt's and cuDNN's plans, and --dump-state
// reads its logits in the middle); the second captures; every later one replays.
//
// Data-parallel ranks (ZeRO-0/1/2, one GPU per rank). NCCL's collectives can be captured like kernels
// (NCCL >= 2.9; the NCCL user guide, "Using NCCL with CUDA Graphs"): every rank captures the same
// collectives in the same order, and a graph launch is then a collective call of its own, made by
// every rank. The sums run on ZeRO's communication stream, which the capture takes in as on a GPU:
// it waits on an event recorded on the captured compute stream (zero_follow: the fork), and the
// compute stream waits on one recorded after the sums (zero_wait: the join; the host's own wait,
// eager, cannot happen inside a capture). So the graphs hold:
//   "passes":  ... backward, each unit's reduce-to-owners as it finishes (forked), join, the norm's partials
//   "update":  ZeRO-0's all-gather of the summed gradient, AdamW, ZeRO-1's (or -2's, unit by unit)
//              all-gather of the weights
// The host's reads between them are unchanged: the loss and this rank's partial sums of squares,
// each added over the ranks on the host (gpu_comm_sum), after the replay. The pointers the
// collectives were captured with are the size table's, the same every step.
//
// Gradient accumulation (m micro-batches a step). Which graph: the whole step as one graph would
// need every micro-batch's tokens in a buffer of its own (a graph's pointers are baked in), so m
// input slots in the size table, m copies of every node, and all m batches uploaded before the step
// starts. Instead each micro-batch's passes are a graph, replayed once per micro-batch with the same
// pointers: the micro-batch's tokens are copied into the graphs' fixed input buffers (slot 0, as
// eager) before each launch. The micro-batches differ only at the ends of the step, so three graphs
// share one capture function (step_graph_of):
//   "first micro-batch":   zero the gradient, forward, loss, backward
//   "middle micro-batches": forward, loss, backward (replayed m - 2 times)
//   "last micro-batch":    forward, loss, backward with the sums (ZeRO-0/1: once, after the last
//                          micro-batch, as eager), join, fp8's amax, the norm's partials
// m + 1 launches a step with the update. Each micro-batch's loss is the host's read in eager (the mean
// of its per-token losses); graphed, an asynchronous copy after each launch puts its per-token
// losses in its own slot of pinned host memory (m slots, allocated with the model), and the host
// adds them once after the last, in eager's order: the same loss, bit for bit. (A device-side sum
// would need a new reduction whose order is not the host's: no longer bit for bit.) What stays
// serial: the upload waits for its copies (its pinned buffer is reused), and so for the replay
// before it, which reads the same input buffers; the host reads the next batch while that replay runs.
//
// ZeRO-2 (the gradient in per-unit buckets, each reduce-scattered as the backward finishes it, on
// EVERY micro-batch; llmc/parallel/zero.cuh). The buckets' reduce-scatters and the adds into this
// rank's gradient shard are captured on the communication stream like ZeRO-0/1's sums, so every
// micro-batch's graph forks it and joins it back before it ends (one graph cannot wait on an event
// recorded in another). Two of ZeRO-2's host waits move to the device: a bucket slot is zeroed
// for its next unit only after its previous reduce-scatter, which eager the host waits for; inside
// a capture the compute stream waits on that event instead (zero_open_bucket, for a reduce-scatter
// recorded in the same capture); and the update's all-gather of every unit's updated shards ends in
// a join, not the host's wait. The norm: this rank's owned pieces of the summed gradient are one
// contiguous piece unless a unit's shard ends in padding (the last rank, when a unit does not split
// evenly); one piece's partial sums are in the last graph, several pieces' are summed after it, one
// kernel and one read each, as finish_gradients sums them eager (the partials buffer holds one).
//
// fp8 over several ranks (llmc/kernels/fp8.cuh): every rank must take the step's amax, the maximum
// over the ranks, into its histories, so eager the host waits for the backward and then for an
// all-reduce (max) of amax_now. Graphed, the all-reduce is captured in the last micro-batch's graph
// like the sums: forked onto the communication stream after the backward's sums, joined back before
// the histories roll (fp8_share_amax_graphed in train_gpt.cu), the same collective in the same order.
//
// Not handled yet, refused with one line by cuda_graphs_problem: tensor and pipeline parallelism
// (their exchanges), ranks sharing one GPU (the host-staged sums wait on the host), PowerSGD (its
// orthogonalisation is host-driven), --offload optimizer (AdamW runs on the host), ZeRO-3 (the host
// waits for each unit's all-gather before its kernels, and which units a pass gathers depends on
// what its slots still hold).
//
// fp16 (./train_gpt_fp16, llmc/optim/loss_scaler.h): the loss scale S changes when a step overflows
// (halved) and after a clean window (doubled), so it is a per-step value like the learning rate: the
// loss kernel reads S from GB_STEP_VALUES and AdamW reads 1/S from AdamWStep, both written before the
// launches. The skip needs no device flag: the host already reads the norm between the two graphs
// (it is the overflow flag, step_applies in train_gpt.cu), and a skipped step does not launch the update.
//
// Memory: nothing in the size table (the graphs hold no buffers of ours; the driver keeps the
// instantiated graphs, a few KiB per node: with accumulation three graphs of the passes instead of
// one); m x B x T floats of pinned host memory for the losses. Hook points: none inside the passes;
// train_step's graphed twin in train_gpt.cu (train_step_graphed: graphed_micro_batch) and the dense
// AdamW parameter group's update (update_adamw) call graph_run; ZeRO-2's bucket hook (zero_open_bucket) asks the stream whether it is being captured.
#pragma once

#include <string>
#include "llmc/kernels/cuda_common.cuh"
#include "llmc/run/cli.h"
#include "llmc/parallel/process_grid.h"

// Why --cuda-graphs cannot run on this launch ("" = it can): ranks whose collectives are host-staged
// (comm_nccl.cuh). What it does not combine with is rows of llmc/run/compatibility.h.
inline std::string cuda_graphs_problem(const TrainOptions& o, const ProcessGrid& grid, bool ranks_share_a_gpu) {
    if (o.cuda_graphs && grid.world > 1 && ranks_share_a_gpu)
        return strprintf("--cuda-graphs with %d ranks sharing a GPU: their host-staged sums wait on the host, which a graph "
                         "cannot; give each rank its own GPU, or drop --cuda-graphs", grid.world);
    return "";
}

// One captured piece of the step.
struct StepGraph {
    const char* name = "";
    cudaGraphExec_t exec = nullptr;  // null until captured
    size_t nodes = 0, kernels = 0;   // what the capture recorded (kernels: ours and the libraries')
};

struct StepGraphs {
    bool replay = false;  // this step runs from the graphs (--cuda-graphs, after the run's first step)
    // the passes: one graph for a step of one micro-batch; with accumulation, the first micro-batch's
    // (it zeroes the gradient first), the middle ones' (replayed m - 2 times) and the last's (the sums,
    // the norm's partial sums after it)
    StepGraph passes{"passes"}, first{"first micro-batch"}, micro{"middle micro-batches"}, last{"last micro-batch"};
    StepGraph update{"update"};
};

// The graph that runs one micro-batch's passes: which one it is decides what its capture holds.
inline StepGraph* step_graph_of(StepGraphs* g, bool first, bool last) {
    if (first && last) return &g->passes;
    return first ? &g->first : last ? &g->last : &g->micro;
}

// Runs the device work that `work` issues on `stream`: directly when the step is eager; otherwise by
// launching g's graph, which the first call captures from `work` (which then issues nothing that
// waits for the GPU or allocates: the runtime would refuse it, and the capture fails naming it).
template <class Work> void graph_run(const StepGraphs& graphs, StepGraph* g, cudaStream_t stream, Work&& work) {
    if (!graphs.replay) {
        work();
        return;
    }
    if (!g->exec) {
        CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
        work();
        cudaGraph_t graph = nullptr;
        cudaError_t err = cudaStreamEndCapture(stream, &graph);
        if (err != cudaSuccess)
            fail("--cuda-graphs: capturing the step's %s failed (%s: %s); run without --cuda-graphs", g->name,
                 cudaGetErrorName(err), cudaGetErrorString(err));
        CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &g->nodes));
        std::vector<cudaGraphNode_t> nodes(g->nodes);
        CUDA_CHECK(cudaGraphGetNodes(graph, nodes.data(), &g->nodes));
        for (cudaGraphNode_t n : nodes) {
            cudaGraphNodeType type;
            CUDA_CHECK(cudaGraphNodeGetType(n, &type));
            g->kernels += type == cudaGraphNodeTypeKernel;
        }
        CUDA_CHECK(cudaGraphInstantiate(&g->exec, graph, 0));
        CUDA_CHECK(cudaGraphDestroy(graph));
    }
    CUDA_CHECK(cudaGraphLaunch(g->exec, stream));
}

// Once, after the step that captured them (rank 0); `micro_batches`: the step's.
inline void print_graphs_captured(const StepGraphs& g, int step, int micro_batches) {
    std::string passes;
    size_t eager_launches = g.update.nodes;
    for (const StepGraph* s : {&g.passes, &g.first, &g.micro, &g.last}) {
        if (!s->exec) continue;
        passes += strprintf("%s%s (%zu nodes, %zu of them kernels)", passes.empty() ? "" : ", ", s->name, s->nodes, s->kernels);
        eager_launches += s->nodes * (s == &g.micro ? (size_t)(micro_batches - 2) : 1);
    }
    printf("cuda graphs: step %d captured the passes: %s, and the update (%zu nodes, %zu kernels); each later step "
           "replays them: %d graph launches instead of %zu\n", step, passes.c_str(), g.update.nodes, g.update.kernels,
           micro_batches + 1, eager_launches);
}

inline void graphs_free(StepGraphs* g) {
    for (StepGraph* s : {&g->passes, &g->first, &g->micro, &g->last, &g->update})
        if (s->exec) CUDA_CHECK(cudaGraphExecDestroy(s->exec));
    *g = StepGraphs{};
}
