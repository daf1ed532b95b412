// train_gpt_cpu.cpp — GPT-2 training on the CPU, in fp32: the reference for every GPU kernel.
//
// Read it top to bottom after its layers (llmc/model/cpu_layers.h: each forward and backward pass written
// out by hand, no autograd): the model that strings them together, the optimizer step, and the
// training loop. Everything the GPU trainer shares with this one (shapes, files, flags, data,
// schedule, sampling, the process grid of data, tensor and pipeline parallelism) lives in llmc/.
// What is here: the model's state, the hooks where every other technique attaches to the passes
// and to the step (each a short function calling the technique's own file), the plain passes and
// step (gpt2_forward, gpt2_backward, finish_gradients, gpt2_update, train_step: llm.c's shape, one
// hook call with a one-line comment wherever a technique enters), and what the run around them needs
// from this trainer: its passes for the pipeline schedule's interpreter (llmc/run/schedule_run.h) and
// for the loop, evaluations and samples (llmc/run/train_loop.h), its checkpoint's bytes, and main. Under mpirun each rank
// runs it on its slice of the model, the places where ranks talk inside those hooks.
//
// Shapes: B sequences of T tokens, C channels, NH heads of hs = C/NH channels, vocab Vp (padded).
// Activations are row-major (B, T, X); weights are (out, in) as in nn.Linear, y = x W^T + b.
//
// Determinism: every output element is computed by exactly one thread, in a fixed order, and every
// reduction across rows runs in a fixed order too, so a run is bit-identical for a given thread
// count (and matmuls, the bulk of the work, are identical for any thread count).
#include <omp.h>
#ifdef __AVX512F__
#include <immintrin.h>  // _mm512_stream_ps, _mm_sfence: zero_gradients
#endif
#include <array>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>
#include "llmc/probes/cpu_profile.h"  // first: it defines LAYER_PROFILE, which times each layer for --profile
#include "llmc/run/checkpoint.h"
#include "llmc/run/cli.h"
#include "llmc/run/compatibility.h"
#include "llmc/run/cpu_threads.h"
#include "llmc/parallel/comm.h"
#include "llmc/memory/cpu_buffers.h"
#include "llmc/memory/huge_pages.h"     // the large buffers on 2 MiB pages
#include "llmc/model/cpu_layers.h"
#include "llmc/model/kv_cache.h"
#include "llmc/optim/adafactor.h"
#include "llmc/optim/factored_sharding.h"
#include "llmc/optim/factored_tensor_parallel.h"
#include "llmc/optim/adamw.h"
#include "llmc/optim/adamw_bf16.h"
#include "llmc/optim/disk_offload.h"
#include "llmc/optim/sm3.h"
#include "llmc/probes/cpu_memory_report.h"
#include "llmc/io/dataloader.h"
#include "llmc/memory/estimate.h"
#include "llmc/memory/stash_precision.h"
#include "llmc/parallel/grid_planner.h"
#include "llmc/probes/fault_injection.h"
#include "llmc/probes/grad_compression_probe.h"
#include "llmc/probes/poison.h"  // tests only: every fresh buffer as NaN (LLMC_POISON_BUFFERS=1)
#include "llmc/io/formats.h"
#include "llmc/run/generate.h"
#include "llmc/run/hellaswag.h"
#include "llmc/run/metrics.h"
#include "llmc/model/model.h"
#include "llmc/model/moe.h"
#include "llmc/model/moe_step.h"  // the MoE table's gradient group and AdamW
#include "llmc/run/moe_run.h"  // the flags' MoEShape, MoEStepStats, the step line's and metrics' MoE numbers
#include "llmc/parallel/expert_parallel.h"
#include "llmc/run/sampler.h"
#include "llmc/run/schedule_run.h"
#include "llmc/run/train_loop.h"
#include "llmc/parallel/pipeline_parallel.h"
#include "llmc/parallel/pipedream_2bw.h"
#include "llmc/run/plan.h"
#include "llmc/parallel/process_grid.h"
#include "llmc/parallel/grad_compression.h"
#include "llmc/parallel/parameter_server.h"
#include "llmc/model/recompute.h"
#include "llmc/model/zero_bubble_backward.h"
#include "llmc/run/run.h"
#include "llmc/parallel/sharding.h"
#include "llmc/probes/state_dump.h"
#include "llmc/probes/trace.h"
#include "llmc/run/step.h"
#include "llmc/parallel/tensor_parallel.h"
#include "llmc/parallel/tensor_parallel_loss.h"
#include "llmc/parallel/zero.h"
#include "llmc/utils.h"

using namespace cpu;  // the layers (llmc/model/cpu_layers.h), named cpu:: for the kernel lab, which has GPU twins of them

// ==============================================================================================
// The model: parameters, their gradients and AdamW moments (flat arrays, see llmc/model/model.h), and
// the activations of one micro-batch.
//
// On one rank the model is all of GPT-2. On a process grid (llmc/parallel/process_grid.h) a rank holds a
// SLICE: its pipeline stage's layers, its tensor rank's share of heads, hidden units and
// vocabulary. The code below is written for the slice, in local shapes:
//     L   layers of the slice              Ca  attention channels: heads * head size (C / tp)
//     C   channels of the residual stream  Cf  MLP hidden units (4C / tp)
//     NH  heads of the slice               Vp  vocabulary rows of the slice (padded)
//     R   rows of the residual stream this rank holds: B*T, or B*T / tp with sequence parallelism
// which on one rank are simply the model's own. Where ranks talk is inside the passes' hooks ("The
// hooks" below), each doing nothing on one rank: linear_forward / linear_backward and the embedding's
// and the loss's hooks for tensor and sequence parallelism (llmc/parallel/tensor_parallel.h),
// layer_weights / release_layer_weights (ZeRO-3: all-gather a layer's weights, free them) and
// layer_grads / layer_grads_done (ZeRO-2/3: a layer's gradient bucket, reduce-scattered when done;
// llmc/parallel/zero.h); and pipeline stages (llmc/parallel/pipeline_parallel.h) skip the embedding or
// the head that is not theirs (pass_view): their input arrives in acts.encoded, their output gradient
// in acts.dresidual.

// Every activation the backward pass needs, for B x T tokens. Per-layer tensors are stacked over
// layers so the backward pass can find layer l's inputs. A pipeline stage keeps one of these per
// micro-batch in flight.
struct Activations {
    std::vector<float> encoded;                       // (R,C)     embeddings = residual stream in (pipelines: received)
    std::vector<float> ln1, ln1_mean, ln1_rstd;       // (L,R,C), (L,R), (L,R)    ln1, ln2: empty at --recompute 2
    std::vector<float> qkv;                           // (L,B,T,3Ca)
    std::vector<float> att;                           // (L,B,NH,T,T) attention probabilities
    std::vector<float> atty;                          // (L,B,T,Ca) attention output, before projection
    std::vector<float> residual2;                     // (L,R,C)   residual after attention
    std::vector<float> ln2, ln2_mean, ln2_rstd;       // (L,R,C), (L,R), (L,R)
    std::vector<float> fch, fch_gelu;                 // (L,B,T,Cf) MLP hidden, before and after GELU (empty at --recompute 1+)
    std::vector<float> residual3;                     // (L,R,C)   residual after the MLP = block output
    std::vector<float> lnf, lnf_mean, lnf_rstd;       // (R,C), (R), (R)          the last stage only
    std::vector<float> logits;                        // (B,T,Vp), overwritten by dlogits in backward (or in gpt2_loss)
    std::vector<float> losses, logsumexp;             // (B,T), (B,T): per-position loss, softmax normaliser
    std::vector<float> dresidual;                     // (R,C) gradient of the residual stream (pipelines: received)
    // --stash-precision bf16 (llmc/memory/stash_precision.h): the backward's copies of ln1, qkv, att, atty, ln2, fch
    // and fch_gelu in bf16, same shapes; the fp32 arrays above are then empty, their layer computed in Workspace
    struct BF16Stash { std::vector<uint16_t> ln1, qkv, att, atty, ln2, fch, fch_gelu; } stash;
    // pipelines: the micro-batch's tokens, kept until its backward pass; sends from these buffers
    std::vector<int> inputs, targets;
    std::vector<CommSend> sends;
    // ZB-H1: the micro-batch whose W has still to read this slot's rows cpu_buffer_read_by_weight_pass
    // names (-1: none). Slots past the forward's hold only those rows: the ones parked for W.
    int weight_owner = -1;
    // gpt2_loss with a dloss already turned the logits into their gradient: gpt2_backward skips that
    bool logits_hold_gradient = false;
};

// Backward scratch, one layer's worth, reused by every layer and every micro-batch.
struct Workspace {
    std::vector<float> dbuf_c, dbuf_3c, dbuf_4c;      // (B,T,C), (B,T,3Ca), (B,T,Cf)
    // --recompute (llmc/model/recompute.h): the one layer of what is not kept per layer. The forward
    // writes and reads it within a layer; the backward refills it right before each use.
    std::vector<float> ln_recompute;                  // (R,C)     level 2: ln1 or ln2 of the current layer
    std::vector<float> gelu_recompute;                // (B,T,Cf)  level 1+: GELU(fch) of the current layer
    // --stash-precision bf16: the current layer of the stashed tensors in fp32, the forward's and the
    // backward's (ln1, ln2 in ln_recompute, fch_gelu in gelu_recompute)
    std::vector<float> stash_qkv, stash_att, stash_atty, stash_fch;  // (B,T,3Ca), (B,NH,T,T), (B,T,Ca), (B,T,Cf)
    std::vector<float> gathered;                      // (B,T,C) sequence parallelism: all ranks' rows, or partial sums
    std::vector<float> dlocal;                        // (R,C)   sequence parallelism: this rank's rows of a summed gradient
};

struct GPT2 {
    GPT2Config config;
    ModelSlice slice;              // the part of the model this rank holds: all of it on one rank
    ParamLayout layout;            // the slice's flat arrays (on one rank, the full model's layout)
    std::vector<float> params, grads, adam_m, adam_v;
    // --optimizer adafactor | sm3: their row and column statistics instead of m and v, per block
    Optimizer optimizer = Optimizer::AdamW;
    std::vector<ParamBlock> blocks;            // the matrices and vectors this rank updates (llmc/optim/optimizer_state.h)
    FactoredShard factored;                    // which rank updates which blocks: all on one rank, or ZeRO-1's cut
    FactoredGroup factored_tp;                 // --tensor-parallel: the cut blocks' group (factored_tensor_parallel.h)
    std::vector<float> optimizer_state, optimizer_scratch;
    // --optimizer-state bf16: AdamW's m and v in 2 bytes each (llmc/optim/adamw_bf16.h), in place of adam_m, adam_v
    bool bf16_moments = false;
    std::vector<uint16_t> adam_m16, adam_v16;
    // --offload-dir: m and v in files, streamed through adam_m and adam_v, two chunks each (llmc/optim/disk_offload.h)
    DiskOffload offload;
    ParamTensors<float> p, g;      // pointers to each tensor inside params / grads
    std::vector<Activations> acts; // one per micro-batch in flight: more than one only in a pipeline
    // ZB-H1 (llmc/model/zero_bubble_backward.h): the output gradients W reads, kept from B to W in
    // pending_weights stashes; its inputs stay in acts, whose first forward_slots are the forward's
    std::vector<float> weight_stash;
    int pending_weights = 0;
    size_t forward_slots = 1;
    Workspace work;
    std::vector<BufferSpec> table; // the sizes everything was allocated with (llmc/memory/cpu_buffers.h)
    int max_B = 0, max_T = 0;      // the activations were sized for this
    int recompute = 0;             // --recompute: 1 keeps no fch_gelu per layer, 2 also no ln1, ln2
    TensorParallel tp;             // degree 1 on one rank: every tensor-parallel hook is a no-op
    Zero zero;                     // stage 0 on one rank: weights and gradients are plain flat arrays
    GradCompression compression;   // --grad-compression: how the data-parallel sum is sent (none: exactly)
    ParameterServer server;        // --data-parallel server: the sum and the step on rank 0 (off: the all-reduce)
    // pipelines: the last stage's copy of the tied wte (its LM head), owned by the first stage
    std::vector<float> lent_wte, lent_wte_grad;
    PipeDream2BW versions;         // --pipeline-schedule 2bw: W(t-1) beside params' W(t) (llmc/parallel/pipedream_2bw.h)
    // --moe-experts (llmc/model/moe.h, docs/moe.md): the MoE table (llmc/model/model.h: the routers and
    // experts 1 .. E-1; expert 0 of a block is its MLP in the flat array above), its gradient and AdamW
    // moments, what each MoE block's forward keeps for its backward, and the step's routing statistics
    MoEConfig moe;                 // experts 0: the dense model, and everything below is empty
    MoEShape moe_shape;
    MoELayout moe_layout;
    std::vector<float> moe_params, moe_grads, moe_m, moe_v, moe_sum_scratch;
    std::vector<ParamBlock> moe_blocks;     // --optimizer adafactor|sm3: the MoE table's matrices and vectors
    std::vector<float> moe_factored;        //   and their statistics (llmc/optim/optimizer_state.h)
    std::vector<MoEActivations> moe_acts;   // one per MoE block (MoE runs without a pipeline: one micro-batch in flight)
    MoEStepStats moe_stats;
    // --expert-parallel (llmc/parallel/expert_parallel.h): this rank's expert group (null: every rank
    // runs every expert), and what each MoE block's exchange keeps for its backward
    Comm* ep = nullptr;
    std::vector<ExpertParallelBlock> ep_blocks;
    MoESharing moe_zero;   // --zero 1|2: moe_m and moe_v hold this rank's shards (llmc/parallel/expert_parallel.h)
    MoESharing moe_bf16;   // --grad-compression bf16: the table's parts summed in bf16, each over its sharers
};

// The vector that holds row `b` of the size table (of micro-batch slot `slot` for the rows every
// micro-batch has its own of); null for the rows held elsewhere (the matmul's packed panels), not
// held at all (ZeRO's units, gathered and freed as the step goes), or held in bf16 (gpt2_buffer16).
static std::vector<float>* gpt2_buffer(GPT2* m, int b, int slot = 0) {
    if (m->table[(size_t)b].element_bytes == 2) return nullptr;
    Activations& a = m->acts[(size_t)slot];
    switch (b) {
        case CB_PARAMS: return m->zero.stage == 3 ? &m->zero.param_shard : &m->params;
        case CB_GRADS: return &m->grads;          case CB_GRAD_SHARD: return &m->zero.grad_shard;
        case CB_ADAM_M: return &m->adam_m;        case CB_ADAM_V: return &m->adam_v;
        case CB_OPTIMIZER_STATE: return &m->optimizer_state; case CB_OPTIMIZER_SCRATCH: return &m->optimizer_scratch;
        case CB_OLDER_WEIGHTS: return &m->versions.older;
        case CB_ENCODED: return &a.encoded;       case CB_LN1: return &a.ln1;
        case CB_LN1_MEAN: return &a.ln1_mean;     case CB_LN1_RSTD: return &a.ln1_rstd;
        case CB_QKV: return &a.qkv;               case CB_ATT: return &a.att;
        case CB_ATTY: return &a.atty;             case CB_RESIDUAL2: return &a.residual2;
        case CB_LN2: return &a.ln2;               case CB_LN2_MEAN: return &a.ln2_mean;
        case CB_LN2_RSTD: return &a.ln2_rstd;     case CB_FCH: return &a.fch;
        case CB_FCH_GELU: return &a.fch_gelu;     case CB_RESIDUAL3: return &a.residual3;
        case CB_LNF: return &a.lnf;               case CB_LNF_MEAN: return &a.lnf_mean;
        case CB_LNF_RSTD: return &a.lnf_rstd;     case CB_LOGITS: return &a.logits;
        case CB_LOSSES: return &a.losses;         case CB_LOGSUMEXP: return &a.logsumexp;
        case CB_WEIGHT_STASH: return &m->weight_stash;
        case CB_DRESIDUAL: return &a.dresidual;   case CB_DBUF_C: return &m->work.dbuf_c;
        case CB_DBUF_3C: return &m->work.dbuf_3c; case CB_DBUF_4C: return &m->work.dbuf_4c;
        case CB_GATHERED: return &m->work.gathered; case CB_DLOCAL: return &m->work.dlocal;
        case CB_LN_RECOMPUTE: return &m->work.ln_recompute; case CB_GELU_RECOMPUTE: return &m->work.gelu_recompute;
        case CB_STASH_QKV: return &m->work.stash_qkv; case CB_STASH_ATT: return &m->work.stash_att;
        case CB_STASH_ATTY: return &m->work.stash_atty; case CB_STASH_FCH: return &m->work.stash_fch;
        case CB_LENT_WTE: return &m->lent_wte;    case CB_LENT_WTE_GRAD: return &m->lent_wte_grad;
        case CB_COMPRESSION_STATE: return &m->compression.state;
        case CB_COMPRESSION_WORK: return &m->compression.work;
        case CB_COMPRESSION_SCRATCH: return &m->compression.scratch;
        case CB_MOE_PARAMS: return &m->moe_params; case CB_MOE_GRADS: return &m->moe_grads;
        case CB_MOE_FACTORED_STATE: return &m->moe_factored;
        case CB_MOE_ADAM_M: return &m->moe_m;     case CB_MOE_ADAM_V: return &m->moe_v;
        case CB_MOE_SUM_SCRATCH: return &m->moe_sum_scratch;
        default: return nullptr;
    }
}

// The rows of 2-byte values: AdamW's m and v with --optimizer-state bf16, the stashed activations with
// --stash-precision bf16 (null where the row is fp32).
static std::vector<uint16_t>* gpt2_buffer16(GPT2* m, int b, int slot = 0) {
    if (m->table[(size_t)b].element_bytes != 2) return nullptr;
    Activations::BF16Stash& st = m->acts[(size_t)slot].stash;
    switch (b) {
        case CB_ADAM_M: return &m->adam_m16;      case CB_ADAM_V: return &m->adam_v16;
        case CB_LN1: return &st.ln1;              case CB_QKV: return &st.qkv;
        case CB_ATT: return &st.att;              case CB_ATTY: return &st.atty;
        case CB_LN2: return &st.ln2;              case CB_FCH: return &st.fch;
        case CB_FCH_GELU: return &st.fch_gelu;
        default: return nullptr;
    }
}

// The weights of the model, or of this rank's slice of it (from a file or an initialisation, in
// the slice's layout; gpt2_allocate pads them). Empty with ZeRO-3, where a rank never holds them
// all: gpt2_allocate gives it its shards, and the trainer fills them.
void gpt2_build(GPT2* model, const GPT2Config& cfg, std::vector<float> params, const ModelSlice* slice = nullptr) {
    model->config = cfg;
    model->slice = slice ? *slice : full_model_slice(cfg);
    model->layout = slice_layout(cfg, model->slice);
    model->params = std::move(params);
    model->p = point_into(model->params.data(), model->layout);
}

