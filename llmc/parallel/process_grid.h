// process_grid.h — one grid of ranks for data, tensor and pipeline parallelism: who works with whom,
// and which slice of the model each rank holds.
//
// A model too large for one device is cut three ways at once, and every rank sits at one point of
// a 3-D grid of  world = dp x tp x pp  ranks:
//
//   tensor parallel (tp)    the ranks of a tensor group hold different columns/rows of the SAME
//                           layers and compute every matmul together (llmc/parallel/tensor_parallel.h);
//                           they talk the most (an all-reduce per sub-block), so they are
//                           neighbours: consecutive ranks, on one node, on the fastest links.
//   data parallel (dp)      the ranks of a data group hold the same slice of the model and train on
//                           different data, summing gradients once per step (llmc/parallel/zero.h shards
//                           what they would otherwise all copy).
//   pipeline parallel (pp)  the ranks of a pipeline group hold different LAYERS and pass
//                           activations forward and gradients back (llmc/parallel/pipeline_parallel.h);
//                           they send the least, so they are the farthest apart.
//
//     rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank          (tensor fastest, Megatron's order)
//
//   dp=2 tp=2 pp=2:   stage 0: ranks 0 1 | 2 3     stage 1: ranks 4 5 | 6 7
//                               tp group^   ^dp group pairs 0-2, 1-3, 4-6, 5-7; pp pairs 0-4, 1-5, ...
//
// What one rank holds (ModelSlice): the layers of its pipeline stage; of each of those layers, its
// tensor rank's share of the heads and of the MLP's hidden units; of the vocabulary (embedding and
// LM head, tied), its share of the rows. Everything else (LayerNorms, the biases added after a
// row-parallel matmul, the position embedding) is small and REPLICATED on every tensor rank.
// The trainers allocate from slice_layout(): the same 16 tensors as the full model, with local
// shapes. On one rank the slice is the whole model and the local layout is the global one.
//
// Where the slice lives in the full model (slice_runs): a list of runs "local elements [l, l+n) are
// global elements [g, g+n)". That list is all that checkpoints, --dump-state and initialisation
// need: a rank initialises its runs with the counter-based generator of llmc/model/model.h (so every
// grid starts from the same weights as one rank), writes its runs into a checkpoint in global
// coordinates (so any grid can read them back), and sends its runs to rank 0 for a dump. The same
// map one element at a time (slice_global_index) keys what is drawn per element, such as the bf16
// moments' stochastic rounding (llmc/optim/adamw_bf16.h), so a grid draws the one-rank run's bits.
#pragma once

#include <algorithm>
#include <string>
#include <vector>
#include "llmc/parallel/comm.h"
#include "llmc/model/model.h"
#include "llmc/utils.h"

struct ProcessGrid {
    int world = 1, rank = 0;
    int dp = 1, tp = 1, pp = 1;              // degrees: world = dp * tp * pp
    int dp_rank = 0, tp_rank = 0, pp_rank = 0;
    bool sequence_parallel = false;          // tensor-parallel ranks also split the LayerNorm regions by rows
    int zero_stage = 0;                      // how the data-parallel ranks share optimizer, gradients, parameters
};

inline int grid_rank(const ProcessGrid& g, int dp_rank, int tp_rank, int pp_rank) {
    return (pp_rank * g.dp + dp_rank) * g.tp + tp_rank;
}

// The grid for `world` ranks with the given tensor and pipeline degrees (data = the rest).
// `data_parallel` > 0 asks for that data degree and must agree. Returns "" or why it is impossible.
inline std::string make_grid(int world, int rank, int tp, int pp, int data_parallel, int zero_stage, bool sequence_parallel,
                             ProcessGrid* out) {
    if (tp < 1 || pp < 1) return "--tensor-parallel and --pipeline-parallel must be at least 1";
    if (world % (tp * pp) != 0) {
        return strprintf("%d rank%s cannot form a grid with --tensor-parallel %d and --pipeline-parallel %d: the number of "
                         "ranks must be a multiple of tp x pp = %d (the data-parallel degree is ranks / (tp x pp))", world,
                         world == 1 ? "" : "s", tp, pp, tp * pp);
    }
    ProcessGrid g;
    g.world = world;
    g.rank = rank;
    g.tp = tp;
    g.pp = pp;
    g.dp = world / (tp * pp);
    if (data_parallel > 0 && data_parallel != g.dp) {
        return strprintf("--data-parallel %d does not match the launch: %d rank%s / (tp %d x pp %d) = %d", data_parallel, world,
                         world == 1 ? "" : "s", tp, pp, g.dp);
    }
    g.tp_rank = rank % tp;
    g.dp_rank = (rank / tp) % g.dp;
    g.pp_rank = rank / (tp * g.dp);
    g.zero_stage = zero_stage;
    g.sequence_parallel = sequence_parallel;
    *out = g;
    return "";
}

