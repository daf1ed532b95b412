// moe_gpu.cuh — the GPU trainer's mixture-of-experts blocks, on one GPU: the MoE table in device
// memory, each MoE block's forward and backward through llmc/kernels/moe.cuh, and the table's share
// of the step (its gradient's zeroing and norm, its AdamW). Read llmc/model/moe.h (the math) and
// llmc/kernels/moe.cuh (the kernels) first: this file is only the wiring, the GPU twin of what
// llmc/model/moe_step.h does for the CPU trainer (moe_block_forward, moe_block_backward).
//
// What it teaches: where an MoE layer meets the rest of a trainer. Three places, each small:
//   the passes     at an MoE block the MLP's three calls (fc, GELU, projection) become route ->
//                  gather -> one MLP per expert -> combine, between ln2 and the residual add; the
//                  backward is the transpose, and hands d ln2 to the LayerNorm's backward as the MLP did
//   the loss       L_aux + L_z are added to the optimised loss: their gradient enters the router's
//                  backward with aux_scale = d(optimised loss)/d(L_aux + L_z) of the micro-batch =
//                  S / (micro-batches x ranks) (S: fp16's loss scale, 1 here), the CPU's formula
//   the state      the router and experts 1..E-1 live in a second flat table, the MoE table
//                  (llmc/model/model.h): expert 0 is the block's dense MLP, in the dense table, so a
//                  model with E = 1 IS the dense model. The table has its own gradient and AdamW moments
//                  and is saved as the CPU trainer saves it (model.bin version 7, moe_state.bin)
//
// Precision: bf16 like the dense weights, the router's arithmetic fp32 (moe.cuh). The MoE table has
// NO fp32 master copy: its AdamW reads and writes the bf16 values with stochastic rounding, as
// --master-weights 0 does for the dense table. Why: a checkpoint's MoE state (moe_state.bin) holds m
// and v only, the format both trainers read; master weights would need a new format version. The
// price is a noisier update of the experts' and routers' weights (unbiased: stochastic rounding).
//
// Memory (llmc/memory/gpu_buffers.h's moe_* rows): the table, its gradient (bf16) and m, v (fp32);
// per MoE block the routing state (N (3E + 5k + 1) + 3E + 3 4-byte values) and the k N rows its
// experts gather, with their fc, GELU and output rows (k N (2C + 2H) bf16: k times the dense MLP's);
// the backward's rows once (k N (2C + H)). --recompute 1|2 leaves these alone, as on the CPU
// (llmc/model/moe.h): the blocks keep their routing and rows at every level, and nothing re-runs the
// router (which would add the auxiliary losses twice, Megatron-LM issue 1330); what level 2 drops is
// the block's ln2, the router's and experts' input, which gpt2_backward rebuilds (layernorm_recompute)
// before the MoE branch reads it. Checked bit for bit against --recompute 0: test_gpu_moe_trainer.py.
// The dense table's fch and fch_gelu rows of an MoE block are still allocated, unused: 8 N C bf16
// values a block, left for the simplicity of one activation table (E = 1 costs them twice).
//
// Speed: the experts' matmuls need each expert's row count on the host, so each MoE block's forward
// waits for its routing (moe.cuh's moe_read_rows: one synchronisation per block per micro-batch),
// and reads the step's statistics (two losses, E loads) in the same wait. Hence no --cuda-graphs.
//
// Hook points: none of the grid's (tensor or pipeline parallelism: llmc/run/compatibility.h refuses them).
// Data parallelism, ZeRO-1/2 among it, is llmc/parallel/moe_zero.cuh's, called from train_gpt.cu's
// gradient groups and parameter groups (docs/moe.md). train_gpt.cu's MLP hook (mlp_forward /
// mlp_backward) calls moe_mlp_forward / moe_mlp_backward (the end of this file) at the MoE layers, and
// the step the table's zeroing, norm and AdamW (its gradient and parameter group); with
// --expert-parallel those call the blocks' parts (route | the experts on their owners | combine:
// llmc/parallel/expert_parallel.cuh).
#pragma once

#include <algorithm>
#include <vector>
#include "llmc/kernels/moe.cuh"
#include "llmc/model/model.h"
#include "llmc/optim/adamw.cuh"
#include "llmc/parallel/expert_parallel.cuh"  // --expert-parallel: a block's experts on their owners
#include "llmc/run/moe_run.h"

