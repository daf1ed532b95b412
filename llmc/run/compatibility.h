// compatibility.h — which techniques combine: one table, read by the flag checks, by --estimate and by
// --plan alike, so that each refuses exactly what training refuses.
//
// Most techniques of this trainer combine freely: ZeRO with tensor parallelism, PowerSGD with
// Adafactor, fp8 with sequence parallelism. Some pairs are not built, or not proven, together: the
// 2BW schedule keeps two versions of a stage's whole weights, so it cannot run on a ZeRO-2 shard;
// Adafactor's row and column statistics need whole matrices, which ZeRO-2 cuts by flat ranges. Each
// such pair is one row below, with the one line the user reads and the way out. A pair that has no
// row is allowed. Lifting a refusal is deleting its row (and the test's census line); adding one is
// a row here, nowhere else (docs/adding-a-technique.md).
//
// A row is checked at one of two moments:
//   Flags  from the flags, the trainer and the build alone: before anything starts (both mains, right
//          after validate_options), so --estimate, --plan and --generate refuse them too;
//   Shape  once the model's shape and the grid are known: the trainer after it read the model and
//          formed the grid; --estimate with the grid the flags describe (--estimate-ranks x
//          --tensor-parallel x --pipeline-parallel ranks); --plan with each grid it ranks.
// Within a moment the rows are checked top to bottom and the first refusal is the run's one line
// (exit 2), so the order of the rows is the order in which the trainers have always checked them.
// What only a live run can know (the GPU's compute capability, ranks sharing a GPU, free memory, a
// data shard's length, a model file's own MoE settings) stays with the trainer that finds it out.
#pragma once

#include <string>
#include <vector>
#include "llmc/model/model.h"                    // GPT2Config, moe_layout
#ifdef __NVCC__
#pragma nv_diag_suppress 1675  // (the CPU layer's loops carry GCC pragmas, which nvcc does not know)
#endif
#include "llmc/model/moe.h"                      // moe_shape_problem
#include "llmc/run/moe_run.h"                    // moe_run_shape
#ifdef __NVCC__
#pragma nv_diag_default 1675
#endif
#include "llmc/parallel/grad_compression.h"      // grad_compression_problem
#include "llmc/parallel/parameter_server.h"      // parameter_server_problem
#include "llmc/parallel/pipeline_schedule.h"     // pipeline_schedule_problem
#include "llmc/parallel/process_grid.h"          // make_grid, grid_problem
#include "llmc/probes/grad_compression_probe.h"  // the tests' every-matrix switch
#include "llmc/run/cli.h"
#include "llmc/run/plan.h"                       // plan_run
#include "llmc/utils.h"

enum class CompatMoment { Flags, Shape };
constexpr int ON_CPU = 1, ON_GPU = 2, ON_BOTH = 3;  // which trainer a row refuses in

// The GPU router keeps a token's expert scores in registers: MOE_MAX_EXPERTS of llmc/kernels/moe.cuh,
// which asserts that it is this number.
constexpr int MOE_GPU_MAX_EXPERTS = 64;

// What a row may look at. Flags rows read o, trainer and build; Shape rows also the model and grid.
struct CompatRun {
    const TrainOptions* o = nullptr;
    Trainer trainer = Trainer::CPU;
    const char* build = "fp32";  // the GPU binary's type: bf16, fp16 or fp32 (the CPU trainer: fp32)
    GPT2Config cfg;              // (Shape rows)
    ProcessGrid grid;            // (Shape rows) world = dp x tp x pp ranks
    int B = 0, T = 0, micro_batches = 0;
};

struct CompatRow {
    const char* a;        // a technique (its flag)
    const char* b;        // what it does not combine with: a technique, a trainer, a build, the shape
    int trainers;         // ON_CPU, ON_GPU or ON_BOTH
    CompatMoment moment;
    const char* example;  // flags that meet the row at the smallest shape (test/test_compatibility.cpp runs them)
    std::string (*refuse)(const CompatRun& r);  // "" when the row does not apply, else its one line
};

// ---- The techniques, each with the run it is checked against -------------------------------------
// test/test_compatibility.cpp walks every pair of these through the rows below; test/test_combination_walk.py
// runs every pair the rows allow against the pair's reference: the pair with the more exact technique
// replaced by its reference. A technique's reference is the run it must reproduce:
//   bits   to the bit (a schedule changes when, not what; recompute rebuilds the same rows, level 2 those of
//          level 1: the GPU's level 0 runs GELU in cuBLASLt's epilogues, other bits; an offload
//          moves the same arithmetic elsewhere; a graph replays the same kernels)
//   grid   within the grid's tolerance (the same arithmetic, its sums in another order: ranks, slices)
//   a tolerance's name (bf16, fp8, ...): a narrower number format, within its own test's bounds
//   cpu/gpu  two of the above, the CPU trainer's then the GPU's (the GPU's interleaved schedule sums its
//          losses in another order than 1F1B's)
//   own    none: it defines the arithmetic (another optimizer, another model, a low-rank sum), so it stays
//          in the pair's reference. Two own techniques together have no reference: the row "own x own" refuses
//          them (but MoE with a factored optimizer, which test_moe_trainer.py checks against its own statistics).
// `flags` run it at the walk's smallest shape ("--estimate-ranks N": N data-parallel ranks; "@fp16": the GPU
// binary of that build); `reference` replaces them ("" = drop them; "@cpu": the CPU trainer's run); `loosens`:
// a bits technique that this one, kept, makes agree only within its own tolerance (a stash rounds what
// --recompute 2 rebuilds in fp32, test_stash_precision.py).
struct CompatTechnique {
    const char* name;
    const char* flags;
    const char* reference;
    const char* exact;  // bits | grid | a tolerance's name | own | cpu/gpu
    const char* loosens = "";
};