// Why this grid cannot train this model with this batch, or "" if it can. Shared by the trainers
// and --estimate; each message says what to change.
inline std::string grid_problem(const ProcessGrid& g, const GPT2Config& cfg, int B, int T, int micro_batches) {
    if (cfg.num_heads % g.tp != 0) {
        return strprintf("--tensor-parallel %d does not divide the %d attention heads: each tensor rank computes whole heads",
                         g.tp, cfg.num_heads);
    }
    if (cfg.num_layers < g.pp) {
        return strprintf("--pipeline-parallel %d exceeds the %d layers: every stage needs at least one layer", g.pp,
                         cfg.num_layers);
    }
    if (g.pp > 1 && micro_batches < g.pp) {
        return strprintf("%d micro-batch%s per step cannot fill a pipeline of %d stages: raise --total-batch-tokens to at "
                         "least %d micro-batches (the bubble is (p-1)/(m+p-1) of the step, so m >> p is better)",
                         micro_batches, micro_batches == 1 ? "" : "es", g.pp, g.pp);
    }
    if (g.zero_stage < 0 || g.zero_stage > 3) return strprintf("--zero must be 0, 1, 2 or 3, got %d", g.zero_stage);
    if (g.zero_stage >= 2 && g.pp > 1) {
        return strprintf("--zero %d with --pipeline-parallel %d: ZeRO-2 would reduce-scatter and ZeRO-3 re-gather every stage's "
                         "gradients or parameters once per micro-batch, m times a step (DeepSpeed refuses the same pair); "
                         "use --zero 1 with pipelines", g.zero_stage, g.pp);
    }
    if (g.sequence_parallel && g.tp == 1) return "--sequence-parallel needs --tensor-parallel 2 or more";
    if (g.sequence_parallel && ((int64_t)B * T) % g.tp != 0) {
        return strprintf("--sequence-parallel splits the B*T = %d rows of each micro-batch over %d tensor ranks; %d does not "
                         "divide it", B * T, g.tp, g.tp);
    }
    if (cfg.padded_vocab_size < g.tp) return strprintf("--tensor-parallel %d exceeds the vocabulary", g.tp);
    return "";
}

inline std::string describe_grid(const ProcessGrid& g) {
    std::string s = strprintf("dp %d x tp %d x pp %d", g.dp, g.tp, g.pp);
    if (g.sequence_parallel) s += " (sequence parallel)";
    return s + strprintf(", ZeRO-%d", g.zero_stage);
}

// ----------------------------------------------------------------------------------------------
// The groups. Each rank joins three: the ranks that differ from it only in tp_rank, only in
// dp_rank, or only in pp_rank. Within a group, ranks are numbered by that coordinate.
struct GridComms {
    Comm world, dp, tp, pp;
};

enum GridGroup { DATA_GROUP, TENSOR_GROUP, PIPELINE_GROUP };

// Which group of that kind a rank is in: a number shared by exactly the ranks that agree on the
// other two coordinates.
inline int grid_group_color(const ProcessGrid& g, GridGroup kind) {
    switch (kind) {
        case DATA_GROUP: return g.pp_rank * g.tp + g.tp_rank;
        case TENSOR_GROUP: return g.pp_rank * g.dp + g.dp_rank;
        case PIPELINE_GROUP: return g.dp_rank * g.tp + g.tp_rank;
    }
    return 0;
}