// Allocates every buffer of the table for `shape`, each a vector of exactly the row's size: zeroed,
// except the parameters, which keep their values (their padding is zero). A fresh vector each time,
// because a vector that grows in place may reserve more than it was asked for. Rows that every
// micro-batch in flight has its own of are split evenly between them.
void gpt2_allocate(GPT2* model, const CPURunShape& shape) {
    model->table = cpu_buffer_table(shape);
    model->bf16_moments = shape.bf16_moments;
    // (ZB-H1: and after them, the slots that hold only the rows parked for W: cpu_buffer_copies)
    model->forward_slots = (size_t)shape.micro_batches_in_flight;
    model->acts.assign(std::max(model->forward_slots, (size_t)shape.weight_input_slots), Activations());
    model->pending_weights = shape.pending_weight_passes;
    model->versions.on = shape.two_weight_versions;
    for (int b = 0; b < CB_COUNT; b++) {
        size_t copies = cpu_buffer_copies(shape, b);
        for (int slot = 0; slot < (int)copies; slot++) {
            size_t n = model->table[b].elements / copies;
            if (std::vector<uint16_t>* v16 = gpt2_buffer16(model, b, slot)) std::vector<uint16_t>(n, 0).swap(*v16), poison_fresh(v16);
            std::vector<float>* v = gpt2_buffer(model, b, slot);
            if (!v) continue;
            if (b == CB_PARAMS && v->size() == n && v->capacity() == n) continue;  // exact already: no copy
            std::vector<float> exact;
            fresh_buffer(&exact, n);  // zeros, on 2 MiB pages (llmc/memory/huge_pages.h)
            poison_fresh(&exact);  // tests: NaN, so a read before any write shows (llmc/probes/poison.h)
            // the parameters' padding is zero: the updates and the checks read it (poison found it). (ZeRO-3's shard
            // starts empty: all of it zero here, then load_weights fills its runs)
            if (b == CB_PARAMS) std::fill(std::copy(v->begin(), v->begin() + std::min(v->size(), n), exact.begin()), exact.end(), 0.0f);
            v->swap(exact);
        }
    }
    for (size_t i = 0; i < model->forward_slots; i++) {
        Activations& a = model->acts[i];
        a.inputs.assign((size_t)shape.B * shape.T, 0);
        a.targets.assign((size_t)shape.B * shape.T, 0);
    }
    matmul_scratch_reserve(model->table[CB_MATMUL_PACK_A].elements, model->table[CB_MATMUL_PACK_B].elements);
    model->moe = shape.moe;
    model->moe_layout = moe_layout(model->config, shape.moe, moe_held_experts(shape.moe, shape.expert_parallel, shape.expert_rank));
    model->moe_acts.resize((size_t)moe_block_count(shape.moe, model->config.num_layers));
    for (MoEActivations& a : model->moe_acts)  // (the table's CB_MOE_ACTIVATIONS row counts these vectors)
        moe_allocate(&a, MoEShape{shape.moe.experts, shape.moe_top_k}, shape.B * shape.T, model->config.channels, 4 * model->config.channels);
    model->p = point_into(model->params.data(), model->layout);
    model->g = point_into(model->grads.data(), model->layout);
    model->max_B = shape.B;
    model->max_T = shape.T;
    model->recompute = shape.recompute;
    model->optimizer = shape.optimizer;
    if (shape.optimizer != Optimizer::AdamW) {  // ZeRO-1: whole blocks per rank (llmc/optim/factored_sharding.h)
        int N = shape.zero_stage == 1 ? shape.world_size : 1;
        std::vector<ParamBlock> all = slice_param_blocks(model->config, model->slice);  // (one rank: param_blocks)
        model->factored = factored_shard(all, model->layout.total, N);
        model->blocks = factored_owned_blocks(all, model->factored, N == 1 ? 0 : shape.rank);
        model->zero.whole_gradient = N > 1;
        model->moe_blocks = moe_param_blocks(model->config, model->moe_layout);  // (--moe-experts: ZeRO-0, every rank all)
    }
}

// ==============================================================================================
// The hooks: where every other technique attaches to the passes. Each is one call in gpt2_forward,
// gpt2_backward or ZB-H1's W (zero_bubble_weight_pass) below, with a one-line comment naming who
// fills it; on one rank with no technique flag each does the plain thing (a pointer into the stacked
// activations, a matmul, the dense MLP, a view of the flat arrays) and nothing else. The step's hooks are further
// down ("The hooks of the step"); each hook's own comment says what fills it:
//   layer_rows, keep_for_backward, recall_for_backward   what a layer keeps for its backward:
//        --recompute (llmc/model/recompute.h), --stash-precision bf16 (llmc/memory/stash_precision.h)
//   linear_forward, linear_backward   a matmul: tensor and sequence parallelism's gathers and sums around
//        it (llmc/parallel/tensor_parallel.h), ZB-H1's deferred weight gradient (llmc/model/zero_bubble_backward.h)
//   embedding_forward, embedding_backward, loss_forward   tensor parallelism's vocabulary rows
//   mlp_forward, mlp_backward   the dense GELU MLP, or --moe-experts (llmc/model/moe.h, moe_step.h) with
//        --expert-parallel (llmc/parallel/expert_parallel.h)
//   layer_weights, release_layer_weights, layer_grads, layer_grads_done   ZeRO-2/3 (llmc/parallel/zero.h)
//   pass_view   which layers a pass runs, in which activation slot: pipelines (llmc/parallel/pipeline_parallel.h)

// One block's slice of a stacked per-layer tensor.
static inline float* layer_slice(std::vector<float>& v, int l, size_t per_layer) { return v.data() + (size_t)l * per_layer; }

// Where the passes find layer l's fp32 copy of an activation: its slice of the stack when it is kept
// per layer in fp32, else (the stack is empty: --recompute does not keep it, or --stash-precision bf16
// keeps it in bf16) the one layer of scratch that the forward computes into and the backward refills.
static float* layer_or_scratch(std::vector<float>& stacked, std::vector<float>& scratch, int l, size_t per_layer) {
    return stacked.empty() ? scratch.data() : layer_slice(stacked, l, per_layer);
}

// The rows of the residual stream this rank holds: all B*T, or with sequence parallelism its 1/tp.
static size_t residual_rows(const GPT2* model, size_t BT) { return tp_local_rows(model->tp, BT); }

// Layer l's activations in one activation slot, as the passes address them. The stacks are laid out
// for the allocated (max_B, max_T), so a smaller forward still finds every layer where the backward
// expects it. What is not kept per layer in fp32 points into one layer of scratch (layer_or_scratch).
struct LayerRows {
    const float* residual;                                  // (R,C) the block's input
    float *ln1, *ln1_mean, *ln1_rstd, *qkv, *att, *atty;    // (R,C), (R), (R), (B,T,3Ca), (B,NH,T,T), (B,T,Ca)
    float* residual2;                                       // (R,C)
    float *ln2, *ln2_mean, *ln2_rstd, *fch, *fch_gelu;      // (R,C), (R), (R), (B,T,Cf), (B,T,Cf)
    float* residual3;                                       // (R,C) the block's output
};
// The strides of the stacks: one layer of each, in elements.
struct LayerStrides { size_t rows, tokens, att; };
static LayerStrides layer_strides(const GPT2* model) {
    size_t BTmax = (size_t)model->max_B * model->max_T;
    return {residual_rows(model, BTmax), BTmax, (size_t)model->max_B * model->slice.heads * model->max_T * model->max_T};
}
static LayerRows layer_rows(GPT2* model, Activations& a, int l) {
    const ModelSlice& s = model->slice;
    size_t C = (size_t)model->config.channels, Ca = (size_t)s.attn_channels, Cf = (size_t)s.fc_channels;
    LayerStrides n = layer_strides(model);
    Workspace& work = model->work;
    LayerRows x;
    x.residual = l == 0 ? a.encoded.data() : layer_slice(a.residual3, l - 1, n.rows * C);
    x.ln1 = layer_or_scratch(a.ln1, work.ln_recompute, l, n.rows * C);
    x.ln1_mean = layer_slice(a.ln1_mean, l, n.rows);
    x.ln1_rstd = layer_slice(a.ln1_rstd, l, n.rows);
    x.qkv = layer_or_scratch(a.qkv, work.stash_qkv, l, n.tokens * 3 * Ca);
    x.att = layer_or_scratch(a.att, work.stash_att, l, n.att);
    x.atty = layer_or_scratch(a.atty, work.stash_atty, l, n.tokens * Ca);
    x.residual2 = layer_slice(a.residual2, l, n.rows * C);
    x.ln2 = layer_or_scratch(a.ln2, work.ln_recompute, l, n.rows * C);  // (the same scratch: ln1 is dead by then)
    x.ln2_mean = layer_slice(a.ln2_mean, l, n.rows);
    x.ln2_rstd = layer_slice(a.ln2_rstd, l, n.rows);
    x.fch = layer_or_scratch(a.fch, work.stash_fch, l, n.tokens * Cf);
    x.fch_gelu = layer_or_scratch(a.fch_gelu, work.gelu_recompute, l, n.tokens * Cf);
    x.residual3 = layer_slice(a.residual3, l, n.rows * C);
    return x;
}

// A layer's two halves, for keep_for_backward and recall_for_backward.
enum LayerHalf { ATTENTION_HALF, MLP_HALF };

// --stash-precision bf16: layer l's slice of a bf16 stack keeps n values of x, rounded; and widens
// them again. Both do nothing at fp32, where the bf16 stack is empty.
static void stash_keep(std::vector<uint16_t>& stack, int l, size_t per_layer, const float* x, size_t n) {
    if (!stack.empty()) stash_round(stack.data() + (size_t)l * per_layer, x, n);
}
static void stash_refill(float* x, const std::vector<uint16_t>& stack, int l, size_t per_layer, size_t n) {
    if (!stack.empty()) stash_widen(x, stack.data() + (size_t)l * per_layer, n);
}

// keep_for_backward: the forward has read the half's activations for the last time. --stash-precision
// bf16 keeps its bf16 copy of them now (llmc/memory/stash_precision.h: after the last fp32 read, in the
// order ln1, qkv, att, atty, ln2, fch, fch_gelu). What --recompute does not keep needs nothing here:
// layer_rows put it in scratch, and recall_for_backward computes it again.
static void keep_for_backward(GPT2* model, Activations& a, const LayerRows& x, int l, LayerHalf half, int B, int T) {
    const ModelSlice& s = model->slice;
    size_t C = (size_t)model->config.channels, Ca = (size_t)s.attn_channels, Cf = (size_t)s.fc_channels;
    size_t BT = (size_t)B * T, R = residual_rows(model, BT);
    LayerStrides n = layer_strides(model);
    Activations::BF16Stash& st = a.stash;
    if (half == ATTENTION_HALF) {
        stash_keep(st.ln1, l, n.rows * C, x.ln1, R * C);
        stash_keep(st.qkv, l, n.tokens * 3 * Ca, x.qkv, BT * 3 * Ca);
        stash_keep(st.att, l, n.att, x.att, (size_t)B * s.heads * T * T);
        stash_keep(st.atty, l, n.tokens * Ca, x.atty, BT * Ca);
        return;
    }
    stash_keep(st.ln2, l, n.rows * C, x.ln2, R * C);
    if (is_moe_block(model->moe, l)) return;  // the experts' own activations stay fp32 (moe_acts)
    stash_keep(st.fch, l, n.tokens * Cf, x.fch, BT * Cf);
    stash_keep(st.fch_gelu, l, n.tokens * Cf, x.fch_gelu, BT * Cf);
}

// recall_for_backward: what the half's backward reads and the forward did not keep in fp32, rebuilt
// in the layer's scratch right before the half's backward: --recompute's with the forward's own
// function on the forward's own inputs (the same floats; llmc/model/recompute.h), --stash-precision
// bf16's widened. Whatever the scratch held before (another layer, or in a pipeline another
// micro-batch's forward, run in between by 1F1B) is overwritten first, so it cannot leak in.
// `weight_pass`: ZB-H1's W (gpt2_backward_weights), which reads the matmuls' inputs only.
static void recall_for_backward(GPT2* model, Activations& a, const LayerRows& x, const ParamTensors<float>& w, int l,
                                LayerHalf half, int B, int T, bool weight_pass = false) {
    const ModelSlice& s = model->slice;
    size_t C = (size_t)model->config.channels, Ca = (size_t)s.attn_channels, Cf = (size_t)s.fc_channels;
    size_t BT = (size_t)B * T, R = residual_rows(model, BT);
    LayerStrides n = layer_strides(model);
    const Activations::BF16Stash& st = a.stash;
    RecomputePlan keep = recompute_plan(model->recompute);
    float* ln_scratch = model->work.ln_recompute.data();
    if (half == ATTENTION_HALF) {
        stash_refill(x.atty, st.atty, l, n.tokens * Ca, BT * Ca);
        if (!weight_pass) stash_refill(x.qkv, st.qkv, l, n.tokens * 3 * Ca, BT * 3 * Ca);
        if (!weight_pass) stash_refill(x.att, st.att, l, n.att, (size_t)B * s.heads * T * T);
        // level 2: ln1(residual), into the scratch ln2 had (the MLP's backward read it last)
        if (!keep.ln) layernorm_recompute(ln_scratch, x.residual, x.ln1_mean, x.ln1_rstd, w[LN1W], w[LN1B], (int)R, (int)C);
        stash_refill(x.ln1, st.ln1, l, n.rows * C, R * C);
        return;
    }
    if (!is_moe_block(model->moe, l)) {  // (an MoE block does not run its layer again: llmc/model/moe.h, recompute)
        if (!weight_pass || !keep.gelu) stash_refill(x.fch, st.fch, l, n.tokens * Cf, BT * Cf);
        if (!weight_pass || keep.gelu) stash_refill(x.fch_gelu, st.fch_gelu, l, n.tokens * Cf, BT * Cf);
        // level 1+: the projection's input, GELU(fch) (with a bf16 stash: of the widened fch)
        if (!keep.gelu) gelu_forward(x.fch_gelu, x.fch, BT * Cf);
    }
    // level 2: this rank's rows of ln2(residual2); with sequence parallelism the all-gather of the fc
    // matmul's input is the one the backward does at every level (it never kept the gathered rows)
    if (!keep.ln) layernorm_recompute(ln_scratch, x.residual2, x.ln2_mean, x.ln2_rstd, w[LN2W], w[LN2B], (int)R, (int)C);
    stash_refill(x.ln2, st.ln2, l, n.rows * C, R * C);
}

// The model's matmuls, and how tensor parallelism cuts each (llmc/parallel/tensor_parallel.h): by
// output columns (with sequence parallelism the input's rows all-gathered first; in the backward the
// input gradient's partial sums summed over the tensor group), or by input rows (the output a partial
// sum, summed over the tensor group, then the bias). On one rank every cut is the plain matmul.
enum LinearLayer { LIN_QKV, LIN_ATTPROJ, LIN_FC, LIN_FCPROJ, LIN_LM_HEAD };
struct LinearCut {
    bool by_rows;
    const char *forward_comm, *backward_comm;  // the collectives' names, for their error messages
};
static const LinearCut linear_cuts[] = {
    {false, "all-gather before the qkv matmul", "all-reduce of the attention's input gradient"},
    {true, "all-reduce after the attention projection", "all-gather of the attention's output gradient"},
    {false, "all-gather before the MLP", "all-reduce of the MLP's input gradient"},
    {true, "all-reduce after the MLP", "all-gather of the MLP's output gradient"},
    {false, "all-gather before the LM head", "all-reduce of the LM head's input gradient"},
};

// linear_forward: out = in W^T + b over BT rows (b may be null), IC -> OC.
static void linear_forward(GPT2* model, LinearLayer op, float* out, const float* in, const float* W, const float* b, size_t BT,
                           int IC, int OC) {
    TensorParallel* tp = &model->tp;
    const LinearCut& cut = linear_cuts[op];
    float* gathered = model->work.gathered.data();
    if (!cut.by_rows) {
        matmul_forward(out, tp_all_rows(tp, in, gathered, BT, IC, cut.forward_comm), W, b, (int)BT, IC, OC);
        return;
    }
    float* partial = tp_partial_buffer(*tp, out, gathered);
    matmul_forward(partial, in, W, nullptr, (int)BT, IC, OC);  // tensor parallel: a partial sum
    tp_sum_rows(tp, partial, out, BT, OC, cut.forward_comm);
    add_bias(out, b, (int)residual_rows(model, BT), OC);
}

// linear_backward: d(in) into dinp, dW and db ADDED to (db may be null). Returns where d(in) is:
// dinp, or with tensor parallelism's column cut this rank's rows of its sum over the tensor group.
// ZB-H1: with `defer` (its layer's slot of the micro-batch's weight stash), dout is copied there for
// gpt2_backward_weights instead of dW, db being added (cpu_layers.h's matmul_backward_or_defer).
static const float* linear_backward(GPT2* model, LinearLayer op, float* dinp, float* dW, float* db, const float* dout,
                                    const float* in, const float* W, size_t BT, int IC, int OC, float* defer) {
    TensorParallel* tp = &model->tp;
    const LinearCut& cut = linear_cuts[op];
    float* gathered = model->work.gathered.data();
    if (cut.by_rows) {
        dout = tp_all_rows(tp, dout, gathered, BT, OC, cut.backward_comm);
        matmul_backward_or_defer(dinp, dW, db, dout, in, W, (int)BT, IC, OC, defer);
        return dinp;
    }
    in = tp_all_rows(tp, in, gathered, BT, IC, cut.forward_comm);
    matmul_backward_or_defer(dinp, dW, db, dout, in, W, (int)BT, IC, OC, defer);
    return tp_sum_rows(tp, dinp, model->work.dlocal.data(), BT, IC, cut.backward_comm);
}

// ZB-H1: where layer l's deferred weight gradients wait in the micro-batch's stash (all null without
// one: the whole backward now).
static LayerWeightStash deferred_weights(const GPT2* model, float* stash, int l, size_t BT) {
    const ModelSlice& s = model->slice;
    return stash ? layer_weight_stash(stash, l, BT, model->config.channels, s.attn_channels, s.fc_channels) : LayerWeightStash{};
}

