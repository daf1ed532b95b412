// test_process_grid.cpp — the arithmetic of the process grid, checked without MPI: which rank sits
// where and with whom (llmc/parallel/process_grid.h), which slice of the model each rank holds and where
// every local element lives in the full model, the ZeRO-2/3 units (llmc/parallel/zero.h), and the pipeline's
// communication arithmetic (its schedules: test_pipeline_schedule.cpp). The trainers' results on real grids
// are checked against one rank by test_parallelism.py; this is what they rest on.
#include <cstdio>
#include <map>
#include <string>
#include <vector>
#include "llmc/parallel/pipeline_parallel.h"
#include "llmc/parallel/process_grid.h"
#include "llmc/parallel/tensor_parallel.h"
#include "llmc/parallel/zero.h"
#include "test/checks.h"

static ProcessGrid grid_at(int dp, int tp, int pp, int rank, int zero = 0, bool sp = false) {
    ProcessGrid g;
    std::string why = make_grid(dp * tp * pp, rank, tp, pp, dp, zero, sp, &g);
    if (!why.empty()) printf("internal: %s\n", why.c_str());
    return g;
}

// Every rank has distinct coordinates, grid_rank inverts them, tensor groups are consecutive ranks,
// and each kind of group holds exactly the ranks that differ in that coordinate only.
static std::string coordinates_problem(int dp, int tp, int pp) {
    int world = dp * tp * pp;
    std::map<int, std::vector<int>> groups[3];
    for (int r = 0; r < world; r++) {
        ProcessGrid g = grid_at(dp, tp, pp, r);
        if (g.dp != dp || g.tp != tp || g.pp != pp) return strprintf("rank %d: wrong degrees", r);
        if (grid_rank(g, g.dp_rank, g.tp_rank, g.pp_rank) != r) return strprintf("rank %d: grid_rank does not invert", r);
        if (g.tp_rank != r % tp) return strprintf("rank %d: tensor ranks are not consecutive", r);
        for (int k = 0; k < 3; k++) groups[k][grid_group_color(g, (GridGroup)k)].push_back(r);
    }
    int sizes[3] = {dp, tp, pp};
    for (int k = 0; k < 3; k++) {
        if ((int)groups[k].size() != world / sizes[k]) return strprintf("group kind %d: %zu groups", k, groups[k].size());
        for (auto& [color, members] : groups[k]) {
            if ((int)members.size() != sizes[k]) return strprintf("group kind %d has a group of %zu", k, members.size());
            ProcessGrid a = grid_at(dp, tp, pp, members[0]);
            for (size_t i = 0; i < members.size(); i++) {
                ProcessGrid b = grid_at(dp, tp, pp, members[i]);
                int same = (a.dp_rank == b.dp_rank) + (a.tp_rank == b.tp_rank) + (a.pp_rank == b.pp_rank);
                int own[3] = {b.dp_rank, b.tp_rank, b.pp_rank};
                if (same < 2 || own[k] != (int)i) return strprintf("group kind %d mixes ranks %d and %d", k, members[0], members[i]);
            }
        }
    }
    return "";
}