inline void grid_comms_init(GridComms* c, const Comm& world, const ProcessGrid& g) {
    c->world = world;
    comm_split(&c->world, grid_group_color(g, DATA_GROUP), g.dp_rank, &c->dp, "creating the data-parallel groups");
    comm_split(&c->world, grid_group_color(g, TENSOR_GROUP), g.tp_rank, &c->tp, "creating the tensor-parallel groups");
    comm_split(&c->world, grid_group_color(g, PIPELINE_GROUP), g.pp_rank, &c->pp, "creating the pipeline-parallel groups");
    if (c->dp.world_size != g.dp || c->tp.world_size != g.tp || c->pp.world_size != g.pp ||
        c->dp.rank != g.dp_rank || c->tp.rank != g.tp_rank || c->pp.rank != g.pp_rank) {
        fail("internal: MPI formed groups that do not match the grid %s", describe_grid(g).c_str());
    }
}

// ----------------------------------------------------------------------------------------------
// The slice of the model one rank holds

struct ModelSlice {
    // pipeline: a contiguous range of layers; the first stage embeds, the last stage has the head
    // (interleaved 1F1B: `chunks` blocks of num_layers / chunks layers each, not contiguous: slice_layer)
    int layer_begin = 0, num_layers = 0;
    bool first_stage = true, last_stage = true;
    int chunks = 1, stage = 0, stages = 1;   // model chunks of this rank; its pipeline rank of how many
    // tensor: whole heads, an equal share of the MLP's hidden units, an equal share of vocabulary rows
    int tp = 1, tp_rank = 0;
    int heads = 0, head_begin = 0;           // of NH
    int attn_channels = 0;                   // heads * head size = C / tp: this rank's q, k, v, attention output
    int fc_channels = 0, fc_begin = 0;       // of the 4C hidden units
    int vocab_rows = 0, vocab_begin = 0;     // rows of wte held, padding included: ceil(Vp / tp)
    int vocab_real = 0;                      // of them, rows < V: real tokens (the rest never enter the loss)
    int vocab_stored = 0;                    // of them, rows < Vp: rows of the global array (the rest are tp padding)
};

// Layers per stage: L / pp each, the first L % pp stages one more.
inline void stage_layers(int L, int pp, int stage, int* begin, int* count) {
    int base = L / pp, extra = L % pp;
    *count = base + (stage < extra ? 1 : 0);
    *begin = stage * base + std::min(stage, extra);
}

// Interleaved 1F1B's layers (llmc/parallel/pipeline_schedule.h: Narayanan et al., SC'21, 2.2.2). The
// L layers are cut into p*v blocks of Lc = L/(p v) and rank r holds v of them, strided by p:
//
//     model chunk c of rank r = block c*p + r = global layers [(c p + r) Lc, (c p + r + 1) Lc)
//
//     L = 8, p = 2, v = 2:  rank 0: chunk 0 = layers 0-1, chunk 1 = layers 4-5
//                           rank 1: chunk 0 = layers 2-3, chunk 1 = layers 6-7
//
// so a micro-batch goes around the ring of ranks v times: rank p-1's chunk c feeds rank 0's chunk
// c+1. Locally the slice is still one stack of L/p layers, chunk after chunk (local layer l is
// chunk l / Lc), which is all the flat arrays, ZeRO and the optimizer see; only this mapping and the
// passes (which run one chunk at a time, pass_layers) know. Checkpoints are written through it in
// global coordinates, so the files do not depend on p or v. Without interleaving v = 1 and the
// mapping is the contiguous range: global layer = layer_begin + l.
inline int slice_layer(const ModelSlice& s, int l) {
    if (s.chunks == 1) return s.layer_begin + l;
    int per_chunk = s.num_layers / s.chunks;
    return ((l / per_chunk) * s.stages + s.stage) * per_chunk + l % per_chunk;
}

// What one pass of model chunk `chunk` runs: local layers [first, first + count), and the embedding
// before them (chunk 0 of the first stage) or the head after them (the last chunk of the last stage).
struct PassLayers {
    int first = 0, count = 0;
    bool embeds = false, head = false;
};
inline PassLayers pass_layers(const ModelSlice& s, int chunk) {
    int per_chunk = s.num_layers / s.chunks;
    return {chunk * per_chunk, per_chunk, s.first_stage && chunk == 0, s.last_stage && chunk == s.chunks - 1};
}