// embedding_forward: the token and position embeddings into out (R, C). Tensor parallelism: each rank
// looked up its vocabulary rows (zeros for the others); sum the lookups, then add positions once.
static void embedding_forward(GPT2* model, float* out, const int* inputs, const ParamTensors<float>& w, int B, int T) {
    const ModelSlice& s = model->slice;
    TensorParallel* tp = &model->tp;
    int C = model->config.channels;
    size_t BT = (size_t)B * T;
    float* x = tp_partial_buffer(*tp, out, model->work.gathered.data());
    encoder_forward(x, inputs, w[WTE], tp->degree == 1 ? w[WPE] : nullptr, B, T, C, s.vocab_begin, s.vocab_rows);
    if (tp->degree > 1) {
        x = tp_sum_rows(tp, x, out, BT, C, "all-reduce of the embeddings");
        position_forward(x, w[WPE], tp_first_row(*tp, BT), residual_rows(model, BT), T, C);
    }
}
// embedding_backward: dwte, dwpe from d(the residual stream's input), every rank's rows of it gathered.
static void embedding_backward(GPT2* model, const ParamTensors<float>& g, const float* dresidual, const int* inputs, int B, int T) {
    const ModelSlice& s = model->slice;
    int C = model->config.channels;
    const float* dout = tp_all_rows(&model->tp, dresidual, model->work.gathered.data(), (size_t)B * T, C,
                                    "all-gather of the embeddings' gradient");
    encoder_backward(g[WTE], g[WPE], dout, inputs, B, T, C, s.vocab_begin, s.vocab_rows);
}
// loss_forward: the per-token losses and the softmax normalisers of the logits in `h`. Tensor
// parallelism: every tensor rank holds its vocabulary rows of the logits (tensor_parallel_loss.h).
// With a dloss (training) on one tensor rank, the logits' gradient too, in the same pass over them
// (crossentropy_forward_backward); the backward then finds it in place of the logits.
static void loss_forward(GPT2* model, Activations& h, const int* targets, size_t BT, float dloss) {
    const ModelSlice& s = model->slice;
    h.logits_hold_gradient = model->tp.degree == 1 && dloss != 0.0f;
    if (h.logits_hold_gradient)
        crossentropy_forward_backward(h.losses.data(), h.logsumexp.data(), h.logits.data(), targets, (int)BT, s.vocab_real,
                                      s.vocab_rows, dloss);
    else if (model->tp.degree == 1)
        crossentropy_forward(h.losses.data(), h.logsumexp.data(), h.logits.data(), targets, (int)BT, s.vocab_real, s.vocab_rows);
    else
        crossentropy_forward_vocab_parallel(&model->tp, h.losses.data(), h.logsumexp.data(), h.logits.data(), targets, (int)BT,
                                            s.vocab_real, s.vocab_rows, s.vocab_begin);
}

// The passes ask for a layer's weights and gradients by the layer (ENDS: wte, wpe and the final
// LayerNorm, which the embedding and the head share). ZeRO groups them in units (llmc/parallel/zero.h:
// one a layer, and the ends): only these four hooks know it.
static const int ENDS = -1;
static int zero_unit(const GPT2* model, int l) {
    int L = model->slice.num_layers;
    return l == ENDS ? ends_unit(L) : unit_of_layer(L, l);
}
// The weights of layer l as the kernels address them: pointers into the flat array (layer l's part of
// each stacked tensor), or with ZeRO-3 into a buffer that all-gathered them from the data-parallel ranks
// just now.
static ParamTensors<float> layer_weights(GPT2* model, int l) {
    int unit = zero_unit(model, l);
    if (model->zero.stage == 3) return unit_view(model->zero.units[unit], zero_gather(&model->zero, unit, "all-gather of a layer's weights (ZeRO-3)"), true);
    return flat_unit_view(model->params.data(), model->layout, model->slice.num_layers, unit);
}
static void release_layer_weights(GPT2* model, int l) {
    if (model->zero.stage == 3) zero_release(&model->zero, zero_unit(model, l));
}
// Where the backward pass adds layer l's gradients: the flat array, or with ZeRO-2/3 a bucket.
static ParamTensors<float> layer_grads(GPT2* model, int l) {
    int unit = zero_unit(model, l);
    if (model->zero.stage >= 2) return unit_view(model->zero.units[unit], zero_open_bucket(&model->zero, unit), true);
    return flat_unit_view(model->grads.data(), model->layout, model->slice.num_layers, unit);
}
// Layer l's gradient is complete for this micro-batch: with ZeRO-2/3, reduce-scatter its bucket now
// (summing the sequence-parallel LayerNorm gradients over the tensor group first).
static void layer_grads_done(GPT2* model, int l) {
    if (model->zero.stage < 2) return;
    int unit = zero_unit(model, l);
    ParamTensors<float> g = unit_view(model->zero.units[unit], model->zero.buckets[unit].data(), true);
    std::vector<std::pair<float*, size_t>> layernorms;
    for (int t : {LN1W, LN1B, LN2W, LN2B, LNFW, LNFB})
        if (g[t]) layernorms.push_back({g[t], (size_t)model->config.channels});
    tp_sum_replicated_grads(&model->tp, layernorms);
    zero_reduce_bucket(&model->zero, unit, "reduce-scatter of a layer's gradients (ZeRO-2/3)");
}
// The LM head is the tied wte: the ends unit's, or on the last stage of a pipeline its copy.
static const float* lm_head_weights(GPT2* model, const ParamTensors<float>& ends) {
    return model->slice.first_stage ? ends[WTE] : model->lent_wte.data();
}
static float* lm_head_grads(GPT2* model, const ParamTensors<float>& ends) {
    return model->slice.first_stage ? ends[WTE] : model->lent_wte_grad.data();
}
// Where the head of the micro-batch in `slot` keeps its rows (lnf, logits, losses): the slot, or
// with interleaving the one set in slot 0 (cpu_buffer_slots: one head in flight at a time).
static Activations& head_rows(GPT2* model, int slot) { return model->acts[model->slice.chunks > 1 ? 0 : (size_t)slot]; }
// What one pass runs and where its activations are: on one rank, every layer with the embedding and
// the head, in activation slot 0. Pipelines: the stage's layers, the micro-batch's slot; interleaved
// 1F1B: model chunk `chunk` alone (pass_layers: its layers, and the embedding or the head where the
// chunk has them), the slot holding that chunk's layers (slot layer i = local layer first + i).
struct PassView {
    PassLayers layers;
    Activations *acts, *head;   // the layers' activations; the head's rows (head_rows)
};
static PassView pass_view(GPT2* model, int slot, int chunk) {
    return {pass_layers(model->slice, chunk), &model->acts[(size_t)slot], &head_rows(model, slot)};
}

// The MLP of MoE block l (--moe-experts): y (BT, C) = the experts' mixture of ln2, its statistics
// into the step's; --expert-parallel runs the experts on their owners (llmc/model/moe_step.h).
static ExpertParallelBlock* ep_block(GPT2* model, int b) { return model->ep ? &model->ep_blocks[(size_t)b] : nullptr; }
static void moe_mlp_forward(GPT2* model, const ParamTensors<float>& w, int l, const float* ln2, float* y, int BT) {
    int b = moe_block_index(model->moe, l);
    MoEWeights<const float> mw = moe_block_weights<const float>(w, model->moe_params.data(), model->moe_layout, b);
    moe_block_forward(y, &model->moe_acts[(size_t)b], model->moe_shape, mw, ln2, BT, model->ep, ep_block(model, b), &model->moe_stats);
}

// Its backward: the experts' and the router's gradients, d(ln2) returned (in dbuf_c).
static const float* moe_mlp_backward(GPT2* model, const ParamTensors<float>& w, const ParamTensors<float>& g, int l,
                                     const float* ln2, const float* dresidual, size_t BT, float dloss_mean) {
    TensorParallel* tp = &model->tp;
    int b = moe_block_index(model->moe, l), C = model->config.channels;
    float* dln2 = model->work.dbuf_c.data();
    const float* dout = tp_all_rows(tp, dresidual, model->work.gathered.data(), BT, C, "all-gather of the MLP's output gradient");
    // d(optimised loss)/d(this micro-batch's L_aux + L_z): the step's auxiliary loss is the mean
    // over its micro-batches and ranks, 1/(m dp) = dloss_mean * B*T (dloss_mean = 1/(B T m dp))
    float aux_scale = (float)((double)dloss_mean * (double)BT);
    MoEWeights<float> mg = moe_block_weights<float>(g, model->moe_grads.data(), model->moe_layout, b);
    MoEWeights<const float> mw = moe_block_weights<const float>(w, model->moe_params.data(), model->moe_layout, b);
    moe_block_backward(dln2, mg, &model->moe_acts[(size_t)b], model->moe_shape, mw, ln2, dout, aux_scale, model->ep, ep_block(model, b));
    return tp_sum_rows(tp, dln2, model->work.dlocal.data(), BT, C, "all-reduce of the MLP's input gradient");
}

// ZB-H1's W of the micro-batch whose B (gpt2_backward with `stash`) kept, in `stash`, each block
// matmul's output gradient: the weight and bias gradients of the four matmuls of every layer of the
// stage (B did the rest), in B's order. The inputs it reads where B read them, in
// the micro-batch's slot `slot` (its own, or the one its rows were parked in: park_weight_inputs),
// rebuilt as B rebuilt them (--recompute; --stash-precision bf16's widening too, though the grid
// checks refuse bf16 with pipelines today: the same functions, the same floats). Runs in micro-batch
// order, so every gradient collects the micro-batches' additions in the order the whole backward
// adds them: the same bits.
// (zero_bubble_problem keeps tensor parallelism away, and pipelines ZeRO-2/3: rows local, gradients flat.)
static void zero_bubble_weight_pass(GPT2* model, int B, int T, int slot, float* stash) {
    const ModelSlice& s = model->slice;
    int L = s.num_layers, C = model->config.channels, Ca = s.attn_channels, Cf = s.fc_channels;
    size_t N = (size_t)B * T;
    Activations& a = model->acts[(size_t)slot];
    for (int l = L - 1; l >= 0; l--) {
        ParamTensors<float> w = layer_weights(model, l), g = layer_grads(model, l);
        LayerRows x = layer_rows(model, a, l);
        LayerWeightStash k = deferred_weights(model, stash, l, N);
        recall_for_backward(model, a, x, w, l, MLP_HALF, B, T, true);  // recompute, stash precision: ln2, fch_gelu again
        matmul_backward_weight(g[FCPROJW], g[FCPROJB], k.fcproj, x.fch_gelu, (int)N, Cf, C);
        matmul_backward_weight(g[FCW], g[FCB], k.fc, x.ln2, (int)N, C, Cf);
        recall_for_backward(model, a, x, w, l, ATTENTION_HALF, B, T, true);  // recompute, stash precision: ln1, atty
        matmul_backward_weight(g[ATTPROJW], g[ATTPROJB], k.attproj, x.atty, (int)N, Ca, C);
        matmul_backward_weight(g[QKVW], g[QKVB], k.qkv, x.ln1, (int)N, C, 3 * Ca);
        release_layer_weights(model, l);
    }
}

// ==============================================================================================
// The model's passes: llm.c's forward and backward, one call per kernel, the hooks above between them.

// The dense MLP of a block: residual3 (before its residual add) = fcproj(gelu(fc(ln2))).
static void dense_mlp_forward(GPT2* model, const ParamTensors<float>& w, const LayerRows& x, size_t BT) {
    int C = model->config.channels, Cf = model->slice.fc_channels;
    linear_forward(model, LIN_FC, x.fch, x.ln2, w[FCW], w[FCB], BT, C, Cf);
    gelu_forward(x.fch_gelu, x.fch, BT * Cf);
    linear_forward(model, LIN_FCPROJ, x.residual3, x.fch_gelu, w[FCPROJW], w[FCPROJB], BT, Cf, C);
}
// Its backward: the weights' gradients added, d(ln2) returned. k: ZB-H1's deferred weight gradients.
static const float* dense_mlp_backward(GPT2* model, const ParamTensors<float>& w, const ParamTensors<float>& g, const LayerRows& x,
                                       const float* dresidual, const LayerWeightStash& k, size_t BT) {
    int C = model->config.channels, Cf = model->slice.fc_channels;
    float* dfch = model->work.dbuf_4c.data();
    linear_backward(model, LIN_FCPROJ, dfch, g[FCPROJW], g[FCPROJB], dresidual, x.fch_gelu, w[FCPROJW], BT, Cf, C, k.fcproj);
    gelu_backward(dfch, x.fch, dfch, BT * Cf);
    return linear_backward(model, LIN_FC, model->work.dbuf_c.data(), g[FCW], g[FCB], dfch, x.ln2, w[FCW], BT, C, Cf, k.fc);
}
// mlp_forward / mlp_backward: block l's MLP, the dense one or (--moe-experts, its --moe-every blocks)
// the MoE layer with its router, whose experts --expert-parallel runs on their owners.
static void mlp_forward(GPT2* model, const ParamTensors<float>& w, const LayerRows& x, int l, size_t BT) {
    if (is_moe_block(model->moe, l)) moe_mlp_forward(model, w, l, x.ln2, x.residual3, (int)BT);
    else dense_mlp_forward(model, w, x, BT);
}
static const float* mlp_backward(GPT2* model, const ParamTensors<float>& w, const ParamTensors<float>& g, const LayerRows& x, int l,
                                 const float* dresidual, const LayerWeightStash& k, size_t BT, float dloss_mean) {
    if (is_moe_block(model->moe, l)) return moe_mlp_backward(model, w, g, l, x.ln2, dresidual, BT, dloss_mean);
    return dense_mlp_backward(model, w, g, x, dresidual, k, BT);
}

// Forward pass over B x T tokens (B <= max_B, T <= max_T) of the micro-batch in activation slot
// `slot`, up to the logits (B, T, Vp). A pipeline stage without the embedding finds its input in
// acts.encoded; one without the head leaves its output in the last layer's residual3.
// Interleaved 1F1B: the pass of model chunk `chunk` alone (pass_view). Every other schedule has one
// chunk: all of the slice's layers.
void gpt2_forward(GPT2* model, const int* inputs, int B, int T, int slot = 0, int chunk = 0) {
    const ModelSlice& s = model->slice;
    PassView pass = pass_view(model, slot, chunk);  // pipelines: the micro-batch's slot, the chunk's layers
    const PassLayers& layers = pass.layers;
    Activations& a = *pass.acts, &h = *pass.head;
    int C = model->config.channels, Ca = s.attn_channels, NH = s.heads, Vp = s.vocab_rows;
    size_t BT = (size_t)B * T, R = residual_rows(model, BT);

    if (layers.embeds) {
        ParamTensors<float> w = layer_weights(model, ENDS);  // ZeRO-3: all-gathered now, freed below
        embedding_forward(model, a.encoded.data(), inputs, w, B, T);  // tensor parallel: vocabulary rows, summed
        release_layer_weights(model, ENDS);
    }
    for (int l = 0; l < layers.count; l++) {  // l: the slot's layer; layers.first + l: the slice's
        ParamTensors<float> w = layer_weights(model, layers.first + l);  // ZeRO-3
        LayerRows x = layer_rows(model, a, l);  // recompute, stash precision: some in one layer's scratch
        // attention: residual2 = residual + attproj(attention(qkv(ln1(residual))))
        layernorm_forward(x.ln1, x.ln1_mean, x.ln1_rstd, x.residual, w[LN1W], w[LN1B], (int)R, C);
        linear_forward(model, LIN_QKV, x.qkv, x.ln1, w[QKVW], w[QKVB], BT, C, 3 * Ca);  // tensor, sequence parallel
        attention_forward(x.atty, x.att, x.qkv, B, T, Ca, NH);
        linear_forward(model, LIN_ATTPROJ, x.residual2, x.atty, w[ATTPROJW], w[ATTPROJB], BT, Ca, C);
        residual_forward(x.residual2, x.residual2, x.residual, R * C);
        keep_for_backward(model, a, x, l, ATTENTION_HALF, B, T);  // stash precision: a bf16 copy of ln1, qkv, att, atty
        // MLP: residual3 = residual2 + mlp(ln2(residual2))
        layernorm_forward(x.ln2, x.ln2_mean, x.ln2_rstd, x.residual2, w[LN2W], w[LN2B], (int)R, C);
        mlp_forward(model, w, x, l, BT);  // dense GELU MLP; MoE; expert parallel
        keep_for_backward(model, a, x, l, MLP_HALF, B, T);  // stash precision: of ln2, fch, fch_gelu
        residual_forward(x.residual3, x.residual3, x.residual2, R * C);
        release_layer_weights(model, layers.first + l);  // ZeRO-3: freed
    }
    if (!layers.head) return;  // the last layer's residual3 goes to the next stage

    const float* last = layers.count > 0 ? layer_rows(model, a, layers.count - 1).residual3 : a.encoded.data();
    ParamTensors<float> w = layer_weights(model, ENDS);
    layernorm_forward(h.lnf.data(), h.lnf_mean.data(), h.lnf_rstd.data(), last, w[LNFW], w[LNFB], (int)R, C);
    linear_forward(model, LIN_LM_HEAD, h.logits.data(), h.lnf.data(), lm_head_weights(model, w), nullptr, BT, C, Vp);  // tied
    release_layer_weights(model, ENDS);
}

// Loss of the forward just run in slot `slot` (the last stage's), per token into acts.losses, and
// the mean returned (summed in double). With tensor parallelism every tensor rank of the last stage
// takes part (its logits are its vocabulary rows). gpt2_backward turns the logits into their gradient,
// or, given the backward's `dloss_mean` (training), this does, in the same pass (as the GPU's loss).
float gpt2_loss(GPT2* model, const int* targets, int B, int T, int slot = 0, float dloss_mean = 0.0f) {
    size_t BT = (size_t)B * T;
    Activations& a = head_rows(model, slot);
    loss_forward(model, a, targets, BT, dloss_mean);  // tensor parallel: the vocabulary-parallel cross-entropy
    double total = 0.0;
    for (size_t i = 0; i < BT; i++) total += a.losses[i];
    return (float)(total / BT);
}