inline const std::vector<CompatTechnique>& compat_techniques() {
    static const std::vector<CompatTechnique> techniques = {
        // name                 flags                                                   reference                                           exact
        {"zero-1",              "--zero 1 --estimate-ranks 2",                          "--estimate-ranks 2",                               "bits"},
        {"zero-2",              "--zero 2 --estimate-ranks 2",                          "",                                                 "grid"},
        {"zero-3",              "--zero 3 --estimate-ranks 2",                          "--zero 2 --estimate-ranks 2",                      "bits"},
        {"tensor-parallel",     "--tensor-parallel 2",                                  "",                                                 "grid"},
        {"sequence-parallel",   "--tensor-parallel 2 --sequence-parallel 1",            "--tensor-parallel 2",                              "grid"},
        {"pipeline-parallel",   "--pipeline-parallel 2",                                "",                                                 "grid"},
        {"interleaved",         "--pipeline-parallel 2 --pipeline-schedule interleaved --virtual-stages 2", "--pipeline-parallel 2",       "bits/grid"},
        {"zb-h1",               "--pipeline-parallel 2 --pipeline-schedule zb-h1",      "--pipeline-parallel 2",                            "bits"},
        {"2bw",                 "--pipeline-parallel 2 --pipeline-schedule 2bw",        "--pipeline-parallel 2 --pipeline-schedule 2bw-flush", "bits"},
        {"2bw-flush",           "--pipeline-parallel 2 --pipeline-schedule 2bw-flush",  "--pipeline-schedule 2bw-flush",                    "grid"},
        {"moe",                 "--moe-experts 2 --moe-top-k 2",                        "",                                                 "own"},
        {"expert-parallel",     "--moe-experts 2 --moe-top-k 2 --expert-parallel 2 --estimate-ranks 2", "--moe-experts 2 --moe-top-k 2",    "grid"},
        {"adafactor",           "--optimizer adafactor",                                "",                                                 "own"},
        {"sm3",                 "--optimizer sm3",                                      "",                                                 "own"},
        {"bf16-moments",        "--optimizer-state bf16",                               "",                                                 "own"},
        {"offload-optimizer",   "--offload optimizer",                                  "",                                                 "bits"},
        {"offload-dir",         "--offload-dir off",                                    "",                                                 "bits"},
        {"bf16-compression",    "--grad-compression bf16 --estimate-ranks 2",           "--estimate-ranks 2",                               "bf16-sum"},
        {"powersgd",            "--grad-compression powersgd --estimate-ranks 2",       "",                                                 "own"},
        {"server",              "--data-parallel server --estimate-ranks 2",            "--estimate-ranks 2",                               "bits"},
        {"cuda-graphs",         "--cuda-graphs",                                        "",                                                 "bits"},
        {"fp8",                 "--precision fp8",                                      "@cpu",                                               "fp8"},
        {"stash-bf16",          "--stash-precision bf16",                               "",                                                 "bf16-stash", "recompute"},
        {"stash-fp8",           "--stash-precision fp8",                                "",                                                 "fp8-stash", "recompute"},
        {"recompute",           "--recompute 2",                                        "--recompute 1",                                    "bits"},
        {"master-weights-0",    "--master-weights 0",                                   "@cpu",                                               "bf16"},
        {"fp16-build",          "@fp16",                                                "@cpu",                                             "fp16"},
        {"fp32-build",          "@fp32",                                                "@cpu",                                             "fp32"},
    };
    return techniques;
}

// Which own techniques (above) a run has on: two of them have no reference to be checked against.
inline std::vector<std::string> compat_own_techniques(const TrainOptions& o) {
    std::vector<std::string> on;
    if (o.moe_experts > 0) on.push_back("--moe-experts");
    if (o.optimizer != "adamw") on.push_back("--optimizer " + o.optimizer);
    if (o.optimizer_state == "bf16") on.push_back("--optimizer-state bf16");
    if (o.grad_compression == "powersgd") on.push_back("--grad-compression powersgd");
    return on;
}

inline bool compat_fp16(const CompatRun& r) { return std::string(r.build) == "fp16"; }
inline bool compat_2bw(const TrainOptions& o) { return o.pipeline_schedule.rfind("2bw", 0) == 0; }
inline bool compat_factored(const TrainOptions& o) { return o.optimizer != "adamw"; }

// The MoE layer's own settings (cpu::moe_shape_problem), plus the limits of the GPU's kernels
// (llmc/kernels/moe.cuh: the router's registers, 16-byte vectors).
inline std::string moe_gpu_kernels_problem(const cpu::MoEShape& s, int C) {
    std::string why = cpu::moe_shape_problem(s);
    if (!why.empty()) return why;
    if (s.experts > MOE_GPU_MAX_EXPERTS)
        return strprintf("--moe-experts %d: the GPU router holds at most %d experts per token; use fewer", s.experts,
                         MOE_GPU_MAX_EXPERTS);
    if (C % 8 != 0) return strprintf("the model's C = %d: the MoE kernels move 16-byte vectors and need C %% 8 == 0", C);
    return "";
}

inline std::string compat_interleaving_problem(const CompatRun& r) {
    PipelineSchedule kind = PipelineSchedule::OneFOneB;
    parse_pipeline_schedule(r.o->pipeline_schedule, &kind);
    return pipeline_schedule_problem(kind, r.grid.pp, r.micro_batches, r.o->virtual_stages, r.cfg.num_layers);
}