// Over all (tp, pp) ranks of a grid: every global element is held tp times if its tensor is
// replicated, once otherwise; local runs are sorted, disjoint and inside the layout, and what they
// leave uncovered is exactly the tensor-parallel vocabulary padding; the runs point at the right
// rows and columns; and initialising a slice gives the full model's values there.
static std::string slices_problem(const GPT2Config& cfg, int tp, int pp) {
    ParamLayout global = param_layout(cfg);
    std::vector<int> held(global.total, 0);
    std::vector<float> full(global.total);
    init_gpt2_params(cfg, 5, full.data(), 0, full.size());
    std::string where = strprintf("%s tp=%d pp=%d: ", describe_config(cfg).c_str(), tp, pp);
    size_t C = cfg.channels, hs = C / cfg.num_heads;
    for (int stage = 0; stage < pp; stage++) {
        for (int t = 0; t < tp; t++) {
            ProcessGrid g = grid_at(1, tp, pp, grid_rank(grid_at(1, tp, pp, 0), 0, t, stage));
            ModelSlice s = model_slice(cfg, g);
            ParamLayout local = slice_layout(cfg, s);
            std::vector<SliceRun> runs = slice_runs(cfg, s);
            size_t covered = 0, last_end = 0;
            for (const SliceRun& r : runs) {
                if (r.local < last_end || r.local + r.count > local.total) return where + "local runs overlap or escape the slice";
                last_end = r.local + r.count;
                covered += r.count;
                for (size_t i = 0; i < r.count; i++) held[r.global + i]++;
            }
            size_t padding = s.first_stage ? (size_t)(s.vocab_rows - s.vocab_stored) * C : 0;
            if (covered + padding != local.total) return where + strprintf("runs cover %zu + padding %zu of %zu", covered, padding, local.total);
            std::vector<float> mine(local.total), initialised(local.total);
            slice_from_full(cfg, s, full.data(), mine.data());
            init_slice_params(cfg, s, 5, initialised.data());
            if (mine != initialised) return where + "initialising a slice differs from slicing the initialised model";
            // spot checks of the meaning: q rows of this rank's heads; a row of attprojw's columns; wte rows
            size_t l = s.num_layers - 1, gl = s.layer_begin + l;
            size_t q = local.offset[QKVW] + l * 3 * s.attn_channels * C + (s.attn_channels - 1) * C + 3;   // local q row Ca-1, column 3
            size_t gq = global.offset[QKVW] + gl * 3 * C * C + (s.head_begin * hs + s.attn_channels - 1) * C + 3;
            if (mine[q] != full[gq]) return where + "qkvw: local q row does not map to the head's global row";
            size_t k = local.offset[QKVW] + l * 3 * s.attn_channels * C + (s.attn_channels + 1) * C;   // k row 1, column 0
            size_t gk = global.offset[QKVW] + gl * 3 * C * C + (C + s.head_begin * hs + 1) * C;
            if (mine[k] != full[gk]) return where + "qkvw: local k row does not map to the head's global row";
            size_t a = local.offset[ATTPROJW] + l * C * s.attn_channels + 7 * s.attn_channels + 2;       // row 7, local column 2
            size_t ga = global.offset[ATTPROJW] + gl * C * C + 7 * C + s.head_begin * hs + 2;
            if (mine[a] != full[ga]) return where + "attprojw: local column does not map to the global column";
            size_t f = local.offset[FCPROJW] + l * C * s.fc_channels + 5 * s.fc_channels + 1;
            size_t gf = global.offset[FCPROJW] + gl * C * 4 * C + 5 * 4 * C + s.fc_begin + 1;
            if (mine[f] != full[gf]) return where + "fcprojw: local column does not map to the global column";
            if (s.first_stage && s.vocab_stored > 0) {
                size_t w = local.offset[WTE] + (size_t)(s.vocab_stored - 1) * C + 4;
                size_t gw = global.offset[WTE] + (size_t)(s.vocab_begin + s.vocab_stored - 1) * C + 4;
                if (mine[w] != full[gw]) return where + "wte: local row does not map to the global row";
                for (size_t i = (size_t)s.vocab_stored * C; i < (size_t)s.vocab_rows * C; i++)
                    if (mine[local.offset[WTE] + i] != 0.0f) return where + "wte: tensor-parallel padding rows are not zero";
            }
        }
    }
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        int want = tensor_is_replicated(t) ? tp : 1;
        for (size_t i = 0; i < global.count[t]; i++)
            if (held[global.offset[t] + i] != want) {
                return where + strprintf("element %zu of %s is held %d times, expected %d", i, param_tensor_name(t),
                                         held[global.offset[t] + i], want);
            }
    }
    return "";
}

// runs_in_local_range against a brute-force map of every local element.
// slice_global_index (element by element, for the GPU's bf16 rounding keys) against slice_runs (the
// checkpoints' map, which slices_problem checks against the model itself): every local element of
// every rank of a tp x pp grid (chunks > 1: interleaved 1F1B), the padding excepted.
static std::string index_map_problem(const GPT2Config& cfg, int tp, int pp, int chunks) {
    for (int r = 0; r < tp * pp; r++) {
        ModelSlice s = model_slice(cfg, grid_at(1, tp, pp, r), chunks);
        SliceIndexMap map = slice_index_map(cfg, s);
        for (const SliceRun& run : slice_runs(cfg, s))
            for (size_t i = 0; i < run.count; i++)
                if (slice_global_index(map, run.local + i) != run.global + i)
                    return strprintf("%s tp=%d pp=%d chunks=%d rank %d: local %zu maps to %llu, slice_runs says %zu",
                                     describe_config(cfg).c_str(), tp, pp, chunks, r, run.local + i,
                                     (unsigned long long)slice_global_index(map, run.local + i), run.global + i);
    }
    return "";
}