// Backward pass for the last forward of slot `slot` (which must have had targets). Gradients are
// ADDED to model->grads, so micro-batches accumulate; `dloss_mean` is d(optimised loss)/d(this
// micro-batch's summed per-token losses), 1/(B*T*accumulation_steps) for a mean over the whole
// step. A pipeline stage without the head finds d(its output) in acts.dresidual; one without the
// embedding leaves d(its input) there, for the previous stage.
// ZB-H1 (llmc/model/zero_bubble_backward.h): with a `stash`, B, the input gradients: each block's
// matmul copies its output gradient into the stash instead of adding its weight gradient, which
// gpt2_backward_weights adds later from it and the matmul's input, left in the slot (the LM head's,
// the LayerNorms' and the embedding's are added here). Without one (every other schedule), the
// whole backward.
// Interleaved 1F1B: model chunk `chunk`'s backward, as gpt2_forward's.
void gpt2_backward(GPT2* model, const int* inputs, const int* targets, int B, int T, float dloss_mean,
                   int slot = 0, float* stash = nullptr, int chunk = 0) {
    const ModelSlice& s = model->slice;
    PassView pass = pass_view(model, slot, chunk);  // pipelines: the micro-batch's slot, the chunk's layers
    const PassLayers& layers = pass.layers;
    Activations& a = *pass.acts, &h = *pass.head;
    int C = model->config.channels, Ca = s.attn_channels, NH = s.heads, Vp = s.vocab_rows;
    size_t BT = (size_t)B * T, R = residual_rows(model, BT);
    Workspace& work = model->work;
    float* dresidual = a.dresidual.data();

    if (layers.head) {  // classifier and final LayerNorm
        const float* last = layers.count > 0 ? layer_rows(model, a, layers.count - 1).residual3 : a.encoded.data();
        ParamTensors<float> w = layer_weights(model, ENDS), g = layer_grads(model, ENDS);
        if (!h.logits_hold_gradient)  // (gpt2_loss may have done it: then with this dloss_mean)
            crossentropy_softmax_backward(h.logits.data(), h.logsumexp.data(), targets, (int)BT, s.vocab_real, Vp, dloss_mean,
                                          s.vocab_begin);
        h.logits_hold_gradient = false;
        // (never deferred: ZB-H1's W would need dlogits, B x T x Vp, kept: more than the micro-batch's other activations)
        const float* dlnf = linear_backward(model, LIN_LM_HEAD, work.dbuf_c.data(), lm_head_grads(model, g), nullptr, h.logits.data(),
                                            h.lnf.data(), lm_head_weights(model, w), BT, C, Vp, nullptr);
        memset(dresidual, 0, R * C * sizeof(float));
        layernorm_backward(dresidual, g[LNFW], g[LNFB], dlnf, last, w[LNFW], h.lnf_mean.data(), h.lnf_rstd.data(), (int)R, C);
        release_layer_weights(model, ENDS);  // (their gradient bucket stays open until the embedding's backward)
    }

    // blocks, top to bottom; dresidual carries d(loss)/d(block output) down the residual stream
    for (int l = layers.count - 1; l >= 0; l--) {  // l: the slot's layer; layers.first + l: the slice's
        int layer = layers.first + l;  // (l: the slot's layer)
        ParamTensors<float> w = layer_weights(model, layer), g = layer_grads(model, layer);  // ZeRO-3 weights, ZeRO-2/3 bucket
        LayerRows x = layer_rows(model, a, l);
        LayerWeightStash k = deferred_weights(model, stash, l, BT);  // ZB-H1's W: where each matmul's dout waits
        // MLP: residual3 = residual2 + mlp(ln2(residual2))
        recall_for_backward(model, a, x, w, l, MLP_HALF, B, T);  // recompute, stash precision: ln2, fch, fch_gelu again
        const float* dln2 = mlp_backward(model, w, g, x, l, dresidual, k, BT, dloss_mean);  // dense GELU MLP; MoE; expert parallel
        layernorm_backward(dresidual, g[LN2W], g[LN2B], dln2, x.residual2, w[LN2W], x.ln2_mean, x.ln2_rstd, (int)R, C);
        // attention: residual2 = residual + attproj(attention(qkv(ln1(residual))))
        recall_for_backward(model, a, x, w, l, ATTENTION_HALF, B, T);  // recompute, stash precision: ln1, qkv, att, atty
        const float* datty = linear_backward(model, LIN_ATTPROJ, work.dbuf_c.data(), g[ATTPROJW], g[ATTPROJB], dresidual, x.atty,
                                             w[ATTPROJW], BT, Ca, C, k.attproj);  // tensor parallel; ZB-H1 defers dW
        attention_backward(work.dbuf_3c.data(), datty, x.qkv, x.att, B, T, Ca, NH);
        const float* dln1 = linear_backward(model, LIN_QKV, work.dbuf_c.data(), g[QKVW], g[QKVB], work.dbuf_3c.data(), x.ln1, w[QKVW],
                                            BT, C, 3 * Ca, k.qkv);
        layernorm_backward(dresidual, g[LN1W], g[LN1B], dln1, x.residual, w[LN1W], x.ln1_mean, x.ln1_rstd, (int)R, C);
        layer_grads_done(model, layer);  // ZeRO-2/3: reduce-scatter the layer's bucket
        release_layer_weights(model, layer);
    }
    if (!layers.embeds) return;  // dresidual, d(loss)/d(this stage's input), goes to the previous stage

    ParamTensors<float> g = layer_grads(model, ENDS);
    embedding_backward(model, g, dresidual, inputs, B, T);  // sequence parallel: every rank's rows
    layer_grads_done(model, ENDS);
}

// ZB-H1's W of the micro-batch whose B (gpt2_backward with `stash`) kept its output gradients in
// `stash`: zero_bubble_weight_pass, above the passes.
void gpt2_backward_weights(GPT2* model, int B, int T, int slot, float* stash) { zero_bubble_weight_pass(model, B, T, slot, stash); }

// ZB-H1 (llmc/model/zero_bubble_backward.h): a forward is taking slot `slot` while the micro-batch
// that had it still waits for its W. The rows W reads move to a parked slot whose W has run, by
// vector swaps (no copy), and that slot's vectors take their place; the slot's other rows are free
// since B, as in 1F1B. cpu_buffer_copies sized the parked slots for the most that wait at once.
static void park_weight_inputs(GPT2* model, size_t slot) {
    for (size_t e = model->forward_slots; e < model->acts.size(); e++) {
        if (model->acts[e].weight_owner >= 0) continue;
        for (int b = 0; b < CB_COUNT; b++) {
            if (!cpu_buffer_read_by_weight_pass(b, model->recompute)) continue;
            if (std::vector<float>* v = gpt2_buffer(model, b, (int)slot)) v->swap(*gpt2_buffer(model, b, (int)e));
            if (std::vector<uint16_t>* v = gpt2_buffer16(model, b, (int)slot)) v->swap(*gpt2_buffer16(model, b, (int)e));
        }
        std::swap(model->acts[slot].weight_owner, model->acts[e].weight_owner);
        return;
    }
    fail("ZB-H1: no free slot to park micro-batch %d's inputs for its W (cpu_buffer_copies is wrong)", model->acts[slot].weight_owner);
}

// ZB-H1: the slot that holds micro-batch `micro`'s rows for its W: its own, or where they were parked.
static int weight_input_slot(GPT2* model, int micro) {
    for (size_t e = 0; e < model->acts.size(); e++)
        if (model->acts[e].weight_owner == micro) return (int)e;
    fail("ZB-H1: micro-batch %d's W finds no slot holding its inputs", micro);
}

// ==============================================================================================
// The optimizer step: AdamW (its arithmetic, and the gradient norm's, are in llmc/optim/adamw.h) on
// each parameter group this rank updates, or --optimizer adafactor (llmc/optim/adafactor.h) or sm3
// (llmc/optim/sm3.h). The groups: the flat array of the model (or of this rank's slice), and with
// --moe-experts the MoE table (llmc/model/moe_step.h). Each group's optimizer is chosen by the flags,
// in one switch (group_optimizer).

// AdamW on the parameters this rank updates: all of its slice, or with ZeRO its shards
// (llmc/parallel/zero.h lists them as pieces, each within one tensor, with where its weights, reduced
// gradients and moments are). Weight decay differs per tensor; each element's update depends on
// nothing but its own values, which is why updating the model shard by shard gives exactly the
// weights of updating it whole.
static void adamw_params(GPT2* model, float lr, const TrainOptions& o, int t, float grad_scale) {
    Zero& z = model->zero;
    for (const ZeroPiece& piece : zero_owned_pieces(z)) {
        float wd = param_tensor_decays(piece.tensor) ? o.weight_decay : 0.0f;
        adamw_update(zero_param_of(z, piece, model->params), zero_grad_of(z, piece, model->grads),
                     model->adam_m.data() + piece.stored, model->adam_v.data() + piece.stored, piece.count, lr, o.beta1,
                     o.beta2, o.adam_eps, wd, t, grad_scale);
    }
}
// --optimizer-state bf16 (llmc/optim/adamw_bf16.h): the same, with m and v rounded to bf16; the
// element's index in the whole model keys its random rounding (on a tensor- or pipeline-parallel
// rank, through its slice's map; one rank's slice is the model)
static void adamw_bf16_params(GPT2* model, float lr, const TrainOptions& o, int t, float grad_scale) {
    Zero& z = model->zero;
    SliceIndexMap keys = slice_index_map(model->config, model->slice);
    bool sliced = model->slice.tp > 1 || model->slice.stages > 1;
    for (const ZeroPiece& piece : zero_owned_pieces(z)) {
        float wd = param_tensor_decays(piece.tensor) ? o.weight_decay : 0.0f;
        adamw_update_bf16(zero_param_of(z, piece, model->params), zero_grad_of(z, piece, model->grads),
                          model->adam_m16.data() + piece.stored, model->adam_v16.data() + piece.stored, piece.count, lr,
                          o.beta1, o.beta2, o.adam_eps, wd, t, grad_scale, piece.local, sliced ? &keys : nullptr);
    }
}
// --offload-dir (llmc/optim/disk_offload.h): the same AdamW (fp32 or bf16 moments), on the parts of
// each piece in the chunk of m and v the stream holds now
static void disk_offload_params(GPT2* model, float lr, const TrainOptions& o, int t, float grad_scale) {
    Zero& z = model->zero;
    std::vector<ZeroPiece> pieces = zero_owned_pieces(z);
    disk_offload_check(model->offload);
    disk_offload_stream(&model->offload, 3, 3, [&](size_t begin, size_t count, void* m, void* v) {
        for (const ZeroPiece& piece : pieces) {
            size_t lo = std::max(piece.stored, begin), hi = std::min(piece.stored + piece.count, begin + count);
            if (lo >= hi) continue;
            float wd = param_tensor_decays(piece.tensor) ? o.weight_decay : 0.0f;
            size_t in_piece = lo - piece.stored;
            float* p = zero_param_of(z, piece, model->params) + in_piece;
            const float* g = zero_grad_of(z, piece, model->grads) + in_piece;
            if (model->bf16_moments)  // keyed by the element's index in the flat array, as in RAM
                adamw_update_bf16(p, g, (uint16_t*)m + (lo - begin), (uint16_t*)v + (lo - begin), hi - lo, lr, o.beta1,
                                  o.beta2, o.adam_eps, wd, t, grad_scale, piece.local + in_piece);
            else
                adamw_update(p, g, (float*)m + (lo - begin), (float*)v + (lo - begin), hi - lo, lr, o.beta1, o.beta2,
                             o.adam_eps, wd, t, grad_scale);
        }
    });
}
// The factored optimizers: every rank holds its slice and its summed gradient (ZeRO-0 or ZeRO-1,
// no pipeline: validate_options), and updates its blocks (all of them, or with ZeRO-1 its share of
// whole matrices: llmc/optim/factored_sharding.h), as one rank would; the blocks tensor parallelism
// cuts complete their statistics over the tensor group (llmc/optim/factored_tensor_parallel.h).
// The MoE table's each router and expert tensor is a block of its own, on every rank.
static const FactoredGroup* factored_tp_group(GPT2* model) { return model->tp.degree > 1 ? &model->factored_tp : nullptr; }
static void adafactor_params(GPT2* model, float lr, const TrainOptions& o, int t, float grad_scale) {
    adafactor_step(model->params.data(), model->grads.data(), model->optimizer_state.data(), model->blocks, lr, t,
                   o.weight_decay, grad_scale, factored_tp_group(model));
}
static void adafactor_moe_table(GPT2* model, float lr, const TrainOptions& o, int t, float grad_scale) {
    adafactor_step(model->moe_params.data(), model->moe_grads.data(), model->moe_factored.data(), model->moe_blocks, lr, t,
                   o.weight_decay, grad_scale);
}
static void sm3_params(GPT2* model, float lr, const TrainOptions& o, int, float grad_scale) {
    sm3_step_all(model->params.data(), model->grads.data(), model->optimizer_state.data(), model->optimizer_scratch.data(),
                 model->blocks, lr, o.weight_decay, grad_scale, factored_tp_group(model));
}
static void sm3_moe_table(GPT2* model, float lr, const TrainOptions& o, int, float grad_scale) {
    sm3_step_all(model->moe_params.data(), model->moe_grads.data(), model->moe_factored.data(),
                 model->optimizer_scratch.data(), model->moe_blocks, lr, o.weight_decay, grad_scale);
}
// --moe-experts with AdamW: the table whole, or with --zero 1|2 this rank's shards (llmc/model/moe_step.h)
static void adamw_moe_table(GPT2* model, float lr, const TrainOptions& o, int t, float grad_scale) {
    moe_table_adamw(model->moe_layout, model->moe_zero, model->moe_params.data(), model->moe_grads.data(), model->moe_m.data(),
                    model->moe_v.data(), lr, o.beta1, o.beta2, o.adam_eps, o.weight_decay, t, grad_scale);
}
static void no_update(GPT2*, float, const TrainOptions&, int, float) {}

// The parameter groups, and the optimizer of each, chosen by the flags.
enum ParamGroup { PARAMS_GROUP, MOE_TABLE_GROUP, PARAM_GROUPS };
using GroupUpdate = void (*)(GPT2* model, float lr, const TrainOptions& o, int t, float grad_scale);
static GroupUpdate group_optimizer(const GPT2* model, int group) {
    bool table = group == MOE_TABLE_GROUP;
    switch (model->optimizer) {
        case Optimizer::Adafactor: return table ? adafactor_moe_table : adafactor_params;
        case Optimizer::SM3: return table ? sm3_moe_table : sm3_params;
        default: break;
    }
    if (model->offload.on) return table ? no_update : disk_offload_params;  // (the table refuses --offload-dir)
    if (table) return adamw_moe_table;
    return model->bf16_moments ? adamw_bf16_params : adamw_params;
}

// One optimizer step on every parameter group this rank updates. t: the step (from 1); grad_scale:
// the clipping coefficient, applied to each gradient as it is read.
void gpt2_update(GPT2* model, float lr, const TrainOptions& o, int t, float grad_scale) {
    for (int group = 0; group < PARAM_GROUPS; group++)
        group_optimizer(model, group)(model, lr, o, t, grad_scale);  // AdamW fp32/bf16 moments, disk offload; Adafactor; SM3
}

// ==============================================================================================
// Parallelism (docs/parallelism.md tells the story; llmc/ holds one file per technique)
//
// `mpirun -np N ./train_gpt_cpu --tensor-parallel t --pipeline-parallel p --zero z` runs N copies
// ("ranks") of this program on a grid of dp = N/(t p) data-parallel x t tensor-parallel x p
// pipeline ranks (llmc/parallel/process_grid.h). One rank holds one slice of the model and runs the code
// above on it. Around it, a training step is:
//   1. forward and backward of the step's micro-batches, in the order of the pipeline schedule
//      (llmc/parallel/pipeline_parallel.h; without a pipeline: F0 B0 F1 B1 ..., gradient accumulation),
//      receiving activations from the previous stage and gradients from the next;
//   2. the tied embedding's gradient joins the first stage's, the sequence-parallel LayerNorm
//      gradients are summed over the tensor group (llmc/parallel/tensor_parallel.h), and the data-parallel
//      ranks sum their gradients (llmc/parallel/zero.h: ZeRO-0/1 here, ZeRO-2/3 already during backward);
//   3. the gradient norm: each rank adds the squares of what it owns, the world adds them up;
//   4. AdamW on what this rank owns, then the data-parallel ranks share the result, and the first
//      stage sends the updated tied embedding to the last.
// Every rank starts from the weights one rank would have (the counter-based initialisation gives
// every slice its values of the same full model), reads the data of its data-parallel rank, and
// ends each step with the weights one rank would have, to rounding (tested, test_parallelism.py).

struct Parallel {
    ProcessGrid grid;
    GridComms comms;
    PipelineSchedule schedule = PipelineSchedule::OneFOneB;
    int chunks = 1;                                  // interleaved: model chunks per stage (--virtual-stages)
    PipeSlots slots;                                 // which activation slot each (micro-batch, chunk) holds
    PipelineTimes times;                             // pipelines: computing / running the schedule, all steps
    // --pipeline-schedule 2bw, no flush (pipeline_2bw_steps): this step's first forwards ran in the
    // previous step's list / this step's list ends with nothing in flight (main decides, step by step)
    bool pipe_filled = false, pipe_drains = true;
    bool model_parallel = false;                     // the forward pass needs ranks other than this one
    Comm ep;                                         // --expert-parallel: this rank's expert group
    Comm ep_replicas;                                //   and the ranks holding the same experts (one per group)
};

// The output of the chunk whose forward ran in `slot`: its last layer's residual3 (a slot holds one
// chunk's layers).
static const float* stage_output(GPT2* model, int slot) {
    Activations& a = model->acts[(size_t)slot];
    size_t Rmax = tp_local_rows(model->tp, (size_t)model->max_B * model->max_T);
    return layer_slice(a.residual3, model->slice.num_layers / model->slice.chunks - 1, Rmax * model->config.channels);
}

// The CPU's passes for the schedule (llmc/run/schedule_run.h). Each pair (micro-batch, chunk) keeps its
// activations in model->acts[slot], taken at its first action; ZB-H1's W finds its own (weight_input_slot).
// ZB-H1: the output gradients micro-batch i's W reads wait in stash i mod pending_weights from its B to its
// W (its B(i + pending) comes after W(i): llmc/model/zero_bubble_backward.h).
struct CpuScheduleAt {
    int slot = 0;
    float* stash = nullptr;
};
// The optimised loss is the mean over all tokens of the step, all ranks together: d/d(one token's
// loss) = 1/total, and the ranks' gradients simply add up.
static float step_dloss(const RunPlan& plan) { return 1.0f / (float)plan.total_batch_tokens; }