// `chunks` > 1: interleaved 1F1B's v model chunks per stage (L must be a multiple of pp * chunks:
// pipeline_schedule_problem says so first).
inline ModelSlice model_slice(const GPT2Config& cfg, const ProcessGrid& g, int chunks = 1) {
    ModelSlice s;
    stage_layers(cfg.num_layers, g.pp, g.pp_rank, &s.layer_begin, &s.num_layers);
    s.first_stage = g.pp_rank == 0;
    s.last_stage = g.pp_rank == g.pp - 1;
    s.chunks = chunks, s.stage = g.pp_rank, s.stages = g.pp;
    s.tp = g.tp;
    s.tp_rank = g.tp_rank;
    int hs = cfg.channels / cfg.num_heads;
    s.heads = cfg.num_heads / g.tp;
    s.head_begin = g.tp_rank * s.heads;
    s.attn_channels = s.heads * hs;
    s.fc_channels = 4 * cfg.channels / g.tp;
    s.fc_begin = g.tp_rank * s.fc_channels;
    // Vp is a multiple of 128, so tp = 2, 4, 8 divide it; any other tp gets a few rows of padding
    // on its last rank: rows that exist in no file and whose logits are masked like the vocab padding.
    // Split, each rank's rows are a multiple of 8, so that every row of its logits starts on 16 bytes
    // (the GPU's vector loads and cuBLAS want that): tp = 3 over Vp = 512 holds 176 rows each.
    s.vocab_rows = (cfg.padded_vocab_size + g.tp - 1) / g.tp;
    if (g.tp > 1) s.vocab_rows = (s.vocab_rows + 7) / 8 * 8;
    s.vocab_begin = g.tp_rank * s.vocab_rows;
    s.vocab_stored = std::max(0, std::min(s.vocab_rows, cfg.padded_vocab_size - s.vocab_begin));
    s.vocab_real = std::max(0, std::min(s.vocab_rows, cfg.vocab_size - s.vocab_begin));
    return s;
}

// The whole model, on one rank.
inline ModelSlice full_model_slice(const GPT2Config& cfg) { return model_slice(cfg, ProcessGrid{}); }

// Tensors every tensor rank holds whole (the rest are split: wte by rows, qkv and fc by output
// columns, the two output projections by input columns).
inline bool tensor_is_replicated(int t) {
    return t == WPE || t == LN1W || t == LN1B || t == ATTPROJB || t == LN2W || t == LN2B || t == FCPROJB || t == LNFW || t == LNFB;
}

inline bool tensor_is_per_layer(int t) { return t != WTE && t != WPE && t != LNFW && t != LNFB; }

// Elements of tensor t per layer in the slice (per-layer tensors), or in all (the others).
inline size_t slice_tensor_count(const GPT2Config& cfg, const ModelSlice& s, int t) {
    size_t C = cfg.channels, Ca = s.attn_channels, Cf = s.fc_channels;
    switch (t) {
        case WTE: return s.first_stage ? (size_t)s.vocab_rows * C : 0;
        case WPE: return s.first_stage ? (size_t)cfg.max_seq_len * C : 0;
        case LN1W: case LN1B: case LN2W: case LN2B: case ATTPROJB: case FCPROJB: return C;
        case QKVW: return 3 * Ca * C;
        case QKVB: return 3 * Ca;
        case ATTPROJW: return C * Ca;
        case FCW: return Cf * C;
        case FCB: return Cf;
        case FCPROJW: return C * Cf;
        case LNFW: case LNFB: return s.last_stage ? C : 0;
    }
    return 0;
}

// The slice's flat parameter array: the 16 tensors in the usual order, local shapes, local layers.
// (The last stage of a pipeline does not hold wte although its LM head uses it: the first stage
// owns the tied weight and lends it, see llmc/pipeline_parallel.h.)
inline ParamLayout slice_layout(const GPT2Config& cfg, const ModelSlice& s) {
    ParamLayout p;
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        p.count[t] = slice_tensor_count(cfg, s, t) * (tensor_is_per_layer(t) ? s.num_layers : 1);
        p.offset[t] = p.total;
        p.total += p.count[t];
    }
    return p;
}

// "Local elements [local, local + count) are global elements [global, global + count)."
struct SliceRun {
    size_t local, global, count;
};