// The table. (Each row's lambda holds no state, so it is a plain function; R is its argument's type.)
inline const std::vector<CompatRow>& compatibility_table() {
    using R = const CompatRun&;
    static const std::vector<CompatRow> rows = {
    // ---- Flags: the trainer and the flags' own pairs -------------------------------------------
    {"--data-parallel server", "the GPU trainer", ON_GPU, CompatMoment::Flags, "--data-parallel server", [](R r) -> std::string {
        if (r.o->data_parallel != "server") return "";
        return "--data-parallel server runs only on the CPU trainer (train_gpt_cpu): it is a lesson in traffic through one "
               "rank; on GPUs NCCL's all-reduce is the way, --data-parallel allreduce"; }},
    {"--stash-precision fp8", "the CPU trainer", ON_CPU, CompatMoment::Flags, "--stash-precision fp8", [](R r) -> std::string {
        if (r.o->stash_precision != "fp8") return "";
        return "--stash-precision fp8 is the GPU trainer's stash (e4m3 with a per-tensor scale); train_gpt_cpu keeps fp32 "
               "or bf16: use --stash-precision bf16"; }},
    {"--stash-precision bf16", "the GPU trainer", ON_GPU, CompatMoment::Flags, "--stash-precision bf16", [](R r) -> std::string {
        if (r.o->stash_precision != "bf16") return "";
        return "--stash-precision bf16: the GPU trainer's activations are already its build's type (bf16 in ./train_gpt); "
               "its narrower stash is --stash-precision fp8"; }},
    {"--stash-precision fp8", "--moe-experts", ON_GPU, CompatMoment::Flags, "--stash-precision fp8 --moe-experts 2", [](R r) -> std::string {
        if (r.o->stash_precision != "fp8" || r.o->moe_experts == 0) return "";
        return "--stash-precision fp8 with --moe-experts: the MoE blocks keep their own activations, not stashed in fp8 "
               "yet; drop one of the two"; }},
    {"--stash-precision fp8", "--precision fp8", ON_GPU, CompatMoment::Flags, "--stash-precision fp8 --precision fp8", [](R r) -> std::string {
        if (r.o->stash_precision != "fp8" || r.o->precision != "fp8") return "";
        return "--stash-precision fp8 with --precision fp8: the two fp8 paths are not checked together yet; drop one of "
               "the two"; }},
    {"--optimizer-state bf16", "--optimizer adafactor|sm3", ON_BOTH, CompatMoment::Flags, "--optimizer-state bf16 --optimizer sm3", [](R r) -> std::string {
        if (r.o->optimizer_state != "bf16" || !compat_factored(*r.o)) return "";
        return strprintf("--optimizer-state bf16 stores AdamW's m and v; --optimizer %s keeps only row and column statistics, "
                         "in fp32: drop --optimizer-state", r.o->optimizer.c_str()); }},
    {"--optimizer adafactor|sm3", "--zero 2|3", ON_BOTH, CompatMoment::Flags, "--optimizer adafactor --zero 2 --estimate-ranks 2", [](R r) -> std::string {
        if (!compat_factored(*r.o) || r.o->zero_stage < 2) return "";  // ZeRO-1 gives each rank whole matrices (llmc/optim/factored_sharding.h)
        const char* name = r.o->optimizer.c_str();
        return strprintf("--optimizer %s with --zero %d: ZeRO-2/3 shard gradients by flat ranges, which would cut %s's whole-"
                         "matrix row and column statistics; use --zero 1 (each rank owns whole matrices) or --zero 0", name,
                         r.o->zero_stage, name); }},
    {"--optimizer adafactor|sm3", "--pipeline-parallel", ON_BOTH, CompatMoment::Flags, "--optimizer adafactor --pipeline-parallel 2", [](R r) -> std::string {
        if (!compat_factored(*r.o) || r.o->pipeline_parallel < 2) return "";
        return strprintf("--optimizer %s with --pipeline-parallel %d: its state is not split over pipeline stages yet; use "
                         "data or tensor parallelism, or --optimizer adamw", r.o->optimizer.c_str(), r.o->pipeline_parallel); }},
    {"--optimizer adafactor|sm3", "--tensor-parallel with --zero 1", ON_BOTH, CompatMoment::Flags,
     "--optimizer adafactor --tensor-parallel 2 --zero 1 --estimate-ranks 2", [](R r) -> std::string {
        if (!compat_factored(*r.o) || r.o->tensor_parallel < 2 || r.o->zero_stage != 1) return "";  // (a TP rank's blocks differ in size: wte's last rows)
        return strprintf("--optimizer %s with --tensor-parallel %d --zero 1: ZeRO-1's whole-block cut is not built over "
                         "tensor slices yet; use --zero 0 with --tensor-parallel", r.o->optimizer.c_str(), r.o->tensor_parallel); }},
    {"--stash-precision fp8", "--pipeline-schedule zb-h1", ON_GPU, CompatMoment::Flags,
     "--stash-precision fp8 --pipeline-parallel 2 --pipeline-schedule zb-h1", [](R r) -> std::string {
        if (r.o->stash_precision != "fp8" || r.o->pipeline_parallel < 2 || r.o->pipeline_schedule != "zb-h1") return "";
        return "--stash-precision fp8 with --pipeline-schedule zb-h1: the GPU's deferred weight pass reads its inputs in "
               "place, not from the fp8 stash yet; use another schedule, or --stash-precision fp32"; }},
    {"--offload-dir", "--optimizer adafactor|sm3", ON_CPU, CompatMoment::Flags, "--offload-dir off --optimizer sm3", [](R r) -> std::string {
        if (r.o->offload_dir.empty() || !compat_factored(*r.o)) return "";
        return strprintf("--offload-dir streams AdamW's m and v; --optimizer %s keeps only row and column statistics (well "
                         "under 1 byte per parameter), which stay in RAM: drop --offload-dir", r.o->optimizer.c_str()); }},
    {"--offload-dir", "--zero 2|3, tensor or pipeline parallelism", ON_CPU, CompatMoment::Flags,
     "--offload-dir off --tensor-parallel 2", [](R r) -> std::string {
        const TrainOptions& o = *r.o;
        if (o.offload_dir.empty() || (o.zero_stage < 2 && o.tensor_parallel < 2 && o.pipeline_parallel < 2)) return "";
        return strprintf("--offload-dir with --zero %d --tensor-parallel %d --pipeline-parallel %d: the disk offload is built "
                         "for data parallelism with --zero 0 or 1; drop --offload-dir or the other flags", o.zero_stage,
                         o.tensor_parallel, o.pipeline_parallel); }},
    {"--moe-experts", "tensor or pipeline parallelism", ON_BOTH, CompatMoment::Flags, "--moe-experts 2 --tensor-parallel 2", [](R r) -> std::string {
        if (r.o->moe_experts == 0 || (r.o->tensor_parallel < 2 && r.o->pipeline_parallel < 2)) return "";
        return strprintf("--moe-experts with --tensor-parallel %d --pipeline-parallel %d: MoE blocks are not split across "
                         "model-parallel ranks yet; train MoE with data parallelism only (--expert-parallel splits the experts "
                         "over its ranks)", r.o->tensor_parallel, r.o->pipeline_parallel); }},
    {"--moe-experts", "--zero 3", ON_BOTH, CompatMoment::Flags, "--moe-experts 2 --zero 3 --estimate-ranks 2", [](R r) -> std::string {
        if (r.o->moe_experts == 0 || r.o->zero_stage < 3) return "";
        return strprintf("--moe-experts with --zero %d: the MoE table's weights are not sharded (ZeRO-3) yet; use --zero 1 or "
                         "2 (the table's moments sharded), or 0", r.o->zero_stage); }},
    {"--moe-experts --expert-parallel", "--optimizer adafactor|sm3", ON_BOTH, CompatMoment::Flags,
     "--moe-experts 2 --expert-parallel 2 --optimizer sm3 --estimate-ranks 2", [](R r) -> std::string {
        // (--zero 1: the table's statistics stay whole on every rank)
        if (r.o->moe_experts == 0 || !compat_factored(*r.o) || r.o->expert_parallel < 2) return "";
        return strprintf("--moe-experts with --optimizer %s and --expert-parallel %d: its statistics of the MoE table are kept "
                         "whole on every rank (moe_state.bin gathers no expert's from another rank yet); use --expert-parallel 1 "
                         "with it, or --optimizer adamw", r.o->optimizer.c_str(), r.o->expert_parallel); }},
    {"--moe-experts", "--grad-compression powersgd", ON_BOTH, CompatMoment::Flags,
     "--moe-experts 2 --grad-compression powersgd --estimate-ranks 2", [](R r) -> std::string {
        if (r.o->moe_experts == 0 || r.o->grad_compression == "none" || r.o->grad_compression == "bf16") return "";
        return strprintf("--moe-experts with --grad-compression %s: the MoE table's gradients are not compressed that way yet; "
                         "use --grad-compression bf16 or none", r.o->grad_compression.c_str()); }},
    // --offload optimizer (llmc/optim/offload.cuh) holds AdamW's fp32 master weights of a bf16 build, updated over the
    // flat array or its shards (ZeRO-0/1/2) of a model held whole (no tensor or pipeline slices)
    {"--offload optimizer", "the fp32 build", ON_GPU, CompatMoment::Flags, "--offload optimizer @fp32", [](R r) -> std::string {
        if (r.o->offload != "optimizer" || std::string(r.build) != "fp32") return "";
        return "--offload optimizer moves fp32 master weights off a bf16 GPU: the fp32 build has none; use train_gpt"; }},
    {"--offload optimizer", "the fp16 build", ON_GPU, CompatMoment::Flags, "--offload optimizer @fp16", [](R r) -> std::string {
        if (r.o->offload != "optimizer" || !compat_fp16(r)) return "";
        return "--offload optimizer is bf16-only for now (its host copies round to bf16): use train_gpt"; }},
    {"--offload optimizer", "--master-weights 0", ON_GPU, CompatMoment::Flags, "--offload optimizer --master-weights 0", [](R r) -> std::string {
        if (r.o->offload != "optimizer" || r.o->master_weights == 1) return "";
        return "--offload optimizer keeps the fp32 master weights on the host: drop --master-weights 0"; }},
    {"--offload optimizer", "--zero 3", ON_GPU, CompatMoment::Flags, "--offload optimizer --zero 3 --estimate-ranks 2", [](R r) -> std::string {
        if (r.o->offload != "optimizer" || r.o->zero_stage < 3) return "";
        return strprintf("--offload optimizer with --zero %d is not supported yet: use --zero 0, 1 or 2", r.o->zero_stage); }},
    {"--offload optimizer", "tensor or pipeline parallelism", ON_GPU, CompatMoment::Flags, "--offload optimizer --pipeline-parallel 2", [](R r) -> std::string {
        if (r.o->offload != "optimizer" || (r.o->tensor_parallel < 2 && r.o->pipeline_parallel < 2)) return "";
        return "--offload optimizer with tensor or pipeline parallelism is not supported yet: use data parallelism (--zero 0|1)"; }},
    // ZB-H1's deferred W reads whole rows (llmc/model/zero_bubble_backward.h); tensor and sequence parallelism would
    // gather them again (not written yet). One stage has no W: zb-h1 there is gradient accumulation, any grid.
    {"--pipeline-schedule zb-h1", "--tensor-parallel", ON_BOTH, CompatMoment::Flags,
     "--pipeline-schedule zb-h1 --pipeline-parallel 2 --tensor-parallel 2", [](R r) -> std::string {
        if (r.o->pipeline_schedule != "zb-h1" || r.o->pipeline_parallel < 2 || r.o->tensor_parallel < 2) return "";
        return "--pipeline-schedule zb-h1 with --tensor-parallel is not supported yet (its deferred weight gradients read "
               "whole rows): use --tensor-parallel 1, or --pipeline-schedule 1f1b"; }},
    // PipeDream-2BW (llmc/parallel/pipedream_2bw.h), with and without the flush
    {"--pipeline-schedule 2bw", "--zero 2|3", ON_BOTH, CompatMoment::Flags, "--pipeline-schedule 2bw --zero 2 --estimate-ranks 2", [](R r) -> std::string {
        if (!compat_2bw(*r.o) || r.o->zero_stage < 2) return "";
        return strprintf("--pipeline-schedule 2bw with --zero %d is not supported: ZeRO-%d keeps only a shard of the gradients "
                         "(and ZeRO-3 of the weights), and the older weight version is the whole stage's; use --zero 0 or 1",
                         r.o->zero_stage, r.o->zero_stage); }},
    {"--pipeline-schedule 2bw", "--tensor-parallel", ON_BOTH, CompatMoment::Flags, "--pipeline-schedule 2bw --tensor-parallel 2", [](R r) -> std::string {
        if (!compat_2bw(*r.o) || r.o->tensor_parallel < 2) return "";
        return "--pipeline-schedule 2bw with --tensor-parallel is not supported yet (not tested); use --tensor-parallel 1, or "
               "--pipeline-schedule 1f1b"; }},
    {"--pipeline-schedule 2bw", "--moe-experts", ON_BOTH, CompatMoment::Flags, "--pipeline-schedule 2bw --moe-experts 2", [](R r) -> std::string {
        if (!compat_2bw(*r.o) || r.o->moe_experts == 0) return "";
        return "--pipeline-schedule 2bw with --moe-experts is not supported (the MoE table is not versioned); drop --moe-experts"; }},
    {"--pipeline-schedule 2bw", "--cuda-graphs", ON_GPU, CompatMoment::Flags, "--pipeline-schedule 2bw-flush --cuda-graphs", [](R r) -> std::string {
        if (!compat_2bw(*r.o) || !r.o->cuda_graphs) return "";
        return strprintf("--pipeline-schedule %s with --cuda-graphs: the graphed step swaps no weight versions; drop "
                         "--cuda-graphs", r.o->pipeline_schedule.c_str()); }},
    {"--pipeline-schedule 2bw", "--offload optimizer", ON_GPU, CompatMoment::Flags, "--pipeline-schedule 2bw --offload optimizer", [](R r) -> std::string {
        if (!compat_2bw(*r.o) || r.o->offload != "optimizer") return "";
        return strprintf("--pipeline-schedule %s with --offload optimizer is not supported yet (not tested); drop --offload",
                         r.o->pipeline_schedule.c_str()); }},
    // fp8's scales come from the amax the step's forwards record: run ahead into the previous step, the first forwards
    // of a step would record theirs in that step's history (not tested either)
    {"--pipeline-schedule 2bw", "--precision fp8", ON_GPU, CompatMoment::Flags, "--pipeline-schedule 2bw --precision fp8", [](R r) -> std::string {
        if (r.o->pipeline_schedule != "2bw" || r.o->precision != "fp8") return "";
        return "--pipeline-schedule 2bw with --precision fp8 is not supported yet (the forwards run ahead would record "
               "their amax in the previous step's history); use --pipeline-schedule 2bw-flush"; }},
    // the CPU's MoE layer (llmc/model/moe.h): its own settings first, then what its trainer does not do yet
    {"--moe-experts", "its own --moe-* settings", ON_CPU, CompatMoment::Flags, "--moe-experts 1 --moe-top-k 2", [](R r) -> std::string {
        return r.o->moe_experts > 0 ? cpu::moe_shape_problem(moe_run_shape(*r.o)) : ""; }},
    {"--moe-experts", "--optimizer-state bf16", ON_CPU, CompatMoment::Flags, "--moe-experts 2 --optimizer-state bf16", [](R r) -> std::string {
        if (r.o->moe_experts == 0 || r.o->optimizer_state != "bf16") return "";
        return "--moe-experts with --optimizer-state bf16: the MoE table's moments are fp32; use --optimizer-state fp32"; }},
    {"--moe-experts", "--data-parallel server", ON_CPU, CompatMoment::Flags, "--moe-experts 2 --data-parallel server", [](R r) -> std::string {
        if (r.o->moe_experts == 0 || r.o->data_parallel != "server") return "";
        return "--moe-experts with --data-parallel server: the server sums the dense table only; use --data-parallel allreduce"; }},
    {"--moe-experts", "--offload-dir", ON_CPU, CompatMoment::Flags, "--moe-experts 2 --offload-dir off", [](R r) -> std::string {
        if (r.o->moe_experts == 0 || r.o->offload_dir.empty()) return "";
        return "--moe-experts with --offload-dir: the disk holds the dense table's moments only; drop --offload-dir"; }},
    // --precision fp8: a run-time choice of the bf16 build (llmc/kernels/fp8.cuh), around whose bf16 activations it quantizes
    {"--precision fp8", "the CPU trainer", ON_CPU, CompatMoment::Flags, "--precision fp8", [](R r) -> std::string {
        if (r.o->precision != "fp8") return "";
        return "--precision fp8: the CPU trainer computes in fp32 only; fp8 matmuls are the GPU trainer's "
               "(./train_gpt --precision fp8), or drop --precision"; }},
    {"--precision fp8", "the fp16 and fp32 builds", ON_GPU, CompatMoment::Flags, "--precision fp8 @fp32", [](R r) -> std::string {
        if (r.o->precision != "fp8" || std::string(r.build) == "bf16") return "";
        return "--precision fp8 is an option of the bf16 build, around whose bf16 activations it quantizes: run "
               "./train_gpt --precision fp8, or drop --precision"; }},

    // (the walk's reference, the CPU trainer within BF16_TOL, does not hold: Adafactor's and SM3's steps are under a bf16
    // weight's rounding, which decides them without fp32 master weights; no test bounds it)
    {"--optimizer adafactor|sm3", "--master-weights 0", ON_GPU, CompatMoment::Flags, "--optimizer sm3 --master-weights 0", [](R r) -> std::string {
        if (!compat_factored(*r.o) || r.o->master_weights != 0) return "";
        return strprintf("--optimizer %s with --master-weights 0 is not checked yet (its steps are smaller than a bf16 "
                         "weight's rounding): keep the master weights", r.o->optimizer.c_str()); }},

    // ---- Shape: the model and the grid known --------------------------------------------------
    // the GPU's MoE blocks (llmc/model/moe_gpu.cuh): the layer's shape and the kernels' limits, then what they do not do yet
    {"--moe-experts", "the GPU kernels' shape", ON_GPU, CompatMoment::Shape, "--moe-experts 65", [](R r) -> std::string {
        return r.o->moe_experts > 0 ? moe_gpu_kernels_problem(moe_run_shape(*r.o), r.cfg.channels) : ""; }},
    {"--expert-parallel", "a world it does not divide", ON_GPU, CompatMoment::Shape,
     "--moe-experts 2 --expert-parallel 2 --estimate-ranks 3", [](R r) -> std::string {
        int ep = r.o->expert_parallel, world = r.grid.world;
        if (r.o->moe_experts == 0 || ep < 2 || world % ep == 0) return "";
        return strprintf("--expert-parallel %d on %d GPUs: the expert groups must split the data-parallel ranks evenly; run a "
                         "multiple of %d ranks, or pick a divisor of %d", ep, world, ep, world); }},
    {"--expert-parallel", "--zero 1|2 (GPU)", ON_GPU, CompatMoment::Shape,
     "--moe-experts 2 --expert-parallel 2 --zero 1 --estimate-ranks 2", [](R r) -> std::string {
        if (r.o->moe_experts == 0 || r.o->expert_parallel < 2 || r.o->zero_stage == 0) return "";
        return strprintf("--expert-parallel %d with --zero %d on the GPU: the held experts' moments are not sharded over their "
                         "replicas yet; use --zero 0, or train_gpt_cpu", r.o->expert_parallel, r.o->zero_stage); }},
    {"--expert-parallel", "a world the routers do not split over", ON_GPU, CompatMoment::Shape,
     "--moe-experts 2 --expert-parallel 2 --estimate-ranks 6", [](R r) -> std::string {
        if (r.o->moe_experts == 0 || r.o->expert_parallel < 2) return "";
        size_t routers = moe_layout(r.cfg, MoEConfig{r.o->moe_experts, r.o->moe_every}).count[MOE_ROUTER];
        if (routers % (size_t)r.grid.world == 0) return "";  // (summed as a reduce-scatter and an all-gather)
        return strprintf("--expert-parallel %d on %d GPUs: the routers' %zu values do not split over the %d ranks; run a power "
                         "of two ranks, or --expert-parallel 1", r.o->expert_parallel, r.grid.world, routers, r.grid.world); }},
    {"--expert-parallel", "--grad-compression (GPU)", ON_GPU, CompatMoment::Shape,
     "--moe-experts 2 --expert-parallel 2 --grad-compression bf16 --estimate-ranks 2", [](R r) -> std::string {
        if (r.o->moe_experts == 0 || r.o->expert_parallel < 2 || r.grid.world < 2 || r.o->grad_compression == "none") return "";
        return strprintf("--expert-parallel %d with --grad-compression %s on the GPU: the experts' sums over their replicas are "
                         "not compressed (not checked yet); drop --grad-compression", r.o->expert_parallel,
                         r.o->grad_compression.c_str()); }},
    {"--moe-experts", "--cuda-graphs", ON_GPU, CompatMoment::Shape, "--moe-experts 2 --cuda-graphs", [](R r) -> std::string {
        if (r.o->moe_experts == 0 || !r.o->cuda_graphs) return "";
        return "--moe-experts with --cuda-graphs: each MoE block's experts wait on the host for their row counts; drop --cuda-graphs"; }},
    {"--moe-experts", "--precision fp8", ON_GPU, CompatMoment::Shape, "--moe-experts 2 --precision fp8", [](R r) -> std::string {
        if (r.o->moe_experts == 0 || r.o->precision != "fp8") return "";
        return "--moe-experts with --precision fp8: the experts' matmuls have no fp8 scales yet; drop --precision fp8"; }},
    {"--moe-experts", "--offload optimizer", ON_GPU, CompatMoment::Shape, "--moe-experts 2 --offload optimizer", [](R r) -> std::string {
        if (r.o->moe_experts == 0 || r.o->offload != "optimizer") return "";
        return "--moe-experts with --offload optimizer: the MoE table's moments stay on the GPU; drop --offload"; }},
    {"--moe-experts", "the fp16 build", ON_GPU, CompatMoment::Shape, "--moe-experts 2 @fp16", [](R r) -> std::string {
        if (r.o->moe_experts == 0 || !compat_fp16(r)) return "";
        return "--moe-experts in the fp16 build: the MoE table's update knows no loss scale yet; use ./train_gpt (bf16)"; }},
    // --optimizer-state bf16 on the GPU (llmc/optim/adamw_bf16.cuh) runs where it is proven against the CPU trainer
    // (test/test_gpu_optimizers.py): ZeRO-0/1/2 on one GPU or data-parallel ranks, the bf16 and fp32 builds
    {"--optimizer-state bf16", "--zero 3 (GPU)", ON_GPU, CompatMoment::Shape, "--optimizer-state bf16 --zero 3 --estimate-ranks 2", [](R r) -> std::string {
        if (r.o->optimizer_state != "bf16" || r.o->zero_stage < 3) return "";
        return "--optimizer-state bf16 on the GPU trainer with --zero 3: built for --zero 0, 1 or 2 for now; use those, or "
               "--optimizer-state fp32"; }},
    {"--optimizer-state bf16", "--zero 2 with tensor or pipeline parallelism (GPU)", ON_GPU, CompatMoment::Shape,
     "--optimizer-state bf16 --zero 2 --tensor-parallel 2 --estimate-ranks 2", [](R r) -> std::string {
        if (r.o->optimizer_state != "bf16" || r.o->zero_stage != 2 || (r.o->tensor_parallel < 2 && r.o->pipeline_parallel < 2)) return "";
        return "--optimizer-state bf16 on the GPU trainer with --zero 2 and tensor or pipeline parallelism is not checked yet: "
               "use --zero 0 or 1 there, or --optimizer-state fp32"; }},
    {"--optimizer-state bf16", "--moe-experts (GPU)", ON_GPU, CompatMoment::Shape, "--optimizer-state bf16 --moe-experts 2", [](R r) -> std::string {
        if (r.o->optimizer_state != "bf16" || r.o->moe_experts == 0) return "";
        return "--optimizer-state bf16 on the GPU trainer with --moe-experts: the MoE table's moments are fp32; use "
               "--optimizer-state fp32"; }},
    {"--optimizer-state bf16", "the fp16 build", ON_GPU, CompatMoment::Shape, "--optimizer-state bf16 @fp16", [](R r) -> std::string {
        if (r.o->optimizer_state != "bf16" || !compat_fp16(r)) return "";
        return "--optimizer-state bf16 on the GPU trainer in the fp16 build is not checked yet: use ./train_gpt (bf16) or "
               "./train_gpt_fp32"; }},
    // --optimizer adafactor | sm3 on the GPU (llmc/optim/adafactor.cuh, sm3.cuh) run where they are proven against the
    // CPU trainer (test/test_gpu_factored.py): one GPU, or data-parallel replicas with --zero 0, eager steps
    {"--optimizer adafactor|sm3", "--zero 1 or --tensor-parallel (GPU)", ON_GPU, CompatMoment::Shape,
     "--optimizer adafactor --zero 1 --estimate-ranks 2", [](R r) -> std::string {
        if (!compat_factored(*r.o) || (r.o->zero_stage == 0 && r.o->tensor_parallel < 2)) return "";
        return strprintf("--optimizer %s on the GPU trainer with --zero %d --tensor-parallel %d: built for one GPU or data "
                         "parallelism with --zero 0 for now; use those, train_gpt_cpu, or --optimizer adamw",
                         r.o->optimizer.c_str(), r.o->zero_stage, r.o->tensor_parallel); }},
    {"--optimizer adafactor|sm3", "--offload optimizer", ON_GPU, CompatMoment::Shape, "--optimizer sm3 --offload optimizer", [](R r) -> std::string {
        if (!compat_factored(*r.o) || r.o->offload != "optimizer") return "";
        const char* name = r.o->optimizer.c_str();
        return strprintf("--optimizer %s with --offload optimizer: the offload moves AdamW's master weights, m and v; %s's "
                         "statistics are small and stay on the GPU: drop --offload", name, name); }},
    {"--optimizer adafactor|sm3", "--moe-experts (GPU)", ON_GPU, CompatMoment::Shape, "--optimizer adafactor --moe-experts 2", [](R r) -> std::string {
        if (!compat_factored(*r.o) || r.o->moe_experts == 0) return "";
        return strprintf("--optimizer %s with --moe-experts on the GPU: the MoE table's update is AdamW's; use train_gpt_cpu",
                         r.o->optimizer.c_str()); }},
    {"--optimizer adafactor|sm3", "--cuda-graphs", ON_GPU, CompatMoment::Shape, "--optimizer adafactor --cuda-graphs", [](R r) -> std::string {
        if (!compat_factored(*r.o) || !r.o->cuda_graphs) return "";
        return strprintf("--optimizer %s with --cuda-graphs is not checked yet: drop --cuda-graphs", r.o->optimizer.c_str()); }},
    {"--optimizer adafactor|sm3", "--grad-compression (GPU)", ON_GPU, CompatMoment::Shape,
     "--optimizer adafactor --grad-compression bf16 --estimate-ranks 2", [](R r) -> std::string {
        if (!compat_factored(*r.o) || r.o->grad_compression == "none") return "";
        return strprintf("--optimizer %s with --grad-compression on the GPU is not checked yet: drop --grad-compression",
                         r.o->optimizer.c_str()); }},
    {"--optimizer adafactor|sm3", "--precision fp8", ON_GPU, CompatMoment::Shape, "--optimizer sm3 --precision fp8", [](R r) -> std::string {
        if (!compat_factored(*r.o) || r.o->precision != "fp8") return "";
        return strprintf("--optimizer %s with --precision fp8 is not checked yet: drop --precision fp8", r.o->optimizer.c_str()); }},
    {"--optimizer adafactor|sm3", "the fp16 build", ON_GPU, CompatMoment::Shape, "--optimizer adafactor @fp16", [](R r) -> std::string {
        if (!compat_factored(*r.o) || !compat_fp16(r)) return "";
        return strprintf("--optimizer %s in the fp16 build is not checked yet: use ./train_gpt (bf16) or ./train_gpt_fp32",
                         r.o->optimizer.c_str()); }},
    // interleaved: the layers cut into p x v equal chunks, the micro-batches in groups of p (the GPU checks it before
    // the grid, the CPU after: two rows, one order each)
    {"--pipeline-schedule interleaved", "the layers and micro-batches", ON_GPU, CompatMoment::Shape,
     "--pipeline-parallel 2 --pipeline-schedule interleaved --virtual-stages 3", [](R r) -> std::string {
        return compat_interleaving_problem(r); }},
    {"--tensor-parallel, --pipeline-parallel, --zero, --sequence-parallel", "the model and batch", ON_BOTH, CompatMoment::Shape,
     "--tensor-parallel 3", [](R r) -> std::string {
        return grid_problem(r.grid, r.cfg, r.B, r.T, r.micro_batches); }},
    {"--pipeline-schedule interleaved", "the layers and micro-batches", ON_CPU, CompatMoment::Shape,
     "--pipeline-parallel 2 --pipeline-schedule interleaved --virtual-stages 3", [](R r) -> std::string {
        return compat_interleaving_problem(r); }},
    {"--grad-compression", "tensor or pipeline parallelism, --zero, one data rank, the model", ON_BOTH, CompatMoment::Shape,
     "--grad-compression bf16", [](R r) -> std::string {
        GradCompressionSettings s = grad_compression_settings(*r.o);
        s.every_matrix = grad_compression_test_every_matrix();
        return grad_compression_problem(s, r.grid, r.cfg); }},
    // (S changes between steps; PowerSGD's error feedback e would mix scales)
    {"--grad-compression powersgd", "the fp16 build", ON_GPU, CompatMoment::Shape, "--grad-compression powersgd --estimate-ranks 2 @fp16", [](R r) -> std::string {
        if (r.o->grad_compression != "powersgd" || !compat_fp16(r)) return "";
        return "--grad-compression powersgd with the fp16 build: its error feedback would hold gradients at an old loss scale; "
               "use train_gpt (bf16)"; }},
    {"--data-parallel server", "--zero, tensor or pipeline parallelism, --grad-compression", ON_CPU, CompatMoment::Shape,
     "--data-parallel server --zero 1 --estimate-ranks 2", [](R r) -> std::string {
        return parameter_server_problem(r.o->data_parallel == "server", r.grid, r.o->grad_compression != "none"); }},
    // --precision fp8 (llmc/kernels/fp8.cuh): one GPU, data-parallel (ZeRO-0/1/2) and tensor-parallel ranks for now, and
    // cuBLASLt's fp8 matmuls' multiples of 16 (the GPU's compute capability, 8.9 or newer, is the trainer's to check)
    {"--precision fp8", "pipeline parallelism or --zero 3", ON_GPU, CompatMoment::Shape,
     "--precision fp8 --pipeline-parallel 2", [](R r) -> std::string {
        if (r.o->precision != "fp8" || (r.grid.pp < 2 && r.grid.zero_stage < 3)) return "";
        return "--precision fp8 runs on one GPU, data-parallel (--zero 0, 1 or 2) and tensor-parallel ranks for now; "
               "pipeline stages (each would need its own fp8_state.bin) and ZeRO-3 are not proven with it yet: drop "
               "--pipeline-parallel, use --zero 2 at most, or drop --precision fp8"; }},
    {"--precision fp8", "a shape not in multiples of 16", ON_GPU, CompatMoment::Shape, "--precision fp8 --seq-len 8 --total-batch-tokens 96", [](R r) -> std::string {
        int c = r.cfg.channels / r.grid.tp;
        if (r.o->precision != "fp8" || (c % 16 == 0 && ((size_t)r.B * r.T) % 16 == 0)) return "";
        return strprintf("--precision fp8: cuBLASLt's fp8 matmuls need dimensions that are multiples of 16; C/tp=%d, "
                         "B*T=%d: change the shape or --tensor-parallel, or drop --precision fp8", c, r.B * r.T); }},
    // --cuda-graphs (llmc/run/cuda_graphs.cuh): what a captured step cannot hold yet (ranks sharing a GPU, a fact of
    // the launch, is the trainer's to check)
    {"--cuda-graphs", "tensor or pipeline parallelism", ON_GPU, CompatMoment::Shape, "--cuda-graphs --tensor-parallel 2", [](R r) -> std::string {
        if (!r.o->cuda_graphs || (r.grid.tp < 2 && r.grid.pp < 2)) return "";
        return strprintf("--cuda-graphs runs on one GPU or data-parallel ranks for now, got tensor %d x pipeline %d (their "
                         "exchanges are not captured yet): use data parallelism, or drop --cuda-graphs", r.grid.tp, r.grid.pp); }},
    {"--cuda-graphs", "--grad-compression powersgd", ON_GPU, CompatMoment::Shape,
     "--cuda-graphs --grad-compression powersgd --estimate-ranks 2", [](R r) -> std::string {
        if (!r.o->cuda_graphs || r.grid.world < 2 || r.o->grad_compression != "powersgd") return "";
        return "--cuda-graphs with --grad-compression powersgd is not supported (its sums are host-driven): drop one of them"; }},
    {"--cuda-graphs", "--offload optimizer", ON_GPU, CompatMoment::Shape, "--cuda-graphs --offload optimizer", [](R r) -> std::string {
        if (!r.o->cuda_graphs || r.o->offload == "none") return "";
        return "--cuda-graphs with --offload optimizer: the update runs on the host, there is nothing to capture; drop one of them"; }},
    {"--cuda-graphs", "--zero 3", ON_GPU, CompatMoment::Shape, "--cuda-graphs --zero 3 --estimate-ranks 2", [](R r) -> std::string {
        if (!r.o->cuda_graphs || r.o->zero_stage != 3) return "";
        return "--cuda-graphs with --zero 3 is not supported yet (each unit's all-gather is waited for by the host, and "
               "which units a pass gathers depends on what its slots still hold): use --zero 2, or drop --cuda-graphs"; }},
    // (the table's last row, so that a pair refused for another reason keeps that line)
    {"own x own", "another own technique (compat_techniques)", ON_BOTH, CompatMoment::Shape,
     "--optimizer-state bf16 --grad-compression powersgd --estimate-ranks 2", [](R r) -> std::string {
        std::vector<std::string> own = compat_own_techniques(*r.o);
        // (MoE with Adafactor or SM3 has a reference of its own: test_moe_trainer.py's statistics of every expert)
        if (own.size() < 2 || (own.size() == 2 && r.o->moe_experts > 0 && compat_factored(*r.o))) return "";
        return strprintf("%s with %s: each defines the arithmetic, so the pair has no run to be checked against and is "
                         "not run by any test; drop one of the two", own[0].c_str(), own[1].c_str()); }},
    };
    return rows;
}