static SchedulePasses cpu_compute_passes(GPT2* model, Parallel* par, DataLoader* train, const RunPlan& plan, CpuScheduleAt* at) {
    int stage = par->grid.pp_rank, B = plan.B, T = plan.T;
    bool split = par->schedule == PipelineSchedule::ZeroBubbleH1 && par->grid.pp > 1;  // B and W apart
    SchedulePasses p;
    p.before_compute = [=](const PipeAction& act) {
        if (act.op != PipeOp::Forward) return;
        Activations& a = model->acts[(size_t)at->slot];
        if (act.chunk == 0) {
            a.inputs = train->inputs;
            a.targets = train->targets;
        } else {  // interleaved: the tokens came with chunk c-1's forward, whose slot lives until its backward
            const Activations& before = model->acts[(size_t)pipe_slot(&par->slots, act.micro, act.chunk - 1)];
            a.inputs = before.inputs;
            a.targets = before.targets;
        }
    };
    p.forward = [=](const PipeAction& act, float* micro_loss) {
        Activations& a = model->acts[(size_t)at->slot];
        bool head = pass_layers(model->slice, act.chunk).head;  // the last stage's last chunk: the loss
        gpt2_forward(model, a.inputs.data(), B, T, at->slot, act.chunk);
        // --dump-state (llmc/probes/state_dump.h) keeps the first step's first logits and loss: there the
        // loss alone, the logits' gradient in the backward; elsewhere both in the loss (gpt2_loss)
        bool dump = head && dump_probe.first_step && act.micro == 0;
        *micro_loss = head ? gpt2_loss(model, a.targets.data(), B, T, at->slot, dump ? 0.0f : step_dloss(plan)) : 0.0f;
        if (dump)
            dump_keep_logits(&dump_probe, head_rows(model, at->slot).logits.data(), B * T, model->slice, *micro_loss);
        return head;
    };
    p.backward = [=](const PipeAction& act) {
        Activations& a = model->acts[(size_t)at->slot];
        gpt2_backward(model, a.inputs.data(), a.targets.data(), B, T, step_dloss(plan), at->slot, at->stash, act.chunk);
        if (at->stash) a.weight_owner = act.micro;  // the slot's rows W reads live on, until W
        PipeAction send;  // the pair is done with its slot, unless its gradient still has to leave from it
        if (!pipe_send_of(act, stage, par->grid.pp, par->chunks, &send)) pipe_slot_release(&par->slots, act.micro, act.chunk);
    };
    p.weight = [=](const PipeAction& act) {  // ZB-H1: the weight gradients of the micro-batch whose B kept the stash
        if (!at->stash) return;  // (none on the first stage: its B, right before, was the whole backward)
        int held = weight_input_slot(model, act.micro);
        gpt2_backward_weights(model, B, T, held, at->stash);
        model->acts[(size_t)held].weight_owner = -1;
    };
    p.compute_done = []() {};
    p.backward_delay = split ? 1 : 2;  // ZB-H1's B is half a backward, its W the other half
    return p;
}

// The slots, the weight versions and the sends and receives between stages: a run's sends complete at
// its end, after its receives (llmc/parallel/pipeline_parallel.h: a send left in flight while the stage
// computes arrives late).
static SchedulePasses cpu_schedule_passes(GPT2* model, Parallel* par, DataLoader* train, const RunPlan& plan, CpuScheduleAt* at) {
    SchedulePasses p = cpu_compute_passes(model, par, train, plan, at);
    Comm* pp = &par->comms.pp;
    size_t n = tp_local_rows(model->tp, (size_t)plan.B * plan.T) * model->config.channels;  // floats crossing a stage boundary
    int m = plan.accumulation_steps;
    p.begin = [=]() {
        if (!par->pipe_filled)  // (a filled 2BW step's first micro-batches hold their slots since the last step's list)
            pipe_slots_reset(&par->slots, (int)model->forward_slots, m, par->chunks);  // (ZB-H1's parked slots are not the forward's)
    };
    p.take_slot = [=](const PipeAction& act) {
        at->slot = act.op == PipeOp::Weight ? 0 : pipe_slot(&par->slots, act.micro, act.chunk);  // (W finds its own: weight_input_slot)
        size_t per = model->pending_weights > 0 ? model->weight_stash.size() / (size_t)model->pending_weights : 0;
        at->stash = model->pending_weights > 0 ? model->weight_stash.data() + (size_t)(act.micro % model->pending_weights) * per : nullptr;
        // ZB-H1: a new micro-batch takes the slot (its activation arrives, or its forward starts) while
        // the slot's last one still waits for its W: what W reads moves aside first
        if ((act.op == PipeOp::RecvActivation || act.op == PipeOp::Forward) && model->acts[(size_t)at->slot].weight_owner >= 0)
            park_weight_inputs(model, (size_t)at->slot);
    };
    p.read_version = [=](bool older) { pipedream_2bw_read(&model->versions, older, &model->params, &model->lent_wte); };
    p.recv_activation = [=](const PipeAction& act) {
        comm_recv(pp, model->acts[(size_t)at->slot].encoded.data(), n, act.peer, act.tag,
                  "receiving activations from the previous pipeline stage");
    };
    p.recv_gradient = [=](const PipeAction& act) {
        comm_recv(pp, model->acts[(size_t)at->slot].dresidual.data(), n, act.peer, act.tag, "receiving gradients from the next pipeline stage");
    };
    p.send_activation = [=](const PipeAction& act) {
        comm_send(pp, stage_output(model, at->slot), n, act.peer, act.tag, &model->acts[(size_t)at->slot].sends,
                  "sending activations to the next pipeline stage");
    };
    p.send_gradient = [=](const PipeAction& act) {
        Activations& a = model->acts[(size_t)at->slot];
        comm_send(pp, a.dresidual.data(), n, act.peer, act.tag, &a.sends, "sending gradients to the previous pipeline stage");
        // the slot is free for the next pair: this send completes at the end of its group, before
        // any compute action can write the slot again (a receive in the group writes only encoded)
        pipe_slot_release(&par->slots, act.micro, act.chunk);
    };
    p.end_group = [=]() {
        for (Activations& other : model->acts) comm_wait_sends(pp, &other.sends);
    };
    p.end = []() {};
    p.group_span = "wait sends";
    p.busy_seconds = &par->times.busy_seconds;
    p.schedule_seconds = &par->times.schedule_seconds;
    return p;
}

// Step `step`'s forward and backward passes on this rank's stage, in the order of the pipeline
// schedule (llmc/run/schedule_run.h runs the list, with the passes above). Returns this stage's mean
// loss over the step's micro-batches (the last stage's; 0 elsewhere).
static double forward_backward(GPT2* model, Parallel* par, DataLoader* train, const RunPlan& plan, int step) {
    CpuScheduleAt at;
    ScheduleStep s{par->schedule, par->grid.pp_rank, par->grid.pp, plan.accumulation_steps, par->chunks, step,
                   par->pipe_filled, par->pipe_drains, par->grid.rank == 0};
    return run_schedule(cpu_schedule_passes(model, par, train, plan, &at), s, train);
}

// ==============================================================================================
// The hooks of the step: where the techniques attach to train_step, finish_gradients and
// optimizer_step below (the passes' hooks are above the passes).
//   step_begin / step_end     around the passes: --pipeline-schedule 2bw's weight versions
//                             (llmc/parallel/pipedream_2bw.h), --moe-experts' routing statistics, the
//                             tests' injected inf (llmc/probes/fault_injection.h)
//   share_replicated_gradients   what ranks of one replica each hold a part of: pipelines' tied wte,
//                             sequence parallelism's LayerNorm gradients
//   the gradient groups       each summed over what shares it (sum_gradient_group) and adding its share
//                             of the norm (add_gradient_squares): the flat array (ZeRO, llmc/parallel/zero.h;
//                             --grad-compression, llmc/parallel/grad_compression.h; --data-parallel server,
//                             llmc/parallel/parameter_server.h) and the MoE table (llmc/model/moe_step.h)
//   the optimizer per parameter group   group_optimizer, above gpt2_update
//   updates_here, share_updated_weights   who steps (the parameter server: rank 0), and how the owners'
//                             updated weights reach every rank (ZeRO, the server, the MoE table's shards,
//                             ZeRO-1's factored blocks, pipelines' tied wte)

// step_begin: the step's MoE routing statistics start from zero (an evaluation's forward between
// steps added to them).
static void step_begin(GPT2* model) { model->moe_stats = MoEStepStats{}; }

// step_end: the step's passes are done.
static void step_end(GPT2* model, Parallel* par, const RunPlan& plan, int step) {
    par->pipe_filled = par->schedule == PipelineSchedule::PipeDream2BW && !par->pipe_drains;
    // --pipeline-schedule 2bw: the passes read W(t-2) (and the next step's first forwards W(t-1)); the
    // optimizer updates W(t-1) into W(t) (llmc/parallel/pipedream_2bw.h)
    pipedream_2bw_after_passes(&model->versions, &model->params, &model->lent_wte);
    if (!model->moe_acts.empty()) moe_step_stats(&model->moe_stats, &par->comms.world, plan.accumulation_steps, par->grid.dp);
    inject_grad_inf(&par->comms.world, step, model->grads.data());  // tests only (llmc/probes/fault_injection.h)
}

// The gradient arrays a step starts from zero: the flat array (null with ZeRO-2/3, which add into
// buckets and keep their shard instead), the shard, the last pipeline stage's gradient of its copy
// of wte, the MoE table's.
static std::array<std::vector<float>*, 4> gradient_buffers(GPT2* model) {
    return {model->zero.stage <= 1 ? &model->grads : nullptr, &model->zero.grad_shard, &model->lent_wte_grad, &model->moe_grads};
}

// share_replicated_gradients: the tied embedding (the last stage's LM-head gradient joins the first
// stage's wte gradient), and with sequence parallelism the LayerNorm gradients, partial over each
// rank's rows (ZeRO-2/3 summed them unit by unit already, before reducing each bucket).
static void share_replicated_gradients(GPT2* model, Parallel* par) {
    GPT2& mo = *model;
    size_t wte_floats = (size_t)mo.slice.vocab_rows * mo.config.channels;
    pipe_tied_gradient(&par->comms.pp, mo.slice.first_stage, mo.slice.last_stage, mo.g[WTE], mo.lent_wte_grad.data(), wte_floats);
    if (mo.zero.stage <= 1) {
        std::vector<std::pair<float*, size_t>> layernorms;
        for (int t : {LN1W, LN1B, LN2W, LN2B, LNFW, LNFB})
            if (mo.layout.count[t] > 0) layernorms.push_back({mo.g[t], mo.layout.count[t]});
        tp_sum_replicated_grads(&mo.tp, layernorms);
    }
}

// The gradient groups of the step.
enum GradientGroup { PARAMS_GRADS, MOE_TABLE_GRADS, GRADIENT_GROUPS };

// sum_gradient_group: the group's data-parallel sum. The flat array: exact (llmc/parallel/zero.h),
// compressed (llmc/parallel/grad_compression.h), or with --data-parallel server on rank 0 alone
// (llmc/parallel/parameter_server.h). The MoE table: llmc/model/moe_step.h (each rank routed its
// own tokens; with --expert-parallel each rank holds its experts only: theirs over their replicas).
static void sum_gradient_group(GPT2* model, Parallel* par, int group) {
    GPT2& mo = *model;
    if (group == MOE_TABLE_GRADS) {
        if (mo.server.on) return;  // (the server sums the dense table only: llmc/run/compatibility.h refuses MoE with it)
        moe_table_sum(&mo.moe_zero, mo.moe_bf16, mo.ep != nullptr, &par->comms.dp, &par->ep_replicas, par->grid.dp, &mo.moe_grads,
                      mo.moe_layout.count[MOE_ROUTER], &mo.moe_sum_scratch);
        return;
    }
    if (mo.server.on) {
        parameter_server_gather(&mo.server, mo.grads.data(), mo.layout.total, mo.zero.grad_shard.data(), mo.zero.grad_shard.size());
        return;
    }
    int step = (int)mo.compression.steps_done + 1;
    grad_compression_test_poison(&par->comms.world, step, &mo.grads);  // (llmc/probes/grad_compression_probe.h)
    grad_compression_test_dump(&par->comms.world, step, "local", mo.grads);
    grad_compression_reduce(&mo.compression, &mo.zero, &mo.grads);
    grad_compression_test_dump(&par->comms.world, step, "sum", mo.grads);
}

// add_gradient_squares: the group's share of the squared global norm, each summed value counted once
// over the world, added to `squares` in a fixed order. The flat array: each rank its ZeRO shard (or
// its whole sum); with --data-parallel server the squares of each rank's shard of the sum, on the
// server, in rank order (comm_sum's order: the norm the all-reduce would have found; the workers add
// nothing, so every rank gets the server's bits). The MoE table after it: llmc/model/moe_step.h.
static void add_gradient_squares(GPT2* model, Parallel* par, int group, double* squares) {
    GPT2& mo = *model;
    if (group == MOE_TABLE_GRADS) {
        if (mo.server.on) return;
        moe_table_squares(mo.moe_zero, mo.moe_grads, mo.moe_layout.count[MOE_ROUTER], par->grid.rank,
                          par->grid.dp_rank < par->ep.world_size, squares);
        return;
    }
    if (mo.server.on) {
        if (!parameter_server_is_server(mo.server)) return;
        for (int r = 0; r < mo.server.dp->world_size; r++) {
            ShardRange o = owned_range(mo.zero.shards, r);
            *squares += sum_of_squares(mo.grads.data() + o.begin, o.end - o.begin);
        }
        return;
    }
    for (auto& range : zero_norm_ranges(mo.zero, mo.grads)) *squares += sum_of_squares(range.first, range.second);
}

// gradient_groups_applied: a sound step's gradients are being applied: --grad-compression keeps
// their error feedback and Q (llmc/parallel/grad_compression.h).
static void gradient_groups_applied(GPT2* model) { grad_compression_commit(&model->compression); }

// updates_here: whether this rank runs the optimizer: every rank on its share, or with
// --data-parallel server the server alone (the workers' gradients are not the sum).
static bool updates_here(const GPT2* model) { return !model->server.on || parameter_server_is_server(model->server); }

// share_updated_weights: every rank gets the weights their owners updated: the server sends them,
// ZeRO's data-parallel ranks all-gather their shards, the MoE table's (--zero 1|2) too, ZeRO-1's
// factored blocks (llmc/optim/factored_sharding.h), and the first pipeline stage sends its wte to
// the last (the tied LM head).
static void share_updated_weights(GPT2* model, Parallel* par) {
    ProfileScope prof("communication (weights)", 0);  // --profile: on one rank none
    if (model->server.on) parameter_server_send_weights(&model->server, model->params.data(), model->layout.total);
    zero_after_update(&model->zero, &model->params);
    moe_zero_share(&model->moe_zero, model->moe_params.data(), &model->moe_sum_scratch);
    if (model->zero.whole_gradient) factored_share_weights(&par->comms.dp, model->params.data(), model->factored);
    pipe_tied_weights(&par->comms.pp, model->slice.first_stage, model->slice.last_stage, model->p[WTE],
                      model->lent_wte.data(), (size_t)model->slice.vocab_rows * model->config.channels);
}

// sum_gradient_groups: what ranks of one replica each hold a part of first, then each gradient group's
// data-parallel sum (on one rank: nothing to do).
static void sum_gradient_groups(GPT2* model, Parallel* par) {
    ProfileScope prof("communication (gradient sums)", 0);  // --profile: the step's communication, on one rank none
    share_replicated_gradients(model, par);
    for (int group = 0; group < GRADIENT_GROUPS; group++) sum_gradient_group(model, par, group);
}

// A number summed over every rank of the run (on one rank: itself).
static double all_ranks_sum(Parallel* par, double x, const char* what) { return comm_sum(&par->comms.world, x, what); }

// The gradient of the step, summed over everything that shares it; returns the global norm.
static float finish_gradients(GPT2* model, Parallel* par) {
    TraceSpan span("gradient sums");  // --trace (llmc/probes/trace.h)
    sum_gradient_groups(model, par);  // tied wte, SP LayerNorms; ZeRO, grad compression, parameter server, MoE table
    double squares = 0.0;
    for (int group = 0; group < GRADIENT_GROUPS; group++)
        add_gradient_squares(model, par, group, &squares);  // each value once: ZeRO shards, the server's sum, the MoE table's
    return (float)std::sqrt(all_ranks_sum(par, squares, "sum of the gradient norms"));
}

// Clipping and the optimizer over the parameters this rank updates, then every rank gets the
// updated weights.
// t: AdamW's, the updates applied with this one (llmc/run/step.h's optimizer_t).
static void optimizer_step(GPT2* model, Parallel* par, const TrainOptions& o, int t, float lr, float norm) {
    TraceSpan span("optimizer");  // --trace (llmc/probes/trace.h)
    gradient_groups_applied(model);  // grad compression: a sound step's error feedback and Q are kept
    if (updates_here(model)) gpt2_update(model, lr, o, t, clip_coefficient(norm, o.grad_clip));  // parameter server: rank 0
    share_updated_weights(model, par);  // ZeRO, parameter server, the MoE table's shards, pipelines' tied wte
}

// ==============================================================================================
// Evaluation and samples. On a grid whose forward pass spans several ranks (tensor or pipeline
// parallelism, ZeRO-3) every rank takes part; otherwise rank 0 alone evaluates.

// One forward pass of a whole batch through the pipeline, in activation slot 0. Returns the mean
// loss on the last stage (0 elsewhere, and 0 without targets). Interleaved: around the ring of
// stages once per model chunk (rank p-1's chunk c feeds rank 0's chunk c+1), one chunk at a time.
static float pipeline_forward(GPT2* model, Parallel* par, const int* inputs, const int* targets, int B, int T) {
    const ModelSlice& s = model->slice;
    Comm* pp = &par->comms.pp;
    int p = par->grid.pp, r = par->grid.pp_rank;
    size_t n = tp_local_rows(model->tp, (size_t)B * T) * model->config.channels;
    Activations& a = model->acts[0];
    comm_wait_sends(pp, &a.sends);
    for (int c = 0; c < s.chunks; c++) {
        PassLayers pass = pass_layers(s, c);
        if (!pass.embeds) comm_recv(pp, a.encoded.data(), n, (r + p - 1) % p, 0, "receiving activations (evaluation)");
        gpt2_forward(model, inputs, B, T, 0, c);
        if (pass.head) return targets ? gpt2_loss(model, targets, B, T, 0) : 0.0f;
        comm_send(pp, stage_output(model, 0), n, (r + 1) % p, 0, &a.sends, "sending activations (evaluation)");
        comm_wait_sends(pp, &a.sends);
    }
    return 0.0f;
}

// ==============================================================================================
// Weights in, weights out: every rank reads and writes its own elements, in global coordinates.

static float* weight_storage(GPT2* model) {
    return model->zero.stage == 3 ? model->zero.param_shard.data() : model->params.data();
}

// Where read_state_runs() puts what it reads: at the runs' weight (or state) positions.
static std::vector<WantedRun> wanted(const std::vector<StateRun>& runs, bool weights) {
    std::vector<WantedRun> out;
    for (const StateRun& r : runs) out.push_back({r.global, r.count, weights ? r.weight_at : r.state_at});
    return out;
}