// Where every local element lives in the full model, in increasing local (and global) order.
// Local elements with no global counterpart (tensor-parallel vocab padding) are in no run.
inline std::vector<SliceRun> slice_runs(const GPT2Config& cfg, const ModelSlice& s) {
    ParamLayout local = slice_layout(cfg, s), global = param_layout(cfg);
    size_t C = cfg.channels, Ca = s.attn_channels, Cf = s.fc_channels;
    std::vector<SliceRun> runs;
    auto add = [&](size_t l, size_t g, size_t n) {
        if (n == 0) return;
        if (!runs.empty() && runs.back().local + runs.back().count == l && runs.back().global + runs.back().count == g) {
            runs.back().count += n;  // merge with the previous run when both sides continue
        } else {
            runs.push_back({l, g, n});
        }
    };
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        if (local.count[t] == 0) continue;
        size_t lo = local.offset[t], go = global.offset[t];
        if (t == WTE) {
            add(lo, go + (size_t)s.vocab_begin * C, (size_t)s.vocab_stored * C);
            continue;
        }
        if (!tensor_is_per_layer(t)) {
            add(lo, go, local.count[t]);
            continue;
        }
        size_t per_layer_local = slice_tensor_count(cfg, s, t), per_layer_global = global.count[t] / cfg.num_layers;
        for (int l = 0; l < s.num_layers; l++) {
            size_t ll = lo + (size_t)l * per_layer_local, gl = go + (size_t)slice_layer(s, l) * per_layer_global;
            size_t q0 = (size_t)s.head_begin * (C / cfg.num_heads);  // first q/k/v channel of this rank's heads
            switch (t) {
                case QKVW:  // rows q | k | v, each a block of Ca rows of C
                    for (size_t part = 0; part < 3; part++) add(ll + part * Ca * C, gl + (part * C + q0) * C, Ca * C);
                    break;
                case QKVB:
                    for (size_t part = 0; part < 3; part++) add(ll + part * Ca, gl + part * C + q0, Ca);
                    break;
                case ATTPROJW:  // (C, C): every row, columns of this rank's heads
                    for (size_t row = 0; row < C; row++) add(ll + row * Ca, gl + row * C + q0, Ca);
                    break;
                case FCW:  // (4C, C): a block of Cf rows
                    add(ll, gl + (size_t)s.fc_begin * C, Cf * C);
                    break;
                case FCB:
                    add(ll, gl + s.fc_begin, Cf);
                    break;
                case FCPROJW:  // (C, 4C): every row, this rank's Cf columns
                    for (size_t row = 0; row < C; row++) add(ll + row * Cf, gl + row * 4 * C + s.fc_begin, Cf);
                    break;
                default:  // replicated: the whole layer
                    add(ll, gl, per_layer_local);
                    break;
            }
        }
    }
    return runs;
}

// The global runs of local elements [begin, end), in increasing local order: the part of each
// slice run that falls inside the range. `runs` is slice_runs() of the slice.
inline std::vector<SliceRun> runs_in_local_range(const std::vector<SliceRun>& runs, size_t begin, size_t end) {
    std::vector<SliceRun> out;
    auto first = std::upper_bound(runs.begin(), runs.end(), begin, [](size_t v, const SliceRun& r) { return v < r.local + r.count; });
    for (auto it = first; it != runs.end() && it->local < end; ++it) {
        size_t lo = std::max(begin, it->local), hi = std::min(end, it->local + it->count);
        if (lo < hi) out.push_back({lo, it->global + (lo - it->local), hi - lo});
    }
    return out;
}

// The tensor a local element belongs to.
inline int tensor_of(const ParamLayout& layout, size_t local) {
    for (int t = NUM_PARAM_TENSORS - 1; t >= 0; t--)
        if (layout.count[t] > 0 && local >= layout.offset[t]) return t;
    return 0;
}

// Each element of the model is held by several ranks (tensor ranks hold the replicated tensors,
// data-parallel ranks hold the same slice); exactly one of them counts it in the gradient norm and
// writes it to a checkpoint. Among the holders that keep its optimizer state, that is tensor rank 0
// for a replicated tensor, and the only holder for a split one.
inline bool counts_once(const ProcessGrid& g, int tensor) { return !tensor_is_replicated(tensor) || g.tp_rank == 0; }