// The run's one line: the first row of this moment that refuses, for this trainer ("" = allowed).
// (`table`: the tests walk a table with a row planted or deleted.)
inline std::string compatibility_problem(const CompatRun& r, CompatMoment moment,
                                         const std::vector<CompatRow>& table = compatibility_table()) {
    int mine = r.trainer == Trainer::CPU ? ON_CPU : ON_GPU;
    for (const CompatRow& row : table) {
        if (row.moment != moment || !(row.trainers & mine)) continue;
        std::string why = row.refuse(r);
        if (!why.empty()) return why;
    }
    return "";
}

// The Shape rows on this grid (rank 0's view is enough: every rank reaches the same verdict), with the
// batch as plan_run cuts it for the grid's data-parallel ranks ("" = allowed).
inline std::string compatibility_grid_problem(const TrainOptions& o, Trainer trainer, const char* build, const GPT2Config& cfg,
                                              const ProcessGrid& grid) {
    CompatRun r;
    r.o = &o, r.trainer = trainer, r.build = build, r.cfg = cfg, r.grid = grid;
    RunPlan plan = plan_run(o, cfg, grid.dp, 0);  // (the step count needs the data; the batch geometry does not)
    r.B = plan.B, r.T = plan.T;
    r.micro_batches = o.eval_only ? grid.pp : plan.accumulation_steps;  // (--eval-only runs no pipeline schedule)
    return compatibility_problem(r, CompatMoment::Shape);
}