// --moe-experts: this rank's part of a whole MoE table read from a file (all of it, unless
// --expert-parallel: the routers and this rank's experts, llmc/parallel/expert_parallel.h).
static void keep_held_experts(GPT2* model, const std::vector<float>& whole, std::vector<float>* held) {
    for (const MoETableRun& r : moe_table_runs(moe_layout(model->config, model->moe), model->moe_layout))
        memcpy(held->data() + r.held, whole.data() + r.whole, r.count * sizeof(float));
}

// The whole MoE table of `held` (weights, a gradient, m or v) on rank 0: this rank's own without
// --expert-parallel; with it gathered from expert group 0 (its members must all call), into `whole`.
static const float* whole_moe_table(GPT2* model, Parallel* par, const std::vector<float>& held, std::vector<float>* whole) {
    if (!model->ep) return held.data();
    if (par->grid.dp_rank < par->ep.world_size)
        ep_gather_table(&par->ep, model->config, model->moe, held.data(), held.size(), whole);
    return whole->data();
}

// Fills this rank's weights: from the counter-based initialisation (a new model), a model file, or
// a checkpoint (the state files' weights when they have them, else its model.bin).
static void load_weights(GPT2* model, const TrainOptions& o, const std::string& resume_dir, bool new_model) {
    const GPT2Config& cfg = model->config;
    std::vector<StateRun> runs = zero_weight_runs(model->zero, slice_runs(cfg, model->slice));
    float* dst = weight_storage(model);
    if (new_model) {
        for (const StateRun& r : runs) init_gpt2_params(cfg, o.seed, dst + r.weight_at, r.global, r.global + r.count);
        init_moe_params(cfg, model->moe, model->moe_layout, o.seed, model->moe_params.data());  // --moe-experts (empty if dense)
        return;
    }
    bool dense_from_state = !resume_dir.empty() &&
        read_state_runs(resume_dir, param_layout(cfg).total, wanted(runs, true), nullptr, nullptr, dst).has_master_weights;
    // The state files never hold the MoE table's weights: a GPU bf16 run's hold its dense master weights
    // only, and the table is in model.bin (read below even then: skipping it left the table unset)
    if (dense_from_state && model->moe_params.empty()) return;
    // a model file holds the full model: read it whole, keep this rank's runs (and an MoE model's table:
    // main checked that the file's MoE settings are this run's, so the sizes agree)
    GPT2Config file_cfg;
    std::vector<float> full, moe_full;
    read_model_file(resume_dir.empty() ? o.model : resume_dir + "/model.bin", &file_cfg, &full, &moe_full);
    for (const StateRun& r : runs)
        if (!dense_from_state) memcpy(dst + r.weight_at, full.data() + r.global, r.count * sizeof(float));
    keep_held_experts(model, moe_full, &model->moe_params);
}

// A sound loss and gradient norm can still carry a weight past FLT_MAX (an enormous learning rate):
// such weights must never be saved, or the checkpoint that "latest" points at cannot be resumed. One
// pass over the weights, every rank its own, before each checkpoint.
static void fail_unless_weights_finite(GPT2* model, Parallel* par, int step) {
    const float* w = weight_storage(model);
    size_t n = model->zero.stage == 3 ? model->zero.param_shard.size() : model->params.size(), bad = 0;
    for (size_t i = 0; i < n; i++) bad += !std::isfinite(w[i]);
    double total = comm_sum(&par->comms.world, (double)bad, "count of non-finite weights");
    if (total > 0) {
        fail("step %d: %.0f weights are not finite after the update: training diverged; no checkpoint written for this "
             "step. Lower --lr, raise --warmup-steps, or check --grad-clip", step, total);
    }
}

// A checkpoint (llmc/run/checkpoint.h: write_checkpoint says which rank writes which file). The CPU's weights
// and optimizer state are on the host already; without a rank holding every weight, rank 0
// assembles model.bin from the state files' weights.
static void save_checkpoint(GPT2* model, Parallel* par, const TrainOptions& o, const RunPlan& plan, int step,
                            const DataLoader& train, uint64_t sampler_rng, int updates_skipped) {
    const GPT2Config& cfg = model->config;
    auto barrier = [&](const char* what) { comm_barrier(&par->comms.world, what); };
    // --moe-experts: the whole MoE table and its moments on rank 0 (gathered, with --expert-parallel)
    // (--zero 1|2: the moments' shards first made the held table's on every rank)
    std::vector<float> whole_params, whole_m, whole_v, held_m, held_v;
    if (!model->moe_zero.segments.empty()) {
        moe_zero_unshard(&model->moe_zero, model->moe_m.data(), &held_m, model->moe_params.size(), &model->moe_sum_scratch);
        moe_zero_unshard(&model->moe_zero, model->moe_v.data(), &held_v, model->moe_params.size(), &model->moe_sum_scratch);
    }
    const float* moe_params = whole_moe_table(model, par, model->moe_params, &whole_params);
    const float* moe_m = whole_moe_table(model, par, held_m.empty() ? model->moe_m : held_m, &whole_m);
    const float* moe_v = whole_moe_table(model, par, held_v.empty() ? model->moe_v : held_v, &whole_v);
    CheckpointParts parts;
    parts.updates_skipped = updates_skipped;
    parts.write_model_bin = [&](const std::string& path) {
        if (model->moe.experts == 0) write_model_file(path, cfg, model->params.data(), false);
        else write_moe_model_file(path, cfg, model->moe, model->moe_shape.top_k, model->params.data(), moe_params);
    };
    parts.fill_state = [&](TrainState* s) {
        if (model->optimizer != Optimizer::AdamW) {  // its blocks' factored state (docs/formats.md, version 3)
            s->header.optimizer = (int)model->optimizer;
            s->header.optimizer_state_floats = (int64_t)model->optimizer_state.size();
            s->factored = model->optimizer_state;
            if (s->header.has_master_weights)  // tensor parallelism: no rank holds every weight; model.bin is assembled from these
                zero_fill_state(s, par->grid, zero_state_runs(model->zero, slice_runs(cfg, model->slice), true), nullptr, nullptr,
                                weight_storage(model), false);
            return;
        }
        if (model->offload.on) {  // m and v from the files, chunk by chunk, straight into the state file
            std::vector<StateRun> runs = zero_state_runs(model->zero, slice_runs(cfg, model->slice), true);
            zero_fill_state(s, par->grid, runs, nullptr, nullptr, weight_storage(model), false);
            // ZeRO-0/1 without model parallelism (validate_options): a rank writes all of its files or nothing
            if (s->header.shard_count != 0 && (size_t)s->header.shard_count != model->offload.n)
                fail("internal: --offload-dir's checkpoint would write %lld of %zu moments", (long long)s->header.shard_count, model->offload.n);
            s->moments = [model](int which, const std::function<void(const float*, size_t)>& write) {
                std::vector<float> wide(model->bf16_moments ? model->offload.chunk : 0);  // bf16 moments: saved as fp32 (exact)
                disk_offload_stream(&model->offload, 1 << which, 0, [&](size_t, size_t count, const void* m, const void* v) {
                    const void* chunk = which == 0 ? m : v;
                    if (!model->bf16_moments) return write((const float*)chunk, count);
                    for (size_t i = 0; i < count; i++) wide[i] = bf16_to_float(((const uint16_t*)chunk)[i]);
                    write(wide.data(), count);
                });
            };
            return;
        }
        // bf16 moments are saved as fp32 (exact), so the file is the same format either way
        std::vector<float> m16_wide(model->adam_m16.size()), v16_wide(model->adam_v16.size());
        for (size_t i = 0; i < m16_wide.size(); i++) m16_wide[i] = bf16_to_float(model->adam_m16[i]), v16_wide[i] = bf16_to_float(model->adam_v16[i]);
        zero_fill_state(s, par->grid, zero_state_runs(model->zero, slice_runs(cfg, model->slice), true),
                        model->bf16_moments ? m16_wide.data() : model->adam_m.data(),
                        model->bf16_moments ? v16_wide.data() : model->adam_v.data(), weight_storage(model), false);
    };
    parts.assemble_model_bin = [&](const std::string& dir) {
        barrier("the barrier before assembling model.bin");
        if (par->grid.rank == 0) assemble_model_file(dir, cfg);
    };
    parts.write_rank_files = [&](const std::string& dir) {
        grad_compression_save(model->compression, dir, step);
        pipedream_2bw_save(model->versions, dir, par->grid.rank, par->grid.world, step);  // every rank its stage's W(t-1)
        if (model->moe.experts > 0 && par->grid.rank == 0)  // (the whole table: every replica holds the same)
            write_moe_state(dir + "/moe_state.bin", model->moe, model->moe_shape.top_k, (int)model->optimizer,
                            model->optimizer == Optimizer::AdamW ? moe_m : model->moe_factored.data(),
                            model->optimizer == Optimizer::AdamW ? moe_v : nullptr,
                            model->optimizer == Optimizer::AdamW ? moe_layout(cfg, model->moe).total : model->moe_factored.size());
    };
    write_checkpoint(par->grid, o.out_dir, step, param_layout(cfg).total, plan, sampler_rng, train.pos, parts, barrier,
                     recorded_options(o, plan.steps), o.keep_checkpoints);
}

// ==============================================================================================
// Memory, measured (llmc/probes/cpu_memory_report.h reports it against --estimate's prediction)

// What this rank really holds for each row of its table: the capacity of the vectors the row sized
// (every micro-batch's, for the rows that have one each), that is what the allocator was asked
// for, whatever the table's arithmetic says; for ZeRO's units, the peak they reached. The trainer
// reports it (--print-allocations: row by row, on every rank) and test/test_estimate.py compares it
// with --estimate, to the byte.
static std::vector<size_t> held_bytes(GPT2* model) {
    std::vector<size_t> held(CB_COUNT, 0);
    for (int b = 0; b < CB_COUNT; b++)
        for (size_t slot = 0; slot < (cpu_buffer_per_micro_batch(b) ? model->acts.size() : 1); slot++) {
            if (std::vector<float>* v = gpt2_buffer(model, b, (int)slot)) held[b] += v->capacity() * sizeof(float);
            if (std::vector<uint16_t>* v = gpt2_buffer16(model, b, (int)slot)) held[b] += v->capacity() * sizeof(uint16_t);
        }
    held[CB_MATMUL_PACK_A] = matmul_scratch.a_pack.capacity() * sizeof(Floats16);
    held[CB_MATMUL_PACK_B] = matmul_scratch.b_pack.capacity() * sizeof(Floats16);
    held[CB_ZERO_UNITS] = model->zero.transient_peak * sizeof(float);
    for (const MoEActivations& a : model->moe_acts) {  // its floats' and ints' vectors: 4 bytes a value either way
        for (const std::vector<float>* v : {&a.logits, &a.probs, &a.lse, &a.gate, &a.xg, &a.fch, &a.fch_gelu, &a.eout, &a.drow,
                                            &a.dh, &a.dxg, &a.dgate, &a.dprobs, &a.dlogits, &a.dx_router})
            held[CB_MOE_ACTIVATIONS] += v->capacity() * sizeof(float);
        for (const std::vector<int>* v : {&a.choice, &a.row, &a.routed, &a.kept, &a.first_row, &a.token_of_row})
            held[CB_MOE_ACTIVATIONS] += v->capacity() * sizeof(int);
    }
    for (const ExpertParallelBlock& b : model->ep_blocks) {  // --expert-parallel's exchange buffers, 4 bytes a value
        for (const std::vector<float>* v : {&b.staging, &b.x, &b.fch, &b.fch_gelu, &b.out, &b.dout, &b.dh, &b.dx})
            held[CB_EP_EXCHANGE] += v->capacity() * sizeof(float);
        for (const std::vector<int>* v : {&b.plan.send_rows, &b.plan.recv_rows, &b.plan.send_floats, &b.plan.recv_floats, &b.plan.expert_row})
            held[CB_EP_EXCHANGE] += v->capacity() * sizeof(int);
    }
    return held;
}

// ==============================================================================================
// --dump-state (llmc/probes/state_dump.h): after the first step's gradient sum, its first logits and
// loss and its (summed, unclipped) gradient, on rank 0; after every step, its loss (in main); at the
// end, the weights, and rank 0 writes the file.

static void dump_first_step(GPT2* model, Parallel* par, size_t rows) {
    StateDump* d = &dump_probe;
    if (!d->first_step) return;
    const ModelSlice& s = model->slice;
    dump_gather_logits(&par->comms.world, model->config, s, par->grid.dp_rank, d->first_logits, rows, &d->state.logits);
    bool reports = s.last_stage && par->grid.tp_rank == 0 && par->grid.dp_rank == 0;
    d->state.loss = (float)comm_sum(&par->comms.world, reports ? d->first_loss : 0.0, "the first loss");
    dump_gather_gradients(&par->comms.world, model->zero, model->config, s, model->grads, &d->state.grads,
                          !model->server.on || parameter_server_is_server(model->server));
    // --moe-experts: then the MoE table's, summed (whole on rank 0, which writes the file; with --zero 1|2
    // each rank holds its shard of the sum: shared first)
    moe_zero_share(&model->moe_zero, model->moe_grads.data(), &model->moe_sum_scratch);
    std::vector<float> whole;
    const float* moe = whole_moe_table(model, par, model->moe_grads, &whole);
    if (par->grid.rank == 0) d->state.grads.insert(d->state.grads.end(), moe, moe + moe_layout(model->config, model->moe).total);
    d->first_step = false;
}

static void dump_at_end(GPT2* model, Parallel* par, const std::string& path, int B, int T) {
    StateDump* d = &dump_probe;
    if (!d->on) return;
    dump_gather_weights(&par->comms.world, model->zero, model->config, model->slice, weight_storage(model), model->lent_wte,
                        &d->state.params);
    std::vector<float> whole;  // --moe-experts: the whole MoE table
    const float* moe = whole_moe_table(model, par, model->moe_params, &whole);
    if (par->grid.rank == 0) d->state.params.insert(d->state.params.end(), moe, moe + moe_layout(model->config, model->moe).total);
    if (par->grid.rank == 0) {
        write_dump_state(path, d->state, model->config, B, T, "cpu");
        printf("dumped state to %s\n", path.c_str());
    }
}

// ==============================================================================================
// Start-up: from the flags to a model ready to train

// Before the first large allocation: every rank's table against --max-memory, or this node's
// MemAvailable shared by its ranks (a run that cannot fit is refused now, not killed later).
static void refuse_unless_memory_fits(Comm* world, const EstimateSetup& predicted, double max_memory_mib) {
    double limit = max_memory_mib * 1048576.0;
    std::string limit_source = strprintf("--max-memory %g MiB", max_memory_mib);
    if (limit <= 0) {
        limit = host_memory_available_bytes() / world->local_size;
        limit_source = strprintf("%s, this node's available memory (%s) over its %d rank%s (--max-memory sets a limit)",
                                 format_bytes(limit).c_str(), format_bytes(limit * world->local_size).c_str(), world->local_size,
                                 world->local_size == 1 ? "" : "s");
    }
    std::string why = memory_refusal(predicted, limit, limit_source);
    if (!why.empty()) grid_usage_fail(world, why);
}

// --offload-dir: before anything is allocated, the directory must hold every rank's m and v files
// (rank r's: the moments of what it updates; llmc/optim/disk_offload.h).
static void refuse_unless_offload_dir_fits(Comm* world, const TrainOptions& o, const EstimateSetup& predicted, int B) {
    if (o.offload_dir.empty()) return;
    std::vector<size_t> floats;
    for (int r = 0; r < estimate_world(predicted); r++) floats.push_back(cpu_offloaded_moments(estimate_cpu_shape(predicted, B, r)));
    std::string why = disk_offload_dir_problem(o.offload_dir, floats, o.optimizer_state == "bf16" ? 2 : sizeof(float),
                                               offload_test_free_bytes());
    if (!why.empty()) grid_usage_fail(world, why);
}

// A new run's optimizer state is zero: AdamW's moments (fp32 or bf16; with --offload-dir the chunks'
// slots, whose files disk_offload_open fills with zeros), a factored optimizer's statistics, the MoE
// table's. Written here, not left to the allocator's zeros, which a test run does not get
// (llmc/probes/poison.h); a resume then reads them over.
static void zero_optimizer_state(GPT2* model) {
    for (std::vector<float>* v : {&model->adam_m, &model->adam_v, &model->optimizer_state, &model->moe_m, &model->moe_v, &model->moe_factored})
        std::fill(v->begin(), v->end(), 0.0f);
    for (std::vector<uint16_t>* v : {&model->adam_m16, &model->adam_v16}) std::fill(v->begin(), v->end(), (uint16_t)0);  // bf16 zero
}