// The same map as slice_runs, element by element, for code that has one element in hand and no
// table to search: a GPU thread (the bf16 moments' rounding key, llmc/optim/adamw_bf16.h, whose
// kernel takes this struct by value). Every split in slice_runs has one shape: inside a layer's
// piece of tensor t, local offset o is row o / width and column o % width of a block that starts
// at `base` in the global layer and whose rows are `stride` apart:
//     global = global_offset + global_layer * global_per_layer + (o / width) * stride + base + o % width
// (a whole tensor is one row: width = its count). Layers map as slice_layer does, written with
// divisions: global layer = (l / per_chunk) * chunk_stride + first_layer + l % per_chunk.
// Local elements with no global counterpart (tensor-parallel vocab padding, always zero) get the
// index the formula gives them, inside or past wte: keys only, never read or written there.
struct SliceIndexMap {
    struct Tensor {
        uint64_t local_offset, local_per_layer, global_offset, global_per_layer, width, stride, base;
    } tensor[NUM_PARAM_TENSORS];
    uint64_t per_chunk, chunk_stride, first_layer;
};

inline SliceIndexMap slice_index_map(const GPT2Config& cfg, const ModelSlice& s) {
    ParamLayout local = slice_layout(cfg, s), global = param_layout(cfg);
    uint64_t C = cfg.channels, Ca = s.attn_channels, Cf = s.fc_channels;
    uint64_t q0 = (uint64_t)s.head_begin * (C / cfg.num_heads);  // first q/k/v channel of this rank's heads
    SliceIndexMap map;
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        bool layered = tensor_is_per_layer(t);
        uint64_t per_layer = layered ? slice_tensor_count(cfg, s, t) : local.count[t];
        SliceIndexMap::Tensor& m = map.tensor[t];
        m = {local.offset[t], std::max<uint64_t>(per_layer, 1), global.offset[t], layered ? global.count[t] / cfg.num_layers : 0,
             std::max<uint64_t>(per_layer, 1), 0, 0};
        switch (t) {
            case WTE: m.base = (uint64_t)s.vocab_begin * C; break;
            case QKVW: m.width = Ca * C, m.stride = C * C, m.base = q0 * C; break;   // q | k | v blocks of Ca rows
            case QKVB: m.width = Ca, m.stride = C, m.base = q0; break;
            case ATTPROJW: m.width = Ca, m.stride = C, m.base = q0; break;           // every row, this rank's heads' columns
            case FCW: m.base = (uint64_t)s.fc_begin * C; break;
            case FCB: m.base = s.fc_begin; break;
            case FCPROJW: m.width = Cf, m.stride = 4 * C, m.base = s.fc_begin; break;  // every row, Cf columns
            default: break;
        }
    }
    map.per_chunk = std::max(1, s.num_layers / s.chunks);
    map.chunk_stride = (uint64_t)s.stages * map.per_chunk;
    map.first_layer = s.chunks == 1 ? s.layer_begin : (uint64_t)s.stage * map.per_chunk;
    return map;
}

#ifdef __CUDACC__
__host__ __device__
#endif
inline uint64_t slice_global_index(const SliceIndexMap& map, uint64_t local) {
    int t = NUM_PARAM_TENSORS - 1;
    while (t > 0 && local < map.tensor[t].local_offset) t--;  // (an empty tensor shares its successor's offset)
    const SliceIndexMap::Tensor& m = map.tensor[t];
    uint64_t o = local - m.local_offset, l = o / m.local_per_layer;
    o %= m.local_per_layer;
    uint64_t layer = (l / map.per_chunk) * map.chunk_stride + map.first_layer + l % map.per_chunk;
    return m.global_offset + layer * m.global_per_layer + (o / m.width) * m.stride + m.base + o % m.width;
}

// Initialises the slice: every run gets the values the full model has there (llmc/model/model.h's
// counter-based generator depends on the global index only). Tensor-parallel vocab padding is 0.
inline void init_slice_params(const GPT2Config& cfg, const ModelSlice& s, uint64_t seed, float* params) {
    ParamLayout local = slice_layout(cfg, s);
    std::fill(params, params + local.total, 0.0f);
    for (const SliceRun& r : slice_runs(cfg, s)) init_gpt2_params(cfg, seed, params + r.local, r.global, r.global + r.count);
}