static std::string range_problem(const GPT2Config& cfg, int tp) {
    ModelSlice s = model_slice(cfg, grid_at(1, tp, 1, tp - 1));
    std::vector<SliceRun> runs = slice_runs(cfg, s);
    ParamLayout local = slice_layout(cfg, s);
    std::vector<long> to_global(local.total, -1);
    for (const SliceRun& r : runs)
        for (size_t i = 0; i < r.count; i++) to_global[r.local + i] = (long)(r.global + i);
    for (size_t begin = 0; begin < local.total; begin += 997) {
        size_t end = std::min(local.total, begin + 5003);
        std::vector<long> got(local.total, -1);
        for (const SliceRun& r : runs_in_local_range(runs, begin, end)) {
            if (r.local < begin || r.local + r.count > end) return strprintf("[%zu, %zu): a run escapes the range", begin, end);
            for (size_t i = 0; i < r.count; i++) got[r.local + i] = (long)(r.global + i);
        }
        for (size_t i = 0; i < local.total; i++) {
            long want = i >= begin && i < end ? to_global[i] : -1;
            if (got[i] != want) return strprintf("[%zu, %zu): local %zu maps to %ld, expected %ld", begin, end, i, got[i], want);
        }
    }
    return "";
}

// ZeRO units tile the slice; packing a unit and unpacking it is the identity; over the data-parallel
// ranks, the owned pieces cover every element exactly once (stage 0: every rank owns everything).
static std::string zero_problem(const GPT2Config& cfg, int tp, int dp, int stage) {
    ModelSlice s = model_slice(cfg, grid_at(dp, tp, 1, 0));
    ParamLayout layout = slice_layout(cfg, s);
    std::vector<ZeroUnit> units = model_units(layout, s.num_layers);
    std::vector<int> in_unit(layout.total, 0);
    for (const ZeroUnit& u : units)
        for (const ZeroUnitPiece& p : u.pieces)
            for (size_t i = 0; i < p.count; i++) in_unit[p.local + i]++;
    for (size_t i = 0; i < layout.total; i++)
        if (in_unit[i] != 1) return strprintf("element %zu is in %d units", i, in_unit[i]);
    std::vector<float> flat(layout.total), back(layout.total, 0.0f);
    for (size_t i = 0; i < flat.size(); i++) flat[i] = (float)i;
    for (const ZeroUnit& u : units) {
        std::vector<float> packed(u.size);
        unit_pack(u, flat.data(), packed.data(), 0, u.size);
        unit_unpack(u, packed.data(), back.data(), 0, u.size);
    }
    if (back != flat) return "unit_pack then unit_unpack is not the identity";
    std::vector<int> owned(layout.total, 0);
    for (int r = 0; r < dp; r++) {
        Comm fake;  // zero_owned_pieces only reads the group's rank and size
        fake.rank = r;
        fake.world_size = dp;
        Zero z;
        z.stage = stage;
        z.dp = &fake;
        z.grid = grid_at(dp, tp, 1, r * tp);
        z.layout = layout;
        z.units = units;
        z.shards = shard_layout(layout.total, dp);
        z.shard = shard_range(z.shards, r);
        z.updated = stage == 1 ? owned_range(z.shards, r) : ShardRange{0, layout.total};
        size_t stored = 0;
        for (ZeroUnit& u : z.units) {
            u.shards = shard_layout(u.size, dp);
            u.stored_at = stored;
            stored += u.shards.shard_size;
        }
        std::vector<int> slot(stage >= 2 ? stored : layout.total, 0);
        for (const ZeroPiece& p : zero_owned_pieces(z)) {
            if (p.local + p.count > layout.total) return "an owned piece escapes the slice";
            if (tensor_of(layout, p.local) != p.tensor || tensor_of(layout, p.local + p.count - 1) != p.tensor)
                return "an owned piece crosses a tensor boundary";
            for (size_t i = 0; i < p.count; i++) {
                owned[p.local + i]++;
                if (p.stored + i >= slot.size() || slot[p.stored + i]++) return "two owned elements share a storage slot";
            }
        }
    }
    int want = stage == 0 ? dp : 1;
    for (size_t i = 0; i < layout.total; i++)
        if (owned[i] != want) return strprintf("element %zu owned %d times, expected %d", i, owned[i], want);
    return "";
}