// Both mains, right after validate_options: the Flags rows (exit 2 with the row's line).
inline void refuse_incompatible_flags(const TrainOptions& o, Trainer trainer, const char* build) {
    CompatRun r;
    r.o = &o, r.trainer = trainer, r.build = build;
    std::string why = compatibility_problem(r, CompatMoment::Flags);
    if (!why.empty()) usage_fail(why);
}

// --estimate: the Shape rows on the grid the flags describe (--estimate-ranks data-parallel ranks),
// as training would check them on that many ranks.
inline void refuse_incompatible_estimate(const TrainOptions& o, Trainer trainer, const char* build, const GPT2Config& cfg) {
    ProcessGrid grid;
    int world = o.estimate_ranks * o.tensor_parallel * o.pipeline_parallel;
    std::string why = make_grid(world, 0, o.tensor_parallel, o.pipeline_parallel, 0, o.zero_stage, o.sequence_parallel, &grid);
    if (why.empty()) why = compatibility_grid_problem(o, trainer, build, cfg, grid);
    if (!why.empty()) usage_fail(why);
}

// --plan: a grid it ranks is one training would run. Every row, the Flags rows with the flags'
// degrees replaced by this grid's ("" = allowed).
inline std::string compatibility_plan_problem(const TrainOptions& flags, Trainer trainer, const char* build, const GPT2Config& cfg,
                                              const ProcessGrid& g, int B, int T, int micro_batches) {
    TrainOptions o = flags;
    o.tensor_parallel = g.tp, o.pipeline_parallel = g.pp, o.zero_stage = g.zero_stage, o.sequence_parallel = g.sequence_parallel;
    CompatRun r;
    r.o = &o, r.trainer = trainer, r.build = build, r.cfg = cfg, r.grid = g, r.B = B, r.T = T, r.micro_batches = micro_batches;
    std::string why = compatibility_problem(r, CompatMoment::Flags);
    return why.empty() ? compatibility_problem(r, CompatMoment::Shape) : why;
}