// This rank's slice, every buffer from the size table (what --estimate prints), then the weights:
// from the initialisation, a model file or a checkpoint; the data-parallel replicas take their
// group's rank 0's copy, so that they start bit-identical.
static void build_model(GPT2* model, Parallel* par, const TrainOptions& o, const GPT2Config& cfg, const RunPlan& shape,
                        const EstimateSetup& predicted, const std::string& resume_dir, bool new_model) {
    const ProcessGrid& grid = par->grid;
    ModelSlice slice = model_slice(cfg, grid, par->chunks);  // interleaved: v chunks of layers (slice_layer)
    gpt2_build(model, cfg, {}, &slice);
    tensor_parallel_init(&model->tp, &par->comms.tp, grid.sequence_parallel);
    if (grid.tp > 1) model->factored_tp = factored_tensor_group(&par->comms.tp);
    zero_setup(&model->zero, grid.zero_stage, &par->comms.dp, grid, slice, model->layout);
    CPURunShape sizes = estimate_cpu_shape(predicted, shape.B, grid.rank);  // every buffer as --estimate counts it
    if (o.moe_experts > 0) model->moe_shape = moe_run_shape(o);
    if (o.expert_parallel > 1) {  // --expert-parallel: consecutive data-parallel ranks form an expert group;
        int N = o.expert_parallel;  // the ranks at the same place of every group hold the same experts
        comm_split(&par->comms.dp, grid.dp_rank / N, grid.dp_rank % N, &par->ep, "creating the expert-parallel groups");
        comm_split(&par->comms.dp, grid.dp_rank % N, grid.dp_rank / N, &par->ep_replicas, "creating the groups of expert replicas");
    }
    gpt2_allocate(model, sizes);
    zero_optimizer_state(model);  // (poison found this one: the allocator's zeros were m and v's start)
    // --zero 1|2: the MoE table's AdamW moments sharded (expert_parallel.h); a factored optimizer's statistics
    // of the table stay whole on every rank (tiny, and a shard would cut an expert's matrices mid-row)
    if (grid.zero_stage >= 1 && o.moe_experts > 0 && o.optimizer == "adamw")
        model->moe_zero = moe_sharing(&par->comms.dp, o.expert_parallel > 1 ? &par->ep_replicas : nullptr,
                                         model->moe_layout.count[MOE_ROUTER], model->moe_layout.total);
    if (o.grad_compression == "bf16" && o.moe_experts > 0)  // (cli.h: ZeRO-0 then)
        model->moe_bf16 = moe_sharing(&par->comms.dp, o.expert_parallel > 1 ? &par->ep_replicas : nullptr,
                                      model->moe_layout.count[MOE_ROUTER], model->moe_layout.total);
    if (!o.offload_dir.empty())  // this rank's m and v: zeros in its files; adam_m, adam_v are the chunks' slots
        disk_offload_open(&model->offload, o.offload_dir, grid.rank, cpu_offloaded_moments(sizes), o.offload_chunk_kib,
                          model->bf16_moments ? 2 : sizeof(float),
                          model->bf16_moments ? (void*)model->adam_m16.data() : (void*)model->adam_m.data(),
                          model->bf16_moments ? (void*)model->adam_v16.data() : (void*)model->adam_v.data());
    grad_compression_setup(&model->compression, predicted.compression, &par->comms.dp, cfg, o.seed);
    model->server.on = o.data_parallel == "server";
    model->server.dp = &par->comms.dp;
    model->server.sends.reserve(model->layout.total / std::max<size_t>(1, model->zero.grad_shard.size()) + 1);
    load_weights(model, o, resume_dir, new_model);
    if (grid.zero_stage < 3) {
        comm_broadcast(&par->comms.dp, model->params.data(), model->layout.total * sizeof(float), 0, "broadcast of the initial weights");
    }
    if (o.expert_parallel > 1) {
        model->ep = &par->ep;
        model->ep_blocks.resize(model->moe_acts.size());
        for (ExpertParallelBlock& eb : model->ep_blocks)
            ep_allocate(&eb, o.expert_parallel, o.moe_experts, o.moe_top_k, shape.B * shape.T, cfg.channels, 4 * cfg.channels);
    }
    if (!model->moe_params.empty())  // (the ranks holding the same experts: every rank without --expert-parallel)
        comm_broadcast(model->ep ? &par->ep_replicas : &par->comms.dp, model->moe_params.data(),
                       model->moe_params.size() * sizeof(float), 0, "broadcast of the MoE table");
    pipe_tied_weights(&par->comms.pp, slice.first_stage, slice.last_stage, model->p[WTE], model->lent_wte.data(),
                      (size_t)slice.vocab_rows * cfg.channels);
    pipedream_2bw_start(&model->versions, model->params, model->lent_wte);  // W(-1) = W(0); a resume reads W(t-1) below
}

// Resuming: each rank reads the optimizer state of the elements it updates, from whichever files
// hold it; the sampler and the training data go on where the checkpoint left them.
static void resume_state(GPT2* model, const ProcessGrid& grid, const TrainOptions& o, const std::string& resume_dir,
                         const RunPlan& plan, bool leader, DataLoader* train, TrainStateHeader* resumed, uint64_t* sampler_rng) {
    const GPT2Config& cfg = model->config;
    if (model->optimizer != Optimizer::AdamW && model->tp.degree > 1) {  // its own file, on the same grid
        *resumed = read_factored_state_tensor_parallel(resume_dir, param_layout(cfg).total, model->optimizer, grid,
                                                       model->optimizer_state.size(), model->optimizer_state.data());
    } else if (model->optimizer != Optimizer::AdamW) {
        const FactoredShard& f = model->factored;  // this rank's slice of the whole state
        *resumed = read_factored_state(resume_dir, param_layout(cfg).total, model->optimizer, f.state.back().end,
                                       f.state[model->zero.whole_gradient ? (size_t)model->zero.dp->rank : 0].begin,
                                       model->optimizer_state.size(), model->optimizer_state.data(), grid.world);
    } else if (model->offload.on) {  // into the files, chunk by chunk: each chunk's part of what this rank keeps
        std::vector<WantedRun> all = wanted(zero_state_runs(model->zero, slice_runs(cfg, model->slice), false), false);
        *resumed = read_state_runs(resume_dir, param_layout(cfg).total, {}, nullptr, nullptr, nullptr);  // the header
        bool bf16 = model->bf16_moments;  // read as fp32, then to bf16: exact for a bf16 run's checkpoint
        std::vector<float> wide_m(bf16 ? model->offload.chunk : 0), wide_v(wide_m.size());
        disk_offload_stream(&model->offload, 0, 3, [&](size_t begin, size_t count, void* m, void* v) {
            std::vector<WantedRun> part;
            for (const WantedRun& w : all) {
                size_t lo = std::max(w.dst, begin), hi = std::min(w.dst + w.count, begin + count);
                if (lo < hi) part.push_back({w.global + (lo - w.dst), hi - lo, lo - begin});
            }
            read_state_runs(resume_dir, param_layout(cfg).total, part, bf16 ? wide_m.data() : (float*)m,
                            bf16 ? wide_v.data() : (float*)v, nullptr);
            for (size_t i = 0; bf16 && i < count; i++)
                ((uint16_t*)m)[i] = float_to_bf16_round_nearest(wide_m[i]), ((uint16_t*)v)[i] = float_to_bf16_round_nearest(wide_v[i]);
        });
    } else if (model->bf16_moments) {  // read as fp32, then to bf16: exact for a bf16 run's checkpoint
        std::vector<float> m(model->adam_m16.size()), v(model->adam_v16.size());
        *resumed = read_state_runs(resume_dir, param_layout(cfg).total,
                                   wanted(zero_state_runs(model->zero, slice_runs(cfg, model->slice), false), false), m.data(),
                                   v.data(), nullptr);
        for (size_t i = 0; i < m.size(); i++) model->adam_m16[i] = float_to_bf16_round_nearest(m[i]), model->adam_v16[i] = float_to_bf16_round_nearest(v[i]);
    } else {
        *resumed = read_state_runs(resume_dir, param_layout(cfg).total,
                                   wanted(zero_state_runs(model->zero, slice_runs(cfg, model->slice), false), false),
                                   model->adam_m.data(), model->adam_v.data(), nullptr);
    }
    check_resume_state(*resumed, resume_dir, param_layout(cfg).total, plan, true);
    if (model->moe.experts > 0) {  // --moe-experts: the MoE table's moments (its weights came with model.bin), this rank's part
        std::vector<float> m, v;
        bool adamw = model->optimizer == Optimizer::AdamW;  // (a factored optimizer's: every rank the whole table's, cli.h)
        read_moe_state(resume_dir + "/moe_state.bin", model->moe, model->moe_shape.top_k, (int)model->optimizer,
                       adamw ? moe_layout(cfg, model->moe).total : model->moe_factored.size(), adamw ? &m : &model->moe_factored, &v);
        if (adamw && model->moe_zero.segments.empty()) {
            keep_held_experts(model, m, &model->moe_m);
            keep_held_experts(model, v, &model->moe_v);
        } else if (adamw) {  // --zero 1|2: this rank's shards of its held table's
            std::vector<float> held(model->moe_params.size());
            keep_held_experts(model, m, &held);
            moe_zero_keep(model->moe_zero, held.data(), model->moe_m.data());
            keep_held_experts(model, v, &held);
            moe_zero_keep(model->moe_zero, held.data(), model->moe_v.data());
        }
    }
    grad_compression_load(&model->compression, resume_dir, resumed->step);  // its error feedback and Q, or a refusal
    model->compression.steps_done = resumed->step;
    *sampler_rng = resumed->sampler_rng;
    if (!o.eval_only) dataloader_seek(train, resumed->train_loader, leader);
}

// What rank 0 says before the first step: the model, the batch, the grid, the data, the memory.
static void print_run_header(GPT2* model, const Parallel& par, const Comm& world, const TrainOptions& o, const RunPlan& plan,
                             const RunModel& rm, const DataLoader& train, const DataLoader* val, const TrainStateHeader& resumed) {
    const std::string& model_source = rm.source;
    const GPT2Config& cfg = model->config;
    const ProcessGrid& grid = par.grid;
    int B = plan.B, T = plan.T;
    printf("model: %s (%s), %zu parameters\n", model_source.c_str(), describe_config(cfg).c_str(), param_layout(cfg).total);
    if (model->moe.experts > 0) {
        const MoEShape& m = model->moe_shape;
        printf("mixture of experts: %d of %d blocks, %d experts, top-%d, capacity factor %s, aux alpha %g, z-loss %g: "
               "%zu + %zu (the MoE table) = %zu parameters, %zu active per token\n",
               moe_block_count(model->moe, cfg.num_layers), cfg.num_layers, m.experts, m.top_k,
               m.capacity_factor > 0 ? strprintf("%g", m.capacity_factor).c_str() : "none (no dropping)", m.aux_alpha, m.z_loss,
               param_layout(cfg).total, model->moe_layout.total, param_layout(cfg).total + model->moe_layout.total,
               moe_active_params(cfg, model->moe, m.top_k));
    }
    printf("batch: B=%d T=%d, %d rank%s, %d accumulation step%s -> %lld tokens per step; %d steps; %d threads per rank\n",
           B, T, grid.dp, grid.dp == 1 ? "" : "s", plan.accumulation_steps, plan.accumulation_steps == 1 ? "" : "s",
           (long long)plan.total_batch_tokens, plan.steps, omp_get_max_threads());
    if (grid.world > 1) {
        printf("ranks: %d (%s, %d on this node), grid %s: rank 0's slice has %zu of %zu parameters%s, updates %zu\n",
               grid.world, world.launcher.c_str(), world.local_size, describe_grid(grid).c_str(), model->layout.total,
               param_layout(cfg).total, grid.zero_stage == 3 ? " (stored sharded: ZeRO-3)" : "",
               model->optimizer == Optimizer::AdamW ? model->table[CB_ADAM_M].elements : model->layout.total);
    }
    if (grid.world > 1 && grid.zero_stage == 1 && grid.tp == 1 && grid.pp == 1) {
        printf("ZeRO-1: shards of %zu, padded total %zu\n", model->zero.shards.shard_size, model->zero.shards.padded_total);
    }
    if (grid.pp > 1) {
        printf("%s", describe_pipeline(par.schedule, grid.pp, cfg.num_layers, plan.accumulation_steps, par.chunks).c_str());
    }
    printf("%s", describe_data(train, val, o).c_str());
    printf("memory: %s", held_summary(held_bytes(model), model->table, world.rank).c_str());
    if (o.recompute > 0) {
        printf("recompute %d: %s recomputed in the backward, one layer at a time, not kept per layer\n", o.recompute,
               recompute_what(o.recompute));
    }
    if (o.stash_precision == "bf16") {
        printf("stash bf16: ln1, ln2, qkv, att, atty, fch, fch_gelu kept for the backward in bf16 (where kept), one layer "
               "in fp32\n");
    }
    if (verbosity >= 2) print_buffer_table(model->table, CPU_ALLOCATION_GRANULE);  // --verbose: every buffer
    print_resumed(o, rm, resumed, grid);
}

// HellaSwag (llmc/run/run.h), in batches of the rows in use unless the forward pass spans ranks.
// ==============================================================================================
// Generation (--generate, llmc/run/generate.h): the whole model on one rank, no training state.
// With the KV cache (llmc/model/kv_cache.h) only the new tokens' rows go through the layers; each
// layer keeps the keys and values of every position so far. --kv-cache 0 recomputes the window
// with the training forward pass above, the reference the cached path is tested against.

// Each layer's cache, (L, T, C) for keys and for values, and the rows of the tokens being added
// (up to T of them: a prompt's prefill).
struct KVCache {
    std::vector<float> k, v;                 // (L, T, C)
    std::vector<float> x, ln, qkv, atty, proj, fch, fch_gelu;   // (T, C), (T, C), (T, 3C), (T, C), (T, C), (T, 4C) x2
    std::vector<float> mean, rstd;           // (T)
    std::vector<float> logits;               // (Vp): the last new token's
    MoEActivations moe;                      // --moe-experts: one MoE block's routing and rows, reused by each
};

static void kv_cache_allocate(KVCache* c, const GPT2Config& cfg, const MoEShape* moe) {
    size_t T = cfg.max_seq_len, C = cfg.channels;
    c->k.assign(cfg.num_layers * T * C, 0.0f);
    c->v.assign(cfg.num_layers * T * C, 0.0f);
    for (std::vector<float>* rows : {&c->x, &c->ln, &c->atty, &c->proj}) rows->assign(T * C, 0.0f);
    c->qkv.assign(T * 3 * C, 0.0f);
    c->fch.assign(T * 4 * C, 0.0f);
    c->fch_gelu.assign(T * 4 * C, 0.0f);
    c->mean.assign(T, 0.0f);
    c->rstd.assign(T, 0.0f);
    c->logits.assign(cfg.padded_vocab_size, 0.0f);
    poison_fresh(&c->k, &c->v, &c->x, &c->ln, &c->atty, &c->proj, &c->qkv, &c->fch, &c->fch_gelu, &c->mean, &c->rstd, &c->logits);  // tests
    if (moe) moe_allocate(&c->moe, *moe, (int)T, (int)C, 4 * (int)C);  // (--moe-experts)
}

// The forward pass of n new tokens at positions pos .. pos+n-1, the earlier ones' keys and values
// in the cache: the layers of gpt2_forward in the same order (bias, then residual), on n rows.
// Returns the logits of the last new token.
static const float* gpt2_forward_cached(GPT2* model, KVCache* c, const int* tokens, int n, int pos) {
    const GPT2Config& cfg = model->config;
    int L = cfg.num_layers, C = cfg.channels, NH = cfg.num_heads, T = cfg.max_seq_len, Vp = cfg.padded_vocab_size;
    ParamTensors<float> ends = layer_weights(model, ENDS);
    encoder_forward(c->x.data(), tokens, ends[WTE], nullptr, 1, n, C);
    position_forward(c->x.data(), ends[WPE], pos, n, T, C);  // rows at positions pos .. pos+n-1
    for (int l = 0; l < L; l++) {
        ParamTensors<float> w = layer_weights(model, l);
        float* k_cache = layer_slice(c->k, l, (size_t)T * C);
        float* v_cache = layer_slice(c->v, l, (size_t)T * C);
        layernorm_forward(c->ln.data(), c->mean.data(), c->rstd.data(), c->x.data(), w[LN1W], w[LN1B], n, C);
        matmul_forward_new_rows(c->qkv.data(), c->ln.data(), w[QKVW], w[QKVB], n, C, 3 * C);
        kv_cache_store(k_cache, v_cache, c->qkv.data(), pos, n, C);
        attention_cached(c->atty.data(), c->qkv.data(), k_cache, v_cache, pos, n, C, NH);
        matmul_forward_new_rows(c->proj.data(), c->atty.data(), w[ATTPROJW], nullptr, n, C, C);
        add_bias(c->proj.data(), w[ATTPROJB], n, C);
        residual_forward(c->x.data(), c->proj.data(), c->x.data(), (size_t)n * C);
        layernorm_forward(c->ln.data(), c->mean.data(), c->rstd.data(), c->x.data(), w[LN2W], w[LN2B], n, C);
        if (is_moe_block(model->moe, l)) {  // --moe-experts: the router sends each new row to its top-k experts
            int b = moe_block_index(model->moe, l);
            MoEWeights<const float> mw = moe_block_weights<const float>(w, model->moe_params.data(), model->moe_layout, b);
            moe_forward_new_rows(c->proj.data(), &c->moe, model->moe_shape, mw, c->ln.data(), n);
        } else {
            matmul_forward_new_rows(c->fch.data(), c->ln.data(), w[FCW], w[FCB], n, C, 4 * C);
            gelu_forward(c->fch_gelu.data(), c->fch.data(), (size_t)n * 4 * C);
            matmul_forward_new_rows(c->proj.data(), c->fch_gelu.data(), w[FCPROJW], nullptr, n, 4 * C, C);
            add_bias(c->proj.data(), w[FCPROJB], n, C);
        }
        residual_forward(c->x.data(), c->proj.data(), c->x.data(), (size_t)n * C);
    }
    // only the last row's logits are wanted: one row through the final LayerNorm and the LM head
    const float* last = c->x.data() + (size_t)(n - 1) * C;
    layernorm_forward(c->ln.data(), c->mean.data(), c->rstd.data(), last, ends[LNFW], ends[LNFB], 1, C);
    matmul_forward_new_rows(c->logits.data(), c->ln.data(), ends[WTE], nullptr, 1, C, Vp);
    return c->logits.data();
}

// --generate: one process, the weights of --model FILE or --resume CKPT, then llmc/run/generate.h.
static int generate_main(const TrainOptions& o) {
    Comm launched;
    comm_from_environment(&launched);
    std::string resume_dir;
    GPT2Config cfg = generation_model(o, launched.world_size, "one rank", &resume_dir);
    GPT2 model;
    gpt2_build(&model, cfg, std::vector<float>(param_layout(cfg).total, 0.0f));
    // --moe-experts (generation_model checked them against the file): every expert, routed without dropping
    if (o.moe_experts > 0) model.moe_shape = moe_generation_shape(o);
    CPURunShape training_forward = cpu_run_shape(cfg, 1, cfg.max_seq_len, ProcessGrid{}, PipelineSchedule::OneFOneB, 1, 0);
    training_forward.moe = MoEConfig{o.moe_experts, o.moe_every};
    training_forward.moe_top_k = o.moe_top_k;
    if (o.kv_cache) {  // (the MoE table alone from the size table's rows: the cache has its own buffers)
        model.moe = training_forward.moe;
        model.moe_layout = moe_layout(cfg, model.moe);
        model.moe_params.assign(model.moe_layout.total, 0.0f);
    } else {
        gpt2_allocate(&model, training_forward);  // before the weights: it sizes (and zeroes) the MoE table
    }
    load_weights(&model, o, resume_dir, false);
    if (o.kv_cache) {
        KVCache cache;
        kv_cache_allocate(&cache, cfg, model.moe.experts > 0 ? &model.moe_shape : nullptr);
        run_generation(o, cfg, "KV cache", [&](const std::vector<int>& tokens, int first, int cached) {
            int n = (int)tokens.size() - first - cached;
            cpu_threads_adapt();  // --threads 0: the free cores (llmc/run/cpu_threads.h)
            return gpt2_forward_cached(&model, &cache, tokens.data() + first + cached, n, cached);
        });
    } else {
        // the training forward, B = 1, over the whole window for every token
        run_generation(o, cfg, "recomputing the window", [&](const std::vector<int>& tokens, int first, int) {
            int len = (int)tokens.size() - first;
            cpu_threads_adapt();  // --threads 0: the free cores (llmc/run/cpu_threads.h)
            gpt2_forward(&model, tokens.data() + first, 1, len, 0);
            return (const float*)model.acts[0].logits.data() + (size_t)(len - 1) * model.slice.vocab_rows;
        });
    }
    return 0;
}