int main() {
    // ---- the grid
    std::string bad;
    for (int dp = 1; dp <= 3 && bad.empty(); dp++)
        for (int tp = 1; tp <= 4 && bad.empty(); tp++)
            for (int pp = 1; pp <= 3 && bad.empty(); pp++) bad = coordinates_problem(dp, tp, pp);
    check(bad.empty(), "grid: every rank's coordinates are distinct, tensor ranks consecutive, groups exact (36 grids)", bad);
    ProcessGrid g;
    std::string why = make_grid(6, 0, 4, 1, 0, 0, false, &g);
    check(why.find("multiple of tp x pp = 4") != std::string::npos, "grid: 6 ranks cannot hold tensor groups of 4", why);
    why = make_grid(8, 0, 2, 2, 4, 0, false, &g);
    check(why.find("does not match the launch") != std::string::npos, "grid: --data-parallel must agree with the launch", why);
    ProcessGrid eight = grid_at(2, 2, 2, 5);
    check(eight.dp_rank == 0 && eight.tp_rank == 1 && eight.pp_rank == 1,
          "grid: rank 5 of dp2 x tp2 x pp2 is (dp 0, tp 1, pp 1), Megatron's order", "");

    // ---- impossible grids for a model, with reasons
    GPT2Config cfg;
    parse_model_descriptor("L=5,C=48,H=6,T=32,V=501", &cfg);
    struct Case { int dp, tp, pp, zero; bool sp; int B, T, m; const char* expect; };
    Case cases[] = {
        {1, 4, 1, 0, false, 1, 32, 1, "does not divide the 6 attention heads"},
        {1, 1, 6, 0, false, 1, 32, 8, "exceeds the 5 layers"},
        {1, 1, 3, 0, false, 1, 32, 2, "cannot fill a pipeline of 3 stages"},
        {2, 1, 2, 2, false, 1, 32, 4, "use --zero 1 with pipelines"},
        {2, 1, 2, 3, false, 1, 32, 4, "use --zero 1 with pipelines"},
        {1, 1, 1, 0, true, 1, 32, 1, "--sequence-parallel needs --tensor-parallel"},
        {1, 3, 1, 0, true, 1, 32, 1, "3 does not divide it"},
        {2, 3, 1, 3, true, 1, 33, 1, ""},
        {1, 2, 5, 1, true, 2, 16, 5, ""},
    };
    for (const Case& c : cases) {
        ProcessGrid cg = grid_at(c.dp, c.tp, c.pp, 0, c.zero, c.sp);
        std::string got = grid_problem(cg, cfg, c.B, c.T, c.m);
        bool ok = std::string(c.expect).empty() ? got.empty() : got.find(c.expect) != std::string::npos;
        check(ok, strprintf("grid check: dp%d tp%d pp%d ZeRO-%d%s B*T=%d m=%d: %s", c.dp, c.tp, c.pp, c.zero, c.sp ? " sp" : "",
                            c.B * c.T, c.m, *c.expect ? c.expect : "allowed"), "got: '" + got + "'");
    }

    // ---- slices
    int layers_begin[3], layers_count[3];
    for (int s = 0; s < 3; s++) stage_layers(5, 3, s, &layers_begin[s], &layers_count[s]);
    check(layers_begin[0] == 0 && layers_count[0] == 2 && layers_begin[1] == 2 && layers_count[1] == 2 && layers_begin[2] == 4 &&
          layers_count[2] == 1, "pipeline stages: 5 layers over 3 stages are 2, 2, 1", "");
    ModelSlice v3 = model_slice(cfg, grid_at(1, 3, 1, 2));
    check(v3.vocab_rows == 176 && v3.vocab_begin == 352 && v3.vocab_stored == 160 && v3.vocab_real == 149,
          "vocabulary over 3 tensor ranks: Vp=512 -> 176 rows each (171 rounded up to 8); the last holds rows 352..511 "
          "and 16 rows of padding, 149 real tokens (V=501)", strprintf("rows %d begin %d stored %d real %d", v3.vocab_rows, v3.vocab_begin, v3.vocab_stored, v3.vocab_real));
    ModelSlice v2 = model_slice(cfg, grid_at(1, 2, 1, 1));
    check(v2.vocab_rows == 256 && v2.vocab_stored == 256 && v2.vocab_real == 245,
          "vocabulary over 2 tensor ranks: V=501 is odd, Vp=512 splits evenly; rank 1 has 245 real rows and 11 masked", "");
    ParamLayout one = slice_layout(cfg, full_model_slice(cfg)), full = param_layout(cfg);
    check(one.total == full.total && one.offset == full.offset && slice_runs(cfg, full_model_slice(cfg)).size() == 1,
          "one rank: the slice is the whole model, one run, the global layout", "");
    bad = "";
    for (int tp : {1, 2, 3, 6})
        for (int pp : {1, 2, 3, 5})
            if (bad.empty()) bad = slices_problem(cfg, tp, pp);
    check(bad.empty(), "slices: replicated tensors held tp times, split ones once; runs map rows, columns and heads right; "
                       "initialising a slice == slicing the model (16 grids)", bad);
    bad = range_problem(cfg, 3);
    if (bad.empty()) bad = range_problem(cfg, 2);
    check(bad.empty(), "runs_in_local_range matches a brute-force map of every local element", bad);
    bad = "";
    for (int tp : {1, 2, 3, 6})
        for (int pp : {1, 2, 3, 5})
            if (bad.empty()) bad = index_map_problem(cfg, tp, pp, 1);
    GPT2Config even;  // interleaved 1F1B: L a multiple of pp x chunks
    parse_model_descriptor("L=8,C=48,H=6,T=32,V=501", &even);
    if (bad.empty()) bad = index_map_problem(even, 2, 2, 2);
    if (bad.empty()) bad = index_map_problem(even, 1, 2, 4);
    check(bad.empty(), "slice_global_index (the bf16 moments' rounding key) == slice_runs for every element of every rank "
                       "(16 grids, uneven stages, vocab over 3 and 6 ranks, interleaved chunks)", bad);

    // ---- ZeRO units and ownership
    bad = "";
    for (int tp : {1, 3})
        for (int dp : {1, 2, 3, 5})
            for (int stage = 0; stage <= 3 && bad.empty(); stage++) {
                bad = zero_problem(cfg, tp, dp, stage);
                if (!bad.empty()) bad = strprintf("tp %d dp %d ZeRO-%d: ", tp, dp, stage) + bad;
            }
    check(bad.empty(), "ZeRO: units tile the slice, pack/unpack round-trips, every element owned once (stage 0: by every rank)", bad);
    {
        ModelSlice s = full_model_slice(cfg);
        ParamLayout layout = slice_layout(cfg, s);
        std::vector<ZeroUnit> units = model_units(layout, s.num_layers);
        size_t shards = 0;
        for (const ZeroUnit& u : units) shards += shard_layout(u.size, 4).shard_size;
        ZeroMemory z3 = zero_memory(3, units, layout.total, 4, 0), z0 = zero_memory(0, units, layout.total, 4, 0);
        check(z3.params == shards && z3.grads == 0 && z3.grad_shard == shards && z3.optimizer == 2 * shards &&
              shards * 4 < layout.total + 4 * 64 * units.size() && z0.optimizer == 2 * layout.total,
              "ZeRO-3 on 4 ranks keeps about 1/4 of weights, gradients and AdamW state", "");
        check(units.size() == (size_t)cfg.num_layers + 1 && units.back().pieces.size() == 4 && units[0].pieces.size() == 12 &&
              units[0].pieces[0].local == layout.offset[LN1W] + (size_t)(cfg.num_layers - 1) * cfg.channels,
              "ZeRO units are llmc/parallel/sharding.h's gradient buckets: layer L-1 first, the ends (wte, wpe, lnf) last", "");
    }

    // (the pipeline schedules: test_pipeline_schedule.cpp)

    // ---- communication arithmetic
    check(tp_comm_bytes(1, false, 64, 48, 5, true, true, 4, 0) == 0 && pipe_comm_bytes(0, 1, 4, 100, 10) == 0 &&
          zero_comm_bytes(1, {}, 1000, 1, 1) == 0, "one rank in a group sends nothing", "");
    uint64_t tp_bytes = tp_comm_bytes(2, false, 64, 48, 1, false, false, 1, 0);   // one layer in the middle of a pipeline
    check(tp_bytes == 4 * 2 * (64 * 48 / 2) * 4, "tensor parallelism, t=2, one layer: 2 all-reduces forward and 2 backward of "
          "B*T*C (each a reduce-scatter and an all-gather of half of it)",
          strprintf("%llu bytes", (unsigned long long)tp_bytes));
    uint64_t sp_bytes = tp_comm_bytes(2, true, 64, 48, 1, false, false, 1, 0) - tp_comm_bytes(2, true, 64, 48, 0, false, false, 1, 0);
    check(sp_bytes == 10 * (64 * 48 / 2) * 4 + 2 * (4 * 48 / 2) * 4, "sequence parallelism, t=2, one layer: 10 reduce-scatters or "
          "all-gathers of B*T*C (4 forward, 6 backward) and the all-reduce of its 4 LayerNorm gradients",
          strprintf("%llu bytes", (unsigned long long)sp_bytes));
    return check_exit_code();
}