struct MoEGpu {
    MoEConfig moe;                            // experts 0: a dense model, and nothing below is used
    cpu::MoEShape shape;                      // E, k, the capacity factor, alpha, c_z
    MoELayout layout;                         // the MoE table's tensors (the whole table, or --expert-parallel's held experts)
    int N = 0, C = 0, H = 0;                  // tokens per micro-batch (B T), channels, hidden units (4C)
    floatX* params = nullptr;                 // the MoE table, its gradient (bf16) and AdamW's m, v (fp32)
    floatX* grads = nullptr;
    float* m = nullptr;
    float* v = nullptr;
    std::vector<MoERouting> routing;          // per MoE block: the routing state of its micro-batch
    std::vector<floatX*> rows;                // per MoE block: xg, then fch, fch_gelu, eout (k N rows each)
    floatX *drow = nullptr, *dh = nullptr, *dxg = nullptr;  // the backward's rows, shared by the blocks
    std::vector<std::vector<int>> first_row;  // per MoE block: its experts' row ranges, read by the forward
    float aux_scale = 0.0f;                   // d(optimised loss) / d(L_aux + L_z) of the micro-batch
    MoEStepStats stats;                       // the step's (and an evaluation's) routing
    std::vector<float> host_losses;           // (2) a block's L_aux, L_z, read with its row ranges
    std::vector<int> host_kept;               // (E) its loads
};

// Points the MoE state into the trainer's buffers (the moe_* rows of gpu_buffers.h, sized by the same
// numbers): routing is Lm blocks of moe_gpu_routing_values 4-byte values, activations Lm blocks of
// k N (2C + 2H) rows, scratch k N (2C + H).
inline void moe_gpu_init(MoEGpu* g, const MoEConfig& moe, const cpu::MoEShape& shape, const GPT2Config& cfg, const MoELayout& layout, int N,
                         floatX* params, floatX* grads, float* m, float* v, float* routing, floatX* activations,
                         floatX* scratch) {
    g->moe = moe;
    g->shape = shape;
    g->layout = layout;  // (the whole table, or with --expert-parallel this rank's experts: gpu_moe_layout)
    g->N = N, g->C = cfg.channels, g->H = 4 * cfg.channels;
    g->params = params, g->grads = grads, g->m = m, g->v = v;
    size_t E = shape.experts, k = shape.top_k, kN = k * (size_t)N, C = g->C, H = g->H;
    int Lm = moe_block_count(moe, cfg.num_layers);
    g->routing.assign((size_t)Lm, MoERouting{});
    g->rows.assign((size_t)Lm, nullptr);
    g->first_row.assign((size_t)Lm, std::vector<int>(E + 1, 0));
    g->host_losses.assign(2, 0.0f);
    g->host_kept.assign(E, 0);
    for (int b = 0; b < Lm; b++) {
        float* f = routing + (size_t)b * moe_gpu_routing_values((size_t)N, E, k);
        MoERouting& r = g->routing[(size_t)b];
        r.logits = f;            f += (size_t)N * E;
        r.probs = f;             f += (size_t)N * E;
        r.dlogits = f;           f += (size_t)N * E;
        r.lse = f;               f += N;
        r.gate = f;              f += kN;
        r.dgate = f;             f += kN;
        r.losses = f;            f += 2;
        int* i = (int*)f;        // the ints after the floats (both 4 bytes)
        r.choice = i;            i += kN;
        r.row = i;               i += kN;
        r.token_of_row = i;      i += kN;
        r.routed = i;            i += E;
        r.kept = i;              i += E;
        r.first_row = i;
        g->rows[(size_t)b] = activations + (size_t)b * kN * (2 * C + 2 * H);
    }
    g->drow = scratch;
    g->dh = scratch + kN * C;
    g->dxg = scratch + kN * (C + H);
}

// MoE block b's weights as moe.h and moe.cuh take them: expert 0 is the block's dense MLP (fcw, fcb,
// projw, projb: its tensors in the dense table, or their gradients), the router and experts 1..E-1
// the MoE table's (`table`: the weights or the gradient).
template <typename T>
inline cpu::MoEWeights<T> moe_gpu_weights(const MoEGpu& g, T* table, int b, T* fcw, T* fcb, T* projw, T* projb) {
    const MoELayout& l = g.layout;
    return {moe_tensor(table, l, MOE_ROUTER, b), fcw, fcb, projw, projb, moe_tensor(table, l, MOE_FCW, b),
            moe_tensor(table, l, MOE_FCB, b), moe_tensor(table, l, MOE_FCPROJW, b), moe_tensor(table, l, MOE_FCPROJB, b),
            l.first_expert};
}

// MoE block b's rows (k N of each, in g->rows[b]): the gathered inputs, the experts' fc and GELU
// rows, their outputs.
struct MoEBlockRows { floatX *xg, *fch, *fch_gelu, *eout; };
inline MoEBlockRows moe_gpu_block_rows(const MoEGpu& g, int b) {
    size_t kN = (size_t)g.shape.top_k * g.N;
    floatX* xg = g.rows[(size_t)b];
    return {xg, xg + kN * g.C, xg + kN * (g.C + g.H), xg + kN * (g.C + 2 * g.H)};
}