// Copies the slice's runs out of a full model's array (a model file read on every rank).
inline void slice_from_full(const GPT2Config& cfg, const ModelSlice& s, const float* full, float* params) {
    ParamLayout local = slice_layout(cfg, s);
    std::fill(params, params + local.total, 0.0f);
    for (const SliceRun& r : slice_runs(cfg, s)) memcpy(params + r.local, full + r.global, r.count * sizeof(float));
}

// ----------------------------------------------------------------------------------------------
// Collecting a distributed array on rank 0 (for --dump-state and the tests; not for big models).
//
// Every rank passes the global runs it holds and their values, in the same order; rank 0 receives
// all of them and writes each run into `global` (global_count elements). An element that several
// ranks hold must arrive with the same bits from each of them: replicas that drifted apart by one
// bit are a bug this catches (the tests rely on it).
struct GlobalRun {
    size_t global, count;
};

inline void gather_to_rank0(Comm* world, const std::vector<GlobalRun>& runs, const std::vector<float>& values,
                            std::vector<float>* global, size_t global_count, const char* what) {
    // the header of each rank's message: the number of runs and of values, then (global, count) pairs
    std::vector<double> mine = {(double)runs.size(), (double)values.size()};
    for (const GlobalRun& r : runs) {
        mine.push_back((double)r.global);
        mine.push_back((double)r.count);
    }
    if (world->rank == 0) global->assign(global_count, 0.0f);
    std::vector<uint8_t> seen(world->rank == 0 ? global_count : 0, 0);
    auto place = [&](int from, const double* table, const float* data) {
        size_t nruns = (size_t)table[0], at = 0;
        for (size_t i = 0; i < nruns; i++) {
            size_t g = (size_t)table[2 + 2 * i], n = (size_t)table[3 + 2 * i];
            if (g + n > global_count) fail("internal: %s: rank %d sent elements up to %zu of %zu", what, from, g + n, global_count);
            for (size_t k = 0; k < n; k++) {
                float v = data[at + k];
                float& dst = (*global)[g + k];
                if (seen[g + k] && memcmp(&dst, &v, sizeof(float)) != 0) {
                    fail("%s: element %zu differs between ranks that should hold identical copies (%.9g on an earlier "
                         "rank, %.9g on rank %d): the replicas drifted apart", what, g + k, dst, v, from);
                }
                dst = v;
                seen[g + k] = 1;
            }
            at += n;
        }
    };
    if (world->world_size == 1) {
        place(0, mine.data(), values.data());
        return;
    }
    comm_require_mpi(world, what);
#ifdef USE_MPI
    // two point-to-point messages per rank: the table, then the values (sizes first, so rank 0 can allocate)
    for (int from = 0; from < world->world_size; from++) {
        std::vector<CommSend> pending;
        if (world->rank == 0 && from == 0) {
            place(0, mine.data(), values.data());
        } else if (world->rank == from) {
            double sizes[2] = {(double)mine.size(), (double)values.size()};
            MPI_Request r;
            MPI_CHECK(MPI_Isend(sizes, 2, MPI_DOUBLE, 0, 1, world->handle, &r), what);
            comm_wait(world, &r, what);
            MPI_CHECK(MPI_Isend(mine.data(), (int)mine.size(), MPI_DOUBLE, 0, 2, world->handle, &r), what);
            comm_wait(world, &r, what);
            comm_send(world, values.data(), values.size(), 0, 3, &pending, what);
            comm_wait_sends(world, &pending);
        } else if (world->rank == 0) {
            double sizes[2];
            MPI_Request r;
            MPI_CHECK(MPI_Irecv(sizes, 2, MPI_DOUBLE, from, 1, world->handle, &r), what);
            comm_wait(world, &r, what);
            std::vector<double> table((size_t)sizes[0]);
            std::vector<float> data((size_t)sizes[1]);
            MPI_CHECK(MPI_Irecv(table.data(), (int)table.size(), MPI_DOUBLE, from, 2, world->handle, &r), what);
            comm_wait(world, &r, what);
            comm_recv(world, data.data(), data.size(), from, 3, what);
            place(from, table.data(), data.data());
        }
    }
#endif
}