// ==============================================================================================
// The training loop

// The mean loss over every token of the step: the last stage's, one tensor rank of each data-parallel
// replica (every replica saw as many tokens, so it is the mean of their means).
static double mean_step_loss(GPT2* model, Parallel* par, double loss) {
    bool reports = model->slice.last_stage && par->grid.tp_rank == 0;
    return all_ranks_sum(par, reports ? loss : 0.0, "sum of the losses") / par->grid.dp;
}
// Whether this rank prints the run's reports: rank 0.
static bool prints_reports(const Parallel* par) { return par->grid.rank == 0; }

// n floats to 0. In an array far larger than the caches (d12's gradients: 500 MB) a plain store
// first reads the cache line it writes (to merge the rest of the line), so memset moves every byte
// twice; a streaming store writes whole lines straight to memory. Measured on d12's gradients, one
// core of an AVX-512 Xeon, CPU time: std::fill 52 ms, streaming 22 ms. Every core takes a share.
// (An array the caches hold, the main job's 14 MB, stays there instead: plain stores.)
static void zero_floats(float* p, size_t n) {
    if (n < ((size_t)32 << 20) / sizeof(float)) return (void)std::fill(p, p + n, 0.0f);
    size_t head = std::min(n, (64 - (uintptr_t)p % 64) % 64 / sizeof(float));  // to the first 64-byte line
    size_t lines = (n - head) / 16;
    float* lined = p + head;
    for (size_t i = 0; i < head; i++) p[i] = 0.0f;
    for (size_t i = head + 16 * lines; i < n; i++) p[i] = 0.0f;
#ifdef __AVX512F__
    #pragma omp parallel
    {
        #pragma omp for schedule(static) nowait
        for (size_t l = 0; l < lines; l++) _mm512_stream_ps(lined + 16 * l, _mm512_setzero_ps());
        _mm_sfence();  // (streaming stores are weakly ordered: done before anyone reads the gradients)
    }
#else  // (other CPUs: plain stores)
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < 16 * lines; i++) lined[i] = 0.0f;
#endif
}

// The step's gradient starts from zero.
static void zero_gradients(GPT2* model) {
    for (std::vector<float>* g : gradient_buffers(model))  // ZeRO's, pipelines', MoE's too
        if (g) zero_floats(g->data(), g->size());
}

// Optimizer step `step` (from 1; llmc/run/step.h: the same shape as train_gpt.cu's) on every rank:
// the passes of its micro-batches, the gradient sums and norm, and the optimizer unless step_is_sound
// finds the step bad.
static StepResult train_step(GPT2* model, Parallel* par, DataLoader* train, const RunPlan& plan, const TrainOptions& o,
                             int step, BadSteps* bad_steps) {
    StepResult r;
    r.lr = step_learning_rate(plan, o, step);
    zero_gradients(model);
    step_begin(model);  // MoE statistics
    double loss = forward_backward(model, par, train, plan, step);
    step_end(model, par, plan, step);  // 2BW weight versions, MoE statistics, the tests' injected inf
    r.loss = mean_step_loss(model, par, loss);  // data parallel: the mean of the replicas' means
    r.norm = finish_gradients(model, par);
    dump_first_step(model, par, (size_t)plan.B * plan.T);  // --dump-state (llmc/probes/state_dump.h)
    r.applied = step_is_sound(bad_steps, step, r.loss, r.norm, o.max_bad_steps, prints_reports(par));
    if (r.applied) optimizer_step(model, par, o, optimizer_t(step, *bad_steps), r.lr, r.norm);
    return r;
}

// ==============================================================================================
// The run around the step (llmc/run/train_loop.h): the CPU's passes, and the traffic each group of
// ranks sent in the last step, for the end reports.

struct CpuRunCounts {
    Comm* world;  // (main's: the tests' probes)
    Comm* groups[4];
    CommCounters last_step[4];  // data, tensor, pipeline, world
    BadSteps bad_steps;         // the steps in a row whose update was skipped (llmc/run/step.h)
};

static void cpu_before_step(Parallel* par, CpuRunCounts* c) {
    for (Comm* g : c->groups) g->counters = CommCounters{};
    par->ep_replicas.counters = CommCounters{};
    profile_step_begin();  // --profile: measures the SGEMM ceiling now, outside the step's time
    cpu_threads_adapt();   // --threads 0: the cores other programs left free (llmc/run/cpu_threads.h)
}

static StepReport cpu_after_step(GPT2* model, Parallel* par, CpuRunCounts* c, int step) {
    profile_step_end(step);
    for (int i = 0; i < 4; i++) c->last_step[i] = c->groups[i]->counters;
    for (int op = 0; op < COMM_NUM_OPS; op++)  // --expert-parallel: the experts' sum over their replicas is a data-parallel sum
        c->last_step[0].bytes[op] += par->ep_replicas.counters.bytes[op], c->last_step[0].calls[op] += par->ep_replicas.counters.calls[op];
    StepReport rep;
    rep.memory_bytes = peak_rss_bytes();
    bool moe = model->moe.experts > 0;  // --moe-experts: the LM loss above, the auxiliary losses and the routing beside it
    rep.moe_line = moe_step_line(model->moe_stats, moe);
    rep.moe_fields = moe_metrics_fields(model->moe_stats, moe);
    return rep;
}

// Evaluation and samples: each sample token from a forward pass over the window of the last max_T
// tokens. Sequence parallelism splits the rows over the tensor ranks: the window is padded at its end
// to a multiple of the degree (a causal model's earlier positions never see the padding).
static void cpu_evaluation_passes(GPT2* model, Parallel* par, RunPasses* p) {
    p->forward = [=](const int* in, const int* tg, int rows, int T) { return (double)pipeline_forward(model, par, in, tg, rows, T); };
    p->row_losses = [=]() { return (const float*)(model->slice.last_stage ? model->acts[0].losses.data() : nullptr); };
    p->world_sum = [=](double x, const char* what) { return comm_sum(&par->comms.world, x, what); };
    int multiple = model->tp.sequence_parallel ? model->tp.degree : 1;
    p->sample_logits = [=, logits = std::vector<float>()](const std::vector<int>& tokens, int len) mutable {
        const ModelSlice& s = model->slice;
        int padded = (len + multiple - 1) / multiple * multiple;
        std::vector<int> input(tokens.end() - len, tokens.end());
        input.resize((size_t)padded, 0);
        pipeline_forward(model, par, input.data(), nullptr, 1, padded);
        // the logits of the last real position: this rank's vocabulary rows, collected on rank 0
        const float* row = s.last_stage ? model->acts[0].logits.data() + (size_t)(len - 1) * s.vocab_rows : nullptr;
        if (!par->model_parallel) return row;
        collect_logits_row(&par->comms.world, s.last_stage, s, row, model->config.vocab_size, &logits);
        return (const float*)logits.data();
    };
    p->sample_window = model->max_T / multiple * multiple;
    p->fixed_shape = par->model_parallel;
    p->sample_world = &par->comms.world;
}

static RunPasses cpu_run_passes(GPT2* model, Parallel* par, DataLoader* train, const RunPlan* plan, const TrainOptions* o,
                                CpuRunCounts* c, const uint64_t* sampler_rng) {
    RunPasses p;
    cpu_evaluation_passes(model, par, &p);
    p.step_begins = [=](int step) { inject_offload_removal(c->world, step, model->offload.path[0]); };  // (tests: --offload-dir's file vanishing)
    p.before_step = [=](int) { cpu_before_step(par, c); };
    p.step = [=](int step) { return train_step(model, par, train, *plan, *o, step, &c->bad_steps); };
    p.after_step = [=](int step, const StepResult&, double) { return cpu_after_step(model, par, c, step); };
    p.checkpoint = [=](int step) {
        fail_unless_weights_finite(model, par, step);
        save_checkpoint(model, par, *o, *plan, step, *train, *sampler_rng, c->bad_steps.skipped);
    };
    return p;
}

// ==============================================================================================
// Start-up and the end of the run: main's steps.

// --estimate and --plan: arithmetic only, no MPI, no weights, no data (llmc/memory/estimate.h,
// llmc/parallel/grid_planner.h).
static int print_cpu_arithmetic(const TrainOptions& o) {
    Comm launched;
    comm_from_environment(&launched);  // under mpirun every copy would print it: rank 0 does
    if (launched.rank != 0) return 0;
    EstimateSetup setup = estimate_setup(o, Trainer::CPU, 4, false, false);
    if (setup.ranks % o.expert_parallel != 0)
        usage_fail("--expert-parallel %d must divide the data-parallel ranks %d: pass --estimate-ranks with a multiple of %d",
                   o.expert_parallel, setup.ranks, o.expert_parallel);
    if (o.plan > 0) print_plan(o, setup);
    else print_estimate(setup);
    return 0;
}

// The grid: who works with whom (llmc/parallel/process_grid.h).
static void start_cpu_grid(Comm* world, const TrainOptions& o, Parallel* par) {
    std::string why = make_grid(world->world_size, world->rank, o.tensor_parallel, o.pipeline_parallel, 0, o.zero_stage,
                                o.sequence_parallel, &par->grid);
    if (!why.empty()) grid_usage_fail(world, why);
    const ProcessGrid& grid = par->grid;
    parse_pipeline_schedule(o.pipeline_schedule, &par->schedule);  // (2bw-flush: 2bw, every step drained)
    par->chunks = o.virtual_stages;  // (validate_options: more than 1 only with interleaved)
    // (--expert-parallel: a forward pass's all-to-all needs every rank of the expert group)
    par->model_parallel = grid.tp > 1 || grid.pp > 1 || grid.zero_stage == 3 || o.expert_parallel > 1;
    if (grid.dp % o.expert_parallel != 0)
        grid_usage_fail(world, strprintf("--expert-parallel %d must divide the data-parallel degree %d (the ranks): run on a "
                                         "multiple of %d ranks, or pick a divisor of %d", o.expert_parallel, grid.dp,
                                         o.expert_parallel, grid.dp));
}

// Whether this grid, batch and memory budget can train the model. Returns what every rank will
// allocate: the same setup --estimate prints, from which build_model sizes every buffer
// (llmc/memory/estimate.h's estimate_cpu_shape).
static EstimateSetup check_cpu_run(Comm* world, const TrainOptions& o, const GPT2Config& cfg, const RunPlan& shape, const Parallel& par) {
    const ProcessGrid& grid = par.grid;
    // the grid, the schedule, compression and the server on this model: the table's Shape rows (llmc/run/compatibility.h)
    std::string why = compatibility_grid_problem(o, Trainer::CPU, "fp32", cfg, grid);
    if (!why.empty()) grid_usage_fail(world, why);
    GradCompressionSettings compression = grad_compression_settings(o);
    compression.every_matrix = grad_compression_test_every_matrix();
    EstimateSetup predicted = run_estimate(o, cfg, shape, grid, par.schedule);
    predicted.compression = compression;  // (with the tests' every-matrix switch)
    refuse_unless_memory_fits(world, predicted, o.max_memory_mib);
    refuse_unless_offload_dir_fits(world, o, predicted, shape.B);
    return predicted;
}

// After the last step: what each group of ranks sent, expert parallelism's all-to-alls, the
// parameter server's comparison, the allocations; then the probes' files.
static void cpu_end_reports(GPT2* model, Parallel* par, Comm* world, const TrainOptions& o, const EstimateSetup& predicted,
                            const CpuRunCounts& counts, const RunPlan& plan, int first_step) {
    const ProcessGrid& grid = par->grid;
    bool leader = world->rank == 0;
    int steps = plan.steps - first_step;
    if (grid.world > 1 && steps > 0)
        report_costs(held_bytes(model), model->table, grid, &par->comms.world, par->times, predicted, counts.last_step, steps);
    if (model->ep && steps > 0) {  // --expert-parallel: what its all-to-alls moved, and --estimate's bounds
        const CommCounters& ec = par->ep.counters;
        double bytes = comm_sum(world, (double)ec.bytes[COMM_ALL_TO_ALL], "sum of the expert-parallel bytes");
        ExpertParallelBytes e = estimate_expert_parallel_bytes(predicted);
        if (leader)
            printf("expert parallel: the all-to-alls sent %.0f bytes from all ranks over %d steps, %.0f a step, %.0f a step and "
                   "rank (%llu calls a rank: counts and rows, forward and backward, evaluations included); --estimate a step "
                   "and rank: counts %llu + rows at most %llu (%llu at even routing), %llu calls\n", bytes,
                   steps, bytes / steps, bytes / steps / grid.world,
                   (unsigned long long)ec.calls[COMM_ALL_TO_ALL], (unsigned long long)e.counts, (unsigned long long)e.rows_at_most,
                   (unsigned long long)e.rows_even, (unsigned long long)e.calls);
    }
    if (leader && grid.dp > 1 && steps > 0 && grid.zero_stage == 0 && grid.tp == 1 && grid.pp == 1 &&
        predicted.compression.kind == GradCompressionKind::None && model->moe.experts == 0)  // (its arithmetic knows the dense table only)
        parameter_server_report(model->server, counts.last_step[0], model->layout.total);  // --data-parallel: server vs all-reduce
    if (o.print_allocations) print_allocations(held_bytes(model), model->table, world->rank);  // after the run: nothing grew while it trained
    dump_at_end(model, par, o.dump_state, plan.B, plan.T);
    disk_offload_close(&model->offload);
    profile_finish();
}

int main(int argc, char** argv) {
    cpu_threads_wait_asleep(argv);  // OpenMP's threads sleep at a barrier after 10,000 spins (llmc/run/cpu_threads.h)
    TrainOptions o;
    parse_command_line(argc, argv, Trainer::CPU, &o);
    resume_options(&o);  // --resume: the run's recorded options, its folder, its step count (llmc/run/resume.h)
    validate_options(o);
    refuse_incompatible_flags(o, Trainer::CPU, "fp32");  // which techniques combine: llmc/run/compatibility.h
    validate_precision(o, Trainer::CPU, "fp32");
    Comm launched;  // (the launcher's rank: rank 0 alone says when the thread count is lowered)
    comm_from_environment(&launched);
    cpu_threads_start(o.threads, o.quiet || launched.rank != 0, generation_mode(o) ? stderr : stdout);  // --threads N, or the free cores (llmc/run/cpu_threads.h)
    if (generation_mode(o)) return generate_main(o);  // --generate: no data, no training (llmc/run/generate.h)
    if (o.pipeline_print_schedule) return print_pipeline_schedule(o);  // arithmetic only (llmc/memory/estimate.h)
    if (o.estimate) refuse_incompatible_estimate(o, Trainer::CPU, "fp32", estimate_config(o));  // as training would
    if (o.estimate || o.plan > 0) return print_cpu_arithmetic(o);
    Comm world;
    comm_init(&world, o.comm_timeout);
    comm_require_mpi(&world, "the CPU trainer's collectives");  // before any work, not at the first collective
    bool leader = world.rank == 0;  // rank 0 alone prints, and writes the model
    Parallel par;
    start_cpu_grid(&world, o, &par);
    const ProcessGrid& grid = par.grid;

    // ---- the model's shape, and whether this grid, batch and memory budget can train it
    RunModel rm;
    std::string why = choose_model(o, leader, &rm);  // its MoE settings must be the flags'
    if (!why.empty()) grid_usage_fail(&world, why);
    const GPT2Config& cfg = rm.cfg;
    RunPlan shape = plan_run(o, cfg, grid.dp, 0);  // the batch geometry (the step count needs the data)
    EstimateSetup predicted = check_cpu_run(&world, o, cfg, shape, par);
    DataLoader train;
    open_training_data(&train, o, cfg, grid);  // before the model is allocated: a shard too short is refused now
    grid_comms_init(&par.comms, world, grid);
    trace_open(o.trace, world.rank, world.world_size, grid.pp_rank);  // --trace: a path it cannot write stops the run now
    GPT2 model;
    build_model(&model, &par, o, cfg, shape, predicted, rm.resume_dir, rm.new_model);

    // ---- the shape of the run, and a resumed run's state
    RunPlan plan = plan_run(o, cfg, grid.dp, train.tokens_per_epoch);
    RunEvents ev;
    open_validation(&ev, o, cfg, plan, leader, par.model_parallel);
    par.times.predicted_bubble = pipeline_predicted_bubble(par.schedule, grid.pp, plan.accumulation_steps, par.chunks);
    par.times.bubble_formula = pipeline_bubble_formula(par.schedule);
    uint64_t sampler_rng = o.seed ^ 0x5DEECE66Dull;
    TrainStateHeader resumed;
    if (!rm.resume_dir.empty()) resume_state(&model, grid, o, rm.resume_dir, plan, leader, &train, &resumed, &sampler_rng);
    if (!rm.resume_dir.empty()) pipedream_2bw_load(&model.versions, rm.resume_dir, grid.rank, grid.world, resumed.step);  // 2bw: W(t-1)
    int first_step = (int)resumed.step;
    if (o.eval_only) plan.steps = first_step;  // evaluating is a run of zero steps

    if (run_is_complete(o, first_step, plan.steps, leader)) {  // nothing to train: nothing written
        trace_close();
        comm_finalize(&world);
        return 0;
    }
    if (leader) print_run_header(&model, par, world, o, plan, rm, train, ev.have_val ? &ev.val : nullptr, resumed);
    if (leader) profile_start(o.profile, model.slice.vocab_rows, matmul);  // --profile: the ceiling, measured now
    open_reports(&ev, o, cfg, plan, leader, "cpu", grid.world, first_step, rm);
    CpuRunCounts counts{&world, {&par.comms.dp, &par.comms.tp, &par.comms.pp, &par.comms.world}, {}, {}};
    counts.bad_steps.skipped = resumed.updates_skipped;  // (AdamW's t leaves them out: llmc/run/step.h)
    run_training(RunLoop{&o, &plan, first_step, cfg.vocab_size, leader, par.model_parallel, grid, &world, &par.pipe_drains, &sampler_rng, &ev},
                 cpu_run_passes(&model, &par, &train, &plan, &o, &counts, &sampler_rng));
    cpu_end_reports(&model, &par, &world, o, predicted, counts, plan, first_step);
    close_reports(&ev, leader);
    comm_finalize(&world);
    return 0;
}