// The forward of MoE block b in its three parts (moe_gpu_block_forward runs them in turn; with
// --expert-parallel train_gpt.cu runs the experts on their owners between the first and the last,
// llmc/parallel/expert_parallel.cuh). Route: x (N, C, the block's ln2) routed and gathered into the
// block's rows, its row ranges read (g->first_row[b]: the host waits for the routing).
inline void moe_gpu_block_route(MoEGpu* g, int b, const cpu::MoEWeights<const floatX>& w, const floatX* x, cudaStream_t s) {
    const cpu::MoEShape& sh = g->shape;
    int N = g->N, C = g->C, E = sh.experts, k = sh.top_k;
    MoERouting& r = g->routing[(size_t)b];
    moe_route_dispatch(r, sh, x, w.router, N, C, s);
    moe_gather(moe_gpu_block_rows(*g, b).xg, x, r, E, N, k, C, s);
    // the statistics come back in the row ranges' wait (moe_read_rows synchronises the stream)
    CUDA_CHECK(cudaMemcpyAsync(g->host_losses.data(), r.losses, 2 * sizeof(float), cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaMemcpyAsync(g->host_kept.data(), r.kept, E * sizeof(int), cudaMemcpyDeviceToHost, s));
    g->first_row[(size_t)b] = moe_read_rows(r, E, s);
}

// Combine: y (N, C) = the experts' outputs (the block's eout rows) mixed by their gates; the routing
// into the step's statistics.
inline void moe_gpu_block_combine(MoEGpu* g, int b, floatX* y, cudaStream_t s) {
    int N = g->N, C = g->C, E = g->shape.experts, k = g->shape.top_k;
    moe_combine(y, moe_gpu_block_rows(*g, b).eout, g->routing[(size_t)b], N, k, C, s);
    const std::vector<int>& kept = g->host_kept;
    moe_stats_add(&g->stats, g->host_losses[0], g->host_losses[1], k * N - g->first_row[(size_t)b][E],
                  *std::min_element(kept.begin(), kept.end()), *std::max_element(kept.begin(), kept.end()));
}

// Forward of MoE block b: y (N, C) = the experts' mixture of x (N, C, the block's ln2), its routing
// into the step's statistics.
inline void moe_gpu_block_forward(MoEGpu* g, MatmulContext* ctx, int b, const cpu::MoEWeights<const floatX>& w,
                                  const floatX* x, floatX* y, cudaStream_t s) {
    moe_gpu_block_route(g, b, w, x, s);
    MoEBlockRows r = moe_gpu_block_rows(*g, b);
    moe_experts_forward(ctx, w, g->first_row[(size_t)b], g->C, g->H, r.xg, r.fch, r.fch_gelu, r.eout, s);
    moe_gpu_block_combine(g, b, y, s);
}

// Generation (--generate, llmc/run/generate.h): the n new rows of a step (n <= N, the rows the state
// was sized for) through MoE block b, as the CPU's moe_forward_new_rows: routed without dropping
// (g->shape from moe_generation_shape: llmc/model/moe.h says why), nothing kept for a backward.
inline void moe_gpu_block_forward_new_rows(MoEGpu* g, MatmulContext* ctx, int b, const cpu::MoEWeights<const floatX>& w,
                                           const floatX* x, floatX* y, int n, cudaStream_t s) {
    int N = g->N;
    g->N = n;  // the routing state and rows hold N; this step uses the first n (every kernel reads g->N)
    moe_gpu_block_forward(g, ctx, b, w, x, y, s);
    g->N = N;
}

// Backward of MoE block b, after its forward: dx (N, C) = d loss / d x (overwritten), from dy = d loss
// / d y; the weights' gradients ADDED to gw (expert 0's into the dense gradient, as the MLP's).
// partials: bias_backward's scratch. In three parts, as the forward: the rows' gradients (g->drow =
// gate x dy, and the gates'), the experts' (g->dxg from g->drow), the router's and x's.
inline void moe_gpu_block_backward_rows(MoEGpu* g, int b, const floatX* dy, cudaStream_t s) {
    moe_backward_rows(g->drow, dy, moe_gpu_block_rows(*g, b).eout, g->routing[(size_t)b], g->N, g->shape.top_k, g->C, s);
}
inline void moe_gpu_block_backward_input(MoEGpu* g, int b, const cpu::MoEWeights<floatX>& gw, const cpu::MoEWeights<const floatX>& w,
                                         const floatX* x, floatX* dx, cudaStream_t s) {
    moe_backward_input(dx, gw.router, g->routing[(size_t)b], g->shape, x, w.router, g->dxg, g->N, g->C, g->aux_scale, s);
}
inline void moe_gpu_block_backward(MoEGpu* g, MatmulContext* ctx, int b, const cpu::MoEWeights<floatX>& gw,
                                   const cpu::MoEWeights<const floatX>& w, const floatX* x, const floatX* dy, floatX* dx,
                                   float* partials, cudaStream_t s) {
    MoEBlockRows r = moe_gpu_block_rows(*g, b);
    moe_gpu_block_backward_rows(g, b, dy, s);
    moe_experts_backward(ctx, gw, w, g->first_row[(size_t)b], g->C, g->H, g->drow, r.xg, r.fch, r.fch_gelu, g->dh, g->dxg, partials, s);
    moe_gpu_block_backward_input(g, b, gw, w, x, dx, s);
}

// AdamW on the MoE table, tensor by tensor (the router and the experts' matrices decay, their biases
// do not: llmc/model/model.h's moe_tensor_decays), with the dense table's step values and clipping.
// No master copy (see above). Each element's stochastic rounding is seeded by its index after the
// dense table's P, so no two parameters of the model share a random stream, and the update of an
// element does not depend on which elements are updated with it. [from, to): the table's values
// this rank updates, the whole table or, with --zero 1|2 on several GPUs, its shard (llmc/parallel/
// moe_zero.cuh); m and v hold exactly those, from `from`.
inline void moe_gpu_adamw(MoEGpu* g, size_t dense_params, size_t from, size_t to, const AdamWStep* step_values, const AdamWParams& a,
                          cudaStream_t s) {
    for (int t = 0; t < NUM_MOE_TENSORS; t++) {
        size_t begin = std::max(g->layout.offset[t], from), end = std::min(g->layout.offset[t] + g->layout.count[t], to);
        if (end <= begin) continue;
        size_t at = begin - from;  // (in m and v)
        adamw_update_piece(g->params + begin, nullptr, g->grads + begin, g->m + at, g->v + at, end - begin, dense_params + begin,
                           moe_tensor_decays(t), step_values, a, s);
    }
}

// ----------------------------------------------------------------------------------------------
// The trainer's MLP hook (train_gpt.cu: mlp_forward, mlp_backward) on an MoE layer: block b's experts
// here, or with --expert-parallel on their owners (llmc/parallel/expert_parallel.cuh: the rows go out
// after the routing and come back before the combine; the backward is the transpose). w, gw: the
// layer's dense tensors (expert 0, the dense MLP's weights and gradients); x: its ln2; y: its output.
inline void moe_mlp_forward(MoEGpu* g, ExpertParallelGpu* ep, MatmulContext* ctx, int l, const ParamTensors<floatX>& w,
                            const floatX* x, floatX* y, cudaStream_t s) {
    int b = moe_block_index(g->moe, l);
    cpu::MoEWeights<const floatX> mw = moe_gpu_weights<const floatX>(*g, g->params, b, w[FCW], w[FCB], w[FCPROJW], w[FCPROJB]);
    if (!ep->on) {
        moe_gpu_block_forward(g, ctx, b, mw, x, y, s);
        return;
    }
    moe_gpu_block_route(g, b, mw, x, s);
    MoEBlockRows rows = moe_gpu_block_rows(*g, b);
    ep_gpu_experts_forward(ep, ctx, b, mw, g->first_row[(size_t)b], rows.xg, rows.eout, s);
    moe_gpu_block_combine(g, b, y, s);
}
// dx (overwritten) from dy; the experts' and the router's gradients added. partials: bias_backward's scratch.
inline void moe_mlp_backward(MoEGpu* g, ExpertParallelGpu* ep, MatmulContext* ctx, int l, const ParamTensors<floatX>& w,
                             const ParamTensors<floatX>& gw, const floatX* x, const floatX* dy, floatX* dx, float* partials,
                             cudaStream_t s) {
    int b = moe_block_index(g->moe, l);
    cpu::MoEWeights<floatX> mg = moe_gpu_weights<floatX>(*g, g->grads, b, gw[FCW], gw[FCB], gw[FCPROJW], gw[FCPROJB]);
    cpu::MoEWeights<const floatX> mw = moe_gpu_weights<const floatX>(*g, g->params, b, w[FCW], w[FCB], w[FCPROJW], w[FCPROJB]);
    if (!ep->on) {
        moe_gpu_block_backward(g, ctx, b, mg, mw, x, dy, dx, partials, s);
        return;
    }
    moe_gpu_block_backward_rows(g, b, dy, s);
    ep_gpu_experts_backward(ep, ctx, b, mg, mw, g->drow, g->dxg, partials, s);
    moe_gpu_block_backward_input(g, b, mg, mw, x, dx, s);
}
