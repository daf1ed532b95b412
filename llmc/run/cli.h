// cli.h — the command line: one table of flags, shared by the CPU and the GPU trainer.
//
// Each flag is one row: name, value name, group, help, where its value goes, and which trainer
// takes it. Parsing, `--help` (grouped, with the defaults) and the error for a mistyped flag are all
// generated from the table, so the two trainers cannot drift apart and the help can never go stale.
// Flags are `--name value` or `--name=value`; a few are switches that take no value.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include <unistd.h>
#include "llmc/utils.h"

constexpr const char* LLMC_VERSION = "0.1.0";

enum class Trainer { CPU, GPU };
enum class Scope { Both, CPUOnly, GPUOnly };

struct TrainOptions {
    // data
    std::string train_data = "data/moby-dick/moby-dick_train_*.bin";
    std::string val_data = "data/moby-dick/moby-dick_val_*.bin";
    std::string tokenizer_dir = "data/gpt2";
    // model
    std::string model = "d12";
    // batch
    int batch_size = 4;              // B: sequences per micro-batch, per rank
    int seq_len = 0;                 // T: 0 = the model's max sequence length
    int64_t total_batch_tokens = 0;  // tokens per optimizer step; 0 = B*T*ranks (no accumulation)
    // optimisation
    int steps = 0;                   // 0 = one pass over the training data
    int more_steps = 0;              // --resume: K steps past the checkpoint's, the schedule stretched to the new end
    std::string optimizer = "adamw"; // adamw | adafactor | sm3 (llmc/optim/optimizer_state.h)
    std::string optimizer_state = "fp32";  // AdamW: fp32 | bf16 m and v (llmc/optim/adamw_bf16.h, .cuh)
    float lr = 6e-4f;
    std::string lr_schedule = "cosine";
    int warmup_steps = 0;
    float final_lr_fraction = 0.0f;
    float decay_fraction = 0.2f;
    float weight_decay = 0.1f;
    float beta1 = 0.9f, beta2 = 0.95f, adam_eps = 1e-8f;
    float grad_clip = 1.0f;
    int max_bad_steps = 3;           // steps in a row whose loss or gradient norm is not finite before stopping
    uint64_t seed = 42;
    // evaluation and sampling
    int val_every = 100;
    int val_tokens = 1 << 20;        // tokens a validation scores, the same windows at any B (0 = the whole split)
    int val_batches = 0;             // the older form: N micro-batches of B x T tokens (0 = --val-tokens)
    int sample_every = 0;
    int sample_tokens = 64;
    float temperature = 1.0f;
    int top_k = 0;
    float top_p = 1.0f;              // nucleus sampling: the smallest set of tokens with this much probability (1 = all)
    std::string hellaswag;           // HellaSwag-format JSONL to evaluate ("" = none)
    int hellaswag_every = 0;         // during training every N steps; 0 = only at the end
    // generation (llmc/run/generate.h): --generate or --prompt-file switches the trainer to it
    std::string generate;            // the prompt text
    std::string prompt_file;         // or a file holding it
    int num_samples = 1;             // samples drawn from the prompt
    int kv_cache = 1;                // 1: keys and values of earlier tokens cached; 0: the whole window recomputed per token
    bool json = false;               // one JSON line per sample instead of text
    std::vector<std::string> given;  // the flags on the command line, by name (to tell an empty --generate "" from none)
                                     // and those a resumed run takes from its checkpoint (llmc/run/resume.h)
    std::vector<std::string> resume_notes;  // what the resumed checkpoint's options became: one line per override
    // output
    std::string out_dir = "out";
    int checkpoint_every = 0;        // 0 and not given: one checkpoint at the end (end_checkpoint)
    bool no_checkpoint = false;      // no checkpoint at all, not even at the end
    int keep_checkpoints = 0;        // the newest N sound checkpoints kept, older ones removed (0 = all)
    std::string resume;              // "", "latest", "auto" (latest if any, else start), or a checkpoint directory
    std::string metrics;             // the JSONL metrics log: "" = OUT_DIR/metrics.jsonl, "none" = no log
    std::string trace;               // --trace: each rank's timeline (llmc/probes/trace.h)
    std::string dump_state;          // debugging/tests: write step-1 logits and gradients here
    // machine
    int threads = 0;                 // CPU: 0 = the free cores (llmc/run/cpu_threads.h)
    int recompute = 1;               // 0 keep all activations, 1 recompute GELU, 2 also LayerNorm
    std::string stash_precision = "fp32";  // CPU: fp32 | bf16, GPU: fp32 (as built) | fp8: activations kept for the backward (llmc/memory/stash_precision.h, .cuh)
                                     // (the GPU trainer's default; the CPU trainer's is 0: default_options)
    int master_weights = 1;          // GPU: keep fp32 master weights
    std::string offload = "none";    // GPU: none | optimizer (llmc/optim/offload.cuh)
    int offload_delay = 0;           // GPU: 1 = the CPU step overlaps the next step's passes (one step stale)
    int offload_bucket_layers = 1;   // GPU: layers per bucket streamed to the host in the backward (0: after it)
    std::string offload_dir;         // CPU: AdamW's m and v in files here, streamed (llmc/optim/disk_offload.h)
    int offload_chunk_kib = 4096;    // CPU: the chunk --offload-dir streams them in (DISK_OFFLOAD_DEFAULT_CHUNK_KIB)
    std::string precision;           // bf16 | fp16 | fp32 | fp8 (bf16 build); "" = the binary's own (validate_precision)
    int fp8_amax_history = 0;        // --precision fp8: steps of amax per tensor (0 = FP8_AMAX_HISTORY, llmc/kernels/fp8.cuh)
    float loss_scale_init = 0;       // fp16 build: S at the start (0 = LOSS_SCALE_INIT, llmc/optim/loss_scaler.h)
    int loss_scale_window = 0;       // fp16 build: clean steps before S doubles (0 = LOSS_SCALE_WINDOW)
    std::string attention = "cudnn"; // GPU: cudnn (fused flash attention) | simple (materialised, for checking)
    bool cuda_graphs = false;        // GPU: the step captured into CUDA graphs once, replayed (llmc/run/cuda_graphs.cuh)
    // parallelism (llmc/parallel/process_grid.h): world = data x tensor x pipeline ranks
    int zero_stage = 0;              // ZeRO stage: 0 replicate, 1 shard optimizer state, 2 + gradients, 3 + weights
    float comm_timeout = 600;        // seconds a collective may wait for the other ranks (0 = forever)
    std::string grad_compression = "none";  // none | bf16 | powersgd (llmc/parallel/grad_compression.h, .cuh)
    std::string data_parallel = "allreduce";  // CPU: allreduce | server (llmc/parallel/parameter_server.h)
    int powersgd_rank = 4;           // r of PowerSGD's rank-r approximation
    int powersgd_start_step = 0;     // steps 1..N use the exact sum before PowerSGD starts
    // mixture of experts (llmc/model/moe.h, docs/moe.md): the flags and their checks; the CPU trainer
    // trains MoE models on one rank or data parallel, the GPU trainer on one GPU or data parallel (llmc/model/moe_gpu.cuh)
    int moe_experts = 0;             // E experts per MoE block; 0 = dense (every block a plain MLP)
    int moe_top_k = 1;               // experts per token: 1 (Switch) or 2 (GShard)
    int moe_every = 1;               // blocks n-1, 2n-1, ... are MoE blocks (1: all of them)
    std::string moe_capacity_factor = "none";  // f of ceil(k N f / E); none or 0: no dropping
    float moe_aux_alpha = 1e-2f;     // alpha of the load-balancing loss (Switch)
    float moe_z_loss = 1e-3f;        // c_z of the router z-loss (ST-MoE)
    int expert_parallel = 1;         // experts of each MoE block split over this many data-parallel ranks (llmc/parallel/expert_parallel.h)
    // the estimate (--estimate): what it assumes
    float estimate_memory_gib = 0;   // memory per rank to fit (0: 80 GiB on the GPU, this machine's RAM on the CPU)
    float estimate_mfu = 0.4f;       // model FLOPs utilisation for the predicted step time
    float estimate_peak_tflops = 0;  // peak per rank (0: H100 SXM dense bf16 on the GPU, none on the CPU)
    int estimate_ranks = 1;          // data-parallel ranks for ZeRO and tokens per step
    // the grid planner (--plan, llmc/parallel/grid_planner.h): what it assumes
    int plan = 0;                    // ranks to plan a grid for (0: no plan)
    float plan_tflops = 0;           // TFLOP/s one rank achieves (0: the trainer's default)
    float plan_bandwidth = 0;        // GB/s a rank sends between nodes (0: the trainer's default)
    float plan_node_bandwidth = 0;   // GB/s inside a node (0: the trainer's default)
    int plan_node_size = 0;          // ranks per node (0: the trainer's default)
    float plan_node_memory_gib = 0;  // CPU trainer: memory a node's ranks share (0: this machine's RAM)
    float plan_latency = -1;         // microseconds per message hop (-1: the trainer's default; 0: no latency term)
    int tensor_parallel = 1;         // ranks that split each layer (Megatron)
    int sequence_parallel = 0;       // tensor ranks also split the LayerNorm/residual rows
    int pipeline_parallel = 1;       // stages the layers are split into
    std::string pipeline_schedule = "1f1b";  // gpipe | 1f1b | interleaved | zb-h1 | 2bw | 2bw-flush
    int virtual_stages = 1;          // model chunks per pipeline stage (interleaved)
    float max_memory_mib = 0;        // CPU: refuse to start if a rank would need more (0 = no limit)
    // switches
    bool eval_only = false;          // evaluate the model and exit: a run of zero steps
    bool quiet = false;              // only errors and the final summary
    bool verbose = false;            // also per-micro-step lines and buffer tables
    bool estimate = false;
    bool pipeline_print_schedule = false;  // print every stage's list of actions and exit
    bool profile = false;            // CPU: time each kind of work per step (llmc/probes/cpu_profile.h)
    bool print_allocations = false;
    bool help = false;
    bool help_all = false;
    bool version = false;
};

struct FlagSpec {
    const char* name;
    const char* value_name;   // nullptr for a switch
    const char* group;
    const char* help;
    enum Kind { Int, Int64, UInt64, Float, String, Switch } kind;
    void* target;
    Scope scope;
};

// The defaults, which differ between the trainers in one place: --recompute. A GPU's memory is what
// limits the micro-batch, and recomputing GELU there costs memory traffic, not matmul FLOPs, so the
// GPU trainer recomputes it by default (1). The CPU trainer is the readable reference and its RAM is
// rarely the limit, so it keeps everything (0) unless asked. parse_command_line starts from these,
// and --help prints them.
inline TrainOptions default_options(Trainer trainer) {
    TrainOptions o;
    o.recompute = trainer == Trainer::GPU ? 1 : 0;
    return o;
}

inline std::vector<FlagSpec> flag_table(TrainOptions& o) {
    using K = FlagSpec;
    return {
        {"train-data", "GLOB", "Data", "training token shards", K::String, &o.train_data, Scope::Both},
        {"val-data", "GLOB", "Data", "validation token shards ('none' to skip validation)", K::String, &o.val_data, Scope::Both},
        {"tokenizer", "DIR", "Data", "folder with GPT-2's encoder.json and vocab.bpe, to print samples as text", K::String, &o.tokenizer_dir, Scope::Both},
        {"model", "SPEC", "Model", "a model file to start from, or a new model: d12|d24|d36|d48 (GPT-2 124M..1.5B), dN, or L=2,C=64,H=4[,T=256][,V=50257]", K::String, &o.model, Scope::Both},
        {"moe-experts", "E", "Model", "mixture of experts (llmc/model/moe.h): E copies of the MLP per MoE block and a router choosing --moe-top-k of them per token (0 = dense; both trainers on one rank or data parallel)", K::Int, &o.moe_experts, Scope::Both},
        {"moe-top-k", "K", "Model", "--moe-experts: experts per token, 1 (Switch) or 2 (GShard, gates renormalised)", K::Int, &o.moe_top_k, Scope::Both},
        {"moe-every", "N", "Model", "--moe-experts: blocks N-1, 2N-1, ... (counting from 0) are MoE blocks, the others dense (1 = every block)", K::Int, &o.moe_every, Scope::Both},
        {"moe-capacity-factor", "F", "Model", "--moe-experts: an expert takes at most ceil(k N F / E) of a micro-batch's N tokens, the rest are dropped (the residual carries them); none or 0 = no dropping; --generate never drops", K::String, &o.moe_capacity_factor, Scope::Both},
        {"moe-aux-alpha", "A", "Model", "--moe-experts: weight of the load-balancing loss A E sum_i f_i P_i (Switch)", K::Float, &o.moe_aux_alpha, Scope::Both},
        {"expert-parallel", "N", "Model", "--moe-experts: split each MoE block's experts over N ranks of the data-parallel group, tokens sent to their expert's rank by all-to-all (llmc/parallel/expert_parallel.h, .cuh; the GPU trainer's with --zero 0 and one GPU a rank; 1 = every rank runs every expert)", K::Int, &o.expert_parallel, Scope::Both},
        {"moe-z-loss", "C", "Model", "--moe-experts: weight of the router z-loss C mean logsumexp(logits)^2 (ST-MoE)", K::Float, &o.moe_z_loss, Scope::Both},
        {"batch-size", "B", "Batch", "sequences per micro-batch (per rank)", K::Int, &o.batch_size, Scope::Both},
        {"seq-len", "T", "Batch", "tokens per sequence (0 = the model's maximum)", K::Int, &o.seq_len, Scope::Both},
        {"total-batch-tokens", "N", "Batch", "tokens per optimizer step; micro-batches are accumulated to reach it (0 = one micro-batch per rank)", K::Int64, &o.total_batch_tokens, Scope::Both},
        {"steps", "N", "Optimizer", "optimizer steps to train, in all (0 = one pass over the training data); with --resume, more than the checkpoint's step", K::Int, &o.steps, Scope::Both},
        {"more-steps", "K", "Optimizer", "with --resume: train K steps past the checkpoint's, the learning-rate schedule stretched to the new end (--steps STEP+K)", K::Int, &o.more_steps, Scope::Both},
        {"optimizer", "NAME", "Optimizer", "adamw | adafactor (Shazeer & Stern: row and column second moments, beta1 = 0, "
         "relative step min(1e-2, 1/sqrt(t)) x max(1e-3, RMS(W)), or --lr's schedule x max(1e-3, RMS(W)) when --lr is "
         "given) | sm3 (SM3-II, Anil et al.: row and column accumulators, at --lr's schedule). adafactor and sm3: the "
         "CPU trainer with --zero 0 or 1 (ZeRO-1: each rank owns whole matrices), --tensor-parallel at --zero 0, "
         "without pipeline parallelism; the GPU trainer on one GPU or data parallel with --zero 0 (no --offload, "
         "--moe-experts, --cuda-graphs, --grad-compression, fp8, fp16 build)", K::String, &o.optimizer, Scope::Both},
        {"optimizer-state", "fp32|bf16", "Optimizer", "AdamW's m and v in fp32 (8 bytes per parameter) or bf16 with stochastic "
         "rounding (4; the GPU trainer's: on the device or with --offload optimizer (m, v in bf16 on the host); not yet with "
         "--zero 3, --zero 2 with model parallelism, --moe-experts or the fp16 build)",
         K::String, &o.optimizer_state, Scope::Both},
        {"lr", "LR", "Optimizer", "peak learning rate", K::Float, &o.lr, Scope::Both},
        {"lr-schedule", "NAME", "Optimizer", "cosine | linear | constant | wsd (warmup-stable-decay)", K::String, &o.lr_schedule, Scope::Both},
        {"warmup-steps", "N", "Optimizer", "steps of linear warmup", K::Int, &o.warmup_steps, Scope::Both},
        {"final-lr-fraction", "F", "Optimizer", "final learning rate as a fraction of the peak", K::Float, &o.final_lr_fraction, Scope::Both},
        {"decay-fraction", "F", "Optimizer", "wsd: fraction of the steps spent decaying", K::Float, &o.decay_fraction, Scope::Both},
        {"weight-decay", "WD", "Optimizer", "decoupled weight decay (2-D weights only): w *= 1 - lr*WD (adafactor: its relative step rho_t*WD)", K::Float, &o.weight_decay, Scope::Both},
        {"beta1", "B1", "Optimizer", "AdamW first-moment decay", K::Float, &o.beta1, Scope::Both},
        {"beta2", "B2", "Optimizer", "AdamW second-moment decay", K::Float, &o.beta2, Scope::Both},
        {"adam-eps", "EPS", "Optimizer", "AdamW epsilon", K::Float, &o.adam_eps, Scope::Both},
        {"grad-clip", "NORM", "Optimizer", "clip the global gradient norm to this (0 = no clipping)", K::Float, &o.grad_clip, Scope::Both},
        {"max-bad-steps", "N", "Optimizer", "skip the update of a step whose loss or gradient norm is not finite; stop at the N-th such step in a row", K::Int, &o.max_bad_steps, Scope::Both},
        {"seed", "S", "Optimizer", "seed for initialisation and sampling", K::UInt64, &o.seed, Scope::Both},
        {"val-every", "N", "Evaluation", "validation loss every N steps and at the end (0 = never)", K::Int, &o.val_every, Scope::Both},
        {"val-tokens", "N", "Evaluation", "tokens each validation scores: the first N/T windows of T+1 tokens of --val-data, the same at any batch size, or the whole split when it is shorter (0 = the whole split)", K::Int, &o.val_tokens, Scope::Both},
        {"val-batches", "N", "Evaluation", "the older form of --val-tokens: N x B x T tokens (then B changes what is scored)", K::Int, &o.val_batches, Scope::Both},
        {"sample-every", "N", "Evaluation", "print a sample every N steps and at the end (0 = never)", K::Int, &o.sample_every, Scope::Both},
        {"sample-tokens", "N", "Evaluation", "tokens per sample", K::Int, &o.sample_tokens, Scope::Both},
        {"temperature", "TAU", "Evaluation", "sampling temperature (0 = greedy)", K::Float, &o.temperature, Scope::Both},
        {"top-k", "K", "Evaluation", "sample among the K most likely tokens (0 = all)", K::Int, &o.top_k, Scope::Both},
        {"top-p", "P", "Evaluation", "sample among the most likely tokens whose probabilities add up to P, in (0, 1] (1 = all)", K::Float, &o.top_p, Scope::Both},
        {"hellaswag", "FILE", "Evaluation", "HellaSwag-format JSONL (ctx, endings, label) to evaluate: each ending scored by its mean token loss; at the end of training, and with --hellaswag-every", K::String, &o.hellaswag, Scope::Both},
        {"hellaswag-every", "N", "Evaluation", "also evaluate --hellaswag every N steps during training (0 = only at the end)", K::Int, &o.hellaswag_every, Scope::Both},
        {"eval-only", nullptr, "Evaluation", "evaluate --model (or --resume's checkpoint) on --val-data and --hellaswag, then exit without training", K::Switch, &o.eval_only, Scope::Both},
        {"generate", "TEXT", "Generation", "continue TEXT with --model FILE's or --resume CKPT's weights, print the samples and exit (no data, no training); uses --sample-tokens, --temperature, --top-k, --top-p, --seed", K::String, &o.generate, Scope::Both},
        {"prompt-file", "FILE", "Generation", "like --generate, with the prompt read from FILE", K::String, &o.prompt_file, Scope::Both},
        {"num-samples", "N", "Generation", "samples to draw from the prompt, each from its own seed (--seed + i)", K::Int, &o.num_samples, Scope::Both},
        {"kv-cache", "0|1", "Generation", "1: cache each layer's keys and values, so a new token costs one position; 0: recompute the whole window for every token (to check and time the cache)", K::Int, &o.kv_cache, Scope::Both},
        {"json", nullptr, "Generation", "print one JSON line per sample instead of the text: prompt, prompt_tokens, tokens, text, and each token's log-probability (logprobs)", K::Switch, &o.json, Scope::Both},
        {"out-dir", "DIR", "Output", "where checkpoints and metrics.jsonl go", K::String, &o.out_dir, Scope::Both},
        {"checkpoint-every", "N", "Output", "write a checkpoint every N steps and at the end (without it: one at the end; 0 = never)", K::Int, &o.checkpoint_every, Scope::Both},
        {"no-checkpoint", nullptr, "Output", "write no checkpoint, not even at the end", K::Switch, &o.no_checkpoint, Scope::Both},
        {"keep-checkpoints", "N", "Output", "after each checkpoint keep the newest N sound ones in --out-dir and remove older ones (0 = keep all)", K::Int, &o.keep_checkpoints, Scope::Both},
        {"resume", "CKPT", "Output", "continue a run: a checkpoint directory, or a run's folder (its newest sound checkpoint); 'latest': the newest in --out-dir; 'auto': the newest if there is one, else start fresh. The run's options (lr, schedule, batch, seed, optimizer, ...) come from the checkpoint unless given; --out-dir defaults to the checkpoint's folder", K::String, &o.resume, Scope::Both},
        {"metrics", "FILE", "Output", "append one JSON line per step and evaluation here (default: OUT_DIR/metrics.jsonl; 'none' = no log)", K::String, &o.metrics, Scope::Both},
        {"quiet", nullptr, "Output", "print only errors and the final summary", K::Switch, &o.quiet, Scope::Both},
        {"verbose", nullptr, "Output", "also print every micro-step and the buffer tables", K::Switch, &o.verbose, Scope::Both},
        {"dump-state", "FILE", "Output", "testing: write the first step's logits, loss and gradients, the losses and the final weights (safetensors)", K::String, &o.dump_state, Scope::Both},
        {"trace", "FILE", "Output", "write each rank's forward, backward, send/receive and optimizer spans as Chrome trace-event JSON (Perfetto, chrome://tracing, scripts/plot_pipeline.py); with several ranks one file each, the rank before the extension: FILE.rank1.json", K::String, &o.trace, Scope::Both},
        {"threads", "N", "Machine", "OpenMP threads (0 = the cores other programs leave free)", K::Int, &o.threads, Scope::CPUOnly},
        {"recompute", "LEVEL", "Machine", "activation recompute: 0 keep all, 1 recompute GELU, 2 also LayerNorm (less memory, the same results)", K::Int, &o.recompute, Scope::Both},
        {"stash-precision", "fp32|bf16|fp8", "Machine", "the activations kept for the backward (LayerNorm outputs, q k v, the "
         "attention probabilities, its output, the GELU input and output), stored narrower once the forward has used them "
         "for the last time (Gist's delayed precision reduction: the same logits and loss, only the gradients see the "
         "rounding). CPU trainer: fp32 (default) or bf16 (2 bytes a value instead of 4, 24% less memory for d12 at B=4 "
         "T=1024, gradients within bf16's 2^-8). GPU trainer: fp32 (default: as built, bf16 in ./train_gpt) or fp8 (e4m3 "
         "with each tensor's own scale, 1 byte a value, gradients within e4m3's 2^-4; not with ZB-H1 yet)",
         K::String, &o.stash_precision, Scope::Both},
        {"master-weights", "0|1", "Machine", "keep fp32 master weights next to the bf16 parameters", K::Int, &o.master_weights, Scope::GPUOnly},
        {"offload", "WHAT", "Machine", "none | optimizer (ZeRO-Offload: fp32 master weights and AdamW's m, v in pinned host memory, "
         "the step on the CPU, 12 bytes/param off the GPU; AdamW (--optimizer-state fp32 or bf16), bf16 build, --master-weights 1, --zero 0|1|2 (each rank its shard), "
         "no tensor/pipeline parallelism; GPU trainer only: the CPU trainer's state is already in host memory)", K::String, &o.offload, Scope::GPUOnly},
        {"offload-delay", "0|1", "Machine", "1: --offload optimizer's CPU step of step t runs while the GPU computes step t+1, "
         "which uses the weights of step t-1 (ZeRO-Offload's delayed parameter update: a staleness of one step; one GPU or ZeRO-0/1/2 data-parallel ranks; "
         "GPU trainer only, as --offload)", K::Int, &o.offload_delay, Scope::GPUOnly},
        {"offload-bucket-layers", "K", "Machine", "--offload optimizer streams the gradient to the host in buckets of K layers "
         "as the backward finishes them, on a side stream (0: all of it after the backward; GPU trainer only, as --offload)",
         K::Int, &o.offload_bucket_layers, Scope::GPUOnly},
        {"offload-dir", "DIR", "Machine", "keep AdamW's m and v in files DIR/rank<r>_m.bin, _v.bin, streamed through the step in "
         "chunks (ZeRO-Infinity's idea: 8 bytes/param from RAM to disk, 4 with --optimizer-state bf16; the same weights bit for bit); AdamW, --zero "
         "0|1, no tensor/pipeline parallelism; CPU trainer only: the GPU trainer has --offload optimizer", K::String, &o.offload_dir, Scope::CPUOnly},
        {"offload-chunk-kib", "KIB", "Machine", "the chunk --offload-dir streams m and v in (RAM: 4 chunks)", K::Int, &o.offload_chunk_kib, Scope::CPUOnly},
        {"zero", "0-3", "Parallelism", "ZeRO stage over the data-parallel ranks: 0 each keeps everything, 1 each keeps 1/N of AdamW's state, 2 also of the gradients, 3 also of the weights", K::Int, &o.zero_stage, Scope::Both},
        {"tensor-parallel", "N", "Parallelism", "split every layer's heads, MLP and vocabulary over N ranks (Megatron)", K::Int, &o.tensor_parallel, Scope::Both},
        {"sequence-parallel", "0|1", "Parallelism", "tensor-parallel ranks also split the LayerNorm and residual rows", K::Int, &o.sequence_parallel, Scope::Both},
        {"pipeline-parallel", "N", "Parallelism", "split the layers into N pipeline stages", K::Int, &o.pipeline_parallel, Scope::Both},
        {"pipeline-schedule", "NAME", "Parallelism", "gpipe (all forwards, then all backwards) | 1f1b (one forward, one backward) | interleaved (1F1B over --virtual-stages chunks per stage) | zb-h1 (1F1B with the backward split into input and weight gradients, the weight gradients deferred into the bubble) | 2bw (PipeDream-2BW: 1F1B's order with no flush between steps, the gradient taken on the weights one step older, two weight versions per stage) | 2bw-flush (the same arithmetic, each step drained: 1F1B's bubble)", K::String, &o.pipeline_schedule, Scope::Both},
        {"virtual-stages", "V", "Parallelism", "model chunks per pipeline stage for --pipeline-schedule interleaved (chunk c of stage r = layer block c*p + r)", K::Int, &o.virtual_stages, Scope::Both},
        {"pipeline-print-schedule", nullptr, "Parallelism", "print every pipeline stage's ordered actions (forwards, backwards, sends, receives) for this configuration and exit (needs no data)", K::Switch, &o.pipeline_print_schedule, Scope::Both},
        {"profile", nullptr, "Machine", "print each step's time and GFLOP/s per kind of work (each matmul shape, attention, LayerNorm, ...) next to a measured SGEMM ceiling", K::Switch, &o.profile, Scope::CPUOnly},
        {"max-memory", "MIB", "Parallelism", "stop before training if a rank would need more than this many MiB (0 = no limit)", K::Float, &o.max_memory_mib, Scope::CPUOnly},
        {"grad-compression", "KIND", "Parallelism", "the data-parallel gradient sum: none (exact, fp32) | bf16 (rounded to bf16 on the wire: half the bytes) | powersgd (rank-r approximations of the weight matrices, with error feedback). The GPU trainer's exact sum already sends bf16, so bf16 is its exact sum there", K::String, &o.grad_compression, Scope::Both},
        {"data-parallel", "HOW", "Parallelism", "how the data-parallel ranks sum their gradients: allreduce (a ring's reduce-scatter + all-gather, the default) | server (a parameter server: rank 0 receives every gradient, steps, and sends the weights back; CPU trainer, --zero 0, the lesson of its traffic)", K::String, &o.data_parallel, Scope::Both},
        {"powersgd-rank", "R", "Parallelism", "--grad-compression powersgd: the rank r of each matrix's approximation (r (n + m) values sent instead of n m)", K::Int, &o.powersgd_rank, Scope::Both},
        {"powersgd-start-step", "N", "Parallelism", "--grad-compression powersgd: steps 1..N use the exact sum, compression starts after (0 = from the first step)", K::Int, &o.powersgd_start_step, Scope::Both},
        {"comm-timeout", "SECONDS", "Parallelism", "stop all ranks if a collective waits longer than this for the others (0 = wait forever)", K::Float, &o.comm_timeout, Scope::Both},
        {"precision", "KIND", "Machine", "bf16 | fp16 | fp32 | fp8: the element type of weights, activations and gradients. It is "
         "fixed when the binary is built, so this only checks it: ./train_gpt is bf16, ./train_gpt_fp16 fp16 (with dynamic "
         "loss scaling, llmc/optim/loss_scaler.h), ./train_gpt_fp32 and ./train_gpt_cpu fp32 (default: the binary's own). "
         "fp8: ./train_gpt (bf16) with the linear layers' matmuls in fp8 (forward e4m3, gradients e5m2, delayed per-tensor "
         "scaling, llmc/kernels/fp8.cuh); GPUs of compute capability 8.9+: one, data parallel (ZeRO-0/1/2) or tensor parallel", K::String, &o.precision, Scope::Both},
        {"fp8-amax-history", "N", "Machine", "--precision fp8: each tensor's scale comes from the max of its last N steps' "
         "amax (1..1024; 0 = 16)", K::Int, &o.fp8_amax_history, Scope::GPUOnly},
        {"loss-scale-init", "S", "Machine", "fp16 build (./train_gpt_fp16) only: the initial loss scale, a power of two >= 1 "
         "(0 = 65536, PyTorch's GradScaler)", K::Float, &o.loss_scale_init, Scope::GPUOnly},
        {"loss-scale-window", "N", "Machine", "fp16 build only: clean steps before the loss scale doubles (0 = 2000, PyTorch's "
         "growth interval); an overflow halves it and skips the step", K::Int, &o.loss_scale_window, Scope::GPUOnly},
        {"attention", "KIND", "Machine", "cudnn (fused flash attention) | simple (materialised attention, to check the fast path)", K::String, &o.attention, Scope::GPUOnly},
        {"cuda-graphs", nullptr, "Machine", "capture the step's kernels into CUDA graphs at the second step and replay them at every later "
         "one: 2 graph launches instead of a d12 step's 543 (--attention simple; m + 1 with m micro-batches of accumulation), the same results bit for bit (one GPU, or data-parallel ranks with a GPU each and --zero 0|1|2: the NCCL sums captured too; no --offload; "
         "GPU trainer only: the CPU trainer launches no kernels)", K::Switch, &o.cuda_graphs, Scope::GPUOnly},
        {"estimate", nullptr, "Estimate", "print the memory and compute estimate for this configuration and exit (needs no GPU and no data)", K::Switch, &o.estimate, Scope::Both},
        {"estimate-memory-gib", "GIB", "Estimate", "memory per rank the largest micro-batch must fit in (0 = 80 for the GPU trainer, this machine's RAM for the CPU trainer)", K::Float, &o.estimate_memory_gib, Scope::Both},
        {"estimate-mfu", "F", "Estimate", "model FLOPs utilisation assumed for the predicted step time, in (0, 1]", K::Float, &o.estimate_mfu, Scope::Both},
        {"estimate-peak-tflops", "TF", "Estimate", "peak TFLOP/s per rank (0 = an H100 SXM's dense bf16 for the GPU trainer; the CPU trainer then predicts no time)", K::Float, &o.estimate_peak_tflops, Scope::Both},
        {"estimate-ranks", "N", "Estimate", "data-parallel ranks: ZeRO divides the optimizer state by them, tokens per step grow with them (the grid: these x --tensor-parallel x --pipeline-parallel)", K::Int, &o.estimate_ranks, Scope::Both},
        {"plan", "RANKS", "Plan", "rank every valid data x tensor x pipeline grid (and ZeRO stage) of RANKS ranks by predicted memory per rank (as --estimate) and step time (compute + pipeline bubble + each group's traffic / its bandwidth), flag those over --estimate-memory-gib, explain the winner and exit (no data, no GPU); --tensor-parallel, --pipeline-parallel, --estimate-ranks, --zero fix a degree", K::Int, &o.plan, Scope::Both},
        {"plan-tflops", "TF", "Plan", "TFLOP/s one rank achieves on a training step (0 = --estimate-mfu x --estimate-peak-tflops for the GPU trainer, 0.04 for the CPU trainer)", K::Float, &o.plan_tflops, Scope::Both},
        {"plan-bandwidth", "GB/S", "Plan", "bus bandwidth per rank between nodes, as ./comm_bench's busbw (0 = 50, 400 Gb/s InfiniBand per GPU, for the GPU trainer; 0.6 for the CPU trainer)", K::Float, &o.plan_bandwidth, Scope::Both},
        {"plan-node-bandwidth", "GB/S", "Plan", "bus bandwidth per rank inside a node (0 = 450, H100 NVLink, for the GPU trainer; --plan-bandwidth for the CPU trainer)", K::Float, &o.plan_node_bandwidth, Scope::Both},
        {"plan-latency", "US", "Plan", "microseconds each message hop costs before its bytes move, as ./comm_bench's smallest all-reduce time / 2(n-1) (-1 = 100 for the CPU trainer, measured here; 0 for the GPU trainer, which has no measurement yet; 0 = no latency term)", K::Float, &o.plan_latency, Scope::Both},
        {"plan-node-size", "N", "Plan", "ranks per node: a group within one node gets --plan-node-bandwidth (0 = 8 for the GPU trainer; this machine's cores for the CPU trainer)", K::Int, &o.plan_node_size, Scope::Both},
        {"plan-node-memory-gib", "GIB", "Plan", "memory of one node, shared by its --plan-node-size ranks: each rank gets its share (0 = this machine's RAM; --estimate-memory-gib sets the memory per rank instead)", K::Float, &o.plan_node_memory_gib, Scope::CPUOnly},
        {"print-allocations", nullptr, "Info", "print, on every rank, the bytes each buffer really holds once allocated (to check --estimate)", K::Switch, &o.print_allocations, Scope::CPUOnly},
        {"version", nullptr, "Info", "print the version and exit", K::Switch, &o.version, Scope::Both},
        {"help", nullptr, "Info", "show examples and the common flags", K::Switch, &o.help, Scope::Both},
        {"help-all", nullptr, "Info", "show examples and every flag", K::Switch, &o.help_all, Scope::Both},
    };
}

inline bool flag_applies(const FlagSpec& f, Trainer t) {
    return f.scope == Scope::Both || (f.scope == Scope::CPUOnly && t == Trainer::CPU) ||
           (f.scope == Scope::GPUOnly && t == Trainer::GPU);
}

inline std::string flag_value_string(const FlagSpec& f) {
    switch (f.kind) {
        case FlagSpec::Int: return std::to_string(*(int*)f.target);
        case FlagSpec::Int64: return std::to_string(*(int64_t*)f.target);
        case FlagSpec::UInt64: return std::to_string(*(uint64_t*)f.target);
        case FlagSpec::Float: return strprintf("%g", *(float*)f.target);
        case FlagSpec::String: return *(std::string*)f.target;
        case FlagSpec::Switch: return *(bool*)f.target ? "on" : "off";
    }
    return "";
}

// Help fits a 100-column terminal: the flag in a 28-column left margin, its help wrapped at word
// boundaries into the remaining columns, and "[default: ...]" kept whole (never split over lines).
constexpr int HELP_WIDTH = 100, HELP_INDENT = 29;

inline void print_help_entry(const std::string& left, const std::string& help, const std::string& default_text) {
    std::vector<std::string> words;
    for (size_t i = 0; i < help.size();) {
        size_t end = help.find(' ', i);
        if (end == std::string::npos) end = help.size();
        if (end > i) words.push_back(help.substr(i, end - i));
        i = end + 1;
    }
    if (!default_text.empty()) words.push_back(default_text);
    std::string line = left.size() < HELP_INDENT ? left + std::string(HELP_INDENT - left.size(), ' ') : left + "\n" + std::string(HELP_INDENT, ' ');
    size_t column = HELP_INDENT;
    bool line_has_words = false;
    for (const std::string& w : words) {
        if (line_has_words && column + 1 + w.size() > (size_t)HELP_WIDTH) {
            printf("%s\n", line.c_str());
            line = std::string(HELP_INDENT, ' ');
            column = HELP_INDENT;
            line_has_words = false;
        }
        if (line_has_words) line += ' ', column++;
        line += w;
        column += w.size();
        line_has_words = true;
    }
    printf("%s\n", line.c_str());
}

// `--help` answers "how do I start?" first: five examples, then the flags most runs set; `--help-all`
// adds every other flag, grouped as the table orders them. Both are generated from the table, so the
// two lists together are always the whole table.
inline const std::vector<std::string>& common_flags() {
    static const std::vector<std::string> names = {"model", "train-data", "val-data", "batch-size", "seq-len",
                                                   "total-batch-tokens", "steps", "lr", "out-dir", "checkpoint-every",
                                                   "resume", "more-steps", "generate", "precision"};
    return names;
}

inline void print_help_examples() {
    printf("\nExamples:\n"
           "  train a small model on the CPU (the default data, data/moby-dick), a checkpoint every 100 steps:\n"
           "    ./train_gpt_cpu --model L=4,C=128,H=4,T=128 --batch-size 8 --seq-len 128 --steps 300 \\\n"
           "        --lr 3e-3 --out-dir out/small --checkpoint-every 100\n"
           "  GPT-2 small (124M, d12) on one GPU:\n"
           "    ./train_gpt --model d12 --batch-size 16 --seq-len 1024 --total-batch-tokens 524288 \\\n"
           "        --lr 6e-4 --warmup-steps 700 --train-data 'data/fineweb10B/fineweb_train_*.bin' \\\n"
           "        --val-data 'data/fineweb10B/fineweb_val_*.bin' --out-dir out/d12 --checkpoint-every 1000\n"
           "  the same on 8 GPUs of one machine, ZeRO-1 (each rank keeps 1/8 of AdamW's state):\n"
           "    scripts/run_mpi_local.sh 8 --model d12 --zero 1 --batch-size 16 --seq-len 1024 \\\n"
           "        --total-batch-tokens 524288 --lr 6e-4 --warmup-steps 700 --out-dir out/d12\n"
           "  train on 300 steps from the newest checkpoint (the run's options come with it):\n"
           "    ./train_gpt_cpu --resume latest --out-dir out/small --more-steps 300\n"
           "  generate text from it:\n"
           "    ./train_gpt_cpu --resume latest --out-dir out/small --generate \"Call me Ishmael.\"\n");
}

inline void print_help_flag(const FlagSpec& f) {
    std::string left = std::string("  --") + f.name + (f.value_name ? std::string(" ") + f.value_name : "");
    std::string value = flag_value_string(f);
    std::string def = f.kind == FlagSpec::Switch || value.empty() ? "" : "[default: " + value + "]";
    print_help_entry(left, f.help, def);
}

inline void print_help(const char* program, Trainer trainer, bool all) {
    TrainOptions defaults = default_options(trainer);
    std::vector<FlagSpec> table = flag_table(defaults);
    printf("usage: %s [flags]\n\n%s\n", program,
           trainer == Trainer::CPU ? "Trains a GPT-2 on the CPU in fp32: the readable reference for every GPU kernel."
                                   : "Trains a GPT-2 on the GPU in bf16 mixed precision.");
    print_help_examples();
    const std::vector<std::string>& common = common_flags();
    auto is_common = [&](const FlagSpec& f) { return std::find(common.begin(), common.end(), f.name) != common.end(); };
    printf("\nCommon flags:\n");
    for (const std::string& name : common)
        for (const FlagSpec& f : table)
            if (f.name == name && flag_applies(f, trainer)) print_help_flag(f);
    int rest = 0;
    for (const FlagSpec& f : table) rest += flag_applies(f, trainer) && !is_common(f);
    if (!all) {
        printf("\n%d more flags (parallelism, memory, evaluation, estimates, ...): --help-all\n", rest);
        printf("\nExit codes: 0 done, 1 bad input or failed operation, 2 bad command line.\n");
        return;
    }
    // the others: groups in order of first appearance, each with all of its flags
    std::vector<std::string> groups;
    for (const FlagSpec& f : table)
        if (std::find(groups.begin(), groups.end(), f.group) == groups.end()) groups.push_back(f.group);
    for (const std::string& group : groups) {
        bool header_printed = false;
        for (const FlagSpec& f : table) {
            if (f.group != group || !flag_applies(f, trainer) || is_common(f)) continue;
            if (!header_printed) printf("\n%s:\n", group.c_str());
            header_printed = true;
            print_help_flag(f);
        }
    }
    printf("\nExit codes: 0 done, 1 bad input or failed operation, 2 bad command line.\n");
}

// Edit distance, to suggest the flag the user probably meant.
inline int edit_distance(const std::string& a, const std::string& b) {
    std::vector<int> prev(b.size() + 1), cur(b.size() + 1);
    for (size_t j = 0; j <= b.size(); j++) prev[j] = (int)j;
    for (size_t i = 1; i <= a.size(); i++) {
        cur[0] = (int)i;
        for (size_t j = 1; j <= b.size(); j++)
            cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
        std::swap(prev, cur);
    }
    return prev[b.size()];
}

inline void parse_flag_value(const FlagSpec& f, const std::string& value) {
    const char* s = value.c_str();
    char* end = nullptr;
    errno = 0;
    switch (f.kind) {
        case FlagSpec::Int: {
            long v = strtol(s, &end, 10);
            if (value.empty() || *end || errno || v < INT32_MIN || v > INT32_MAX)
                usage_fail("--%s expects an integer, got '%s' (see --help)", f.name, s);
            *(int*)f.target = (int)v;
            break;
        }
        case FlagSpec::Int64: {
            long long v = strtoll(s, &end, 10);
            if (value.empty() || *end || errno) usage_fail("--%s expects an integer, got '%s' (see --help)", f.name, s);
            *(int64_t*)f.target = v;
            break;
        }
        case FlagSpec::UInt64: {
            unsigned long long v = strtoull(s, &end, 10);
            if (value.empty() || *end || errno || value[0] == '-')
                usage_fail("--%s expects a non-negative integer, got '%s' (see --help)", f.name, s);
            *(uint64_t*)f.target = v;
            break;
        }
        case FlagSpec::Float: {
            float v = strtof(s, &end);
            if (value.empty() || *end || errno || !std::isfinite(v))
                usage_fail("--%s expects a number, got '%s' (see --help)", f.name, s);
            *(float*)f.target = v;
            break;
        }
        case FlagSpec::String:
            *(std::string*)f.target = value;
            break;
        case FlagSpec::Switch:
            break;
    }
}

// ----------------------------------------------------------------------------------------------
// Quiet and verbose
//
// verbosity: 0 = quiet (errors and the final summary only), 1 = normal (one line per step),
// 2 = verbose (also every micro-step and the buffer tables). Quiet is a property of the whole
// program, so rather than guard every printf, stdout itself is pointed at /dev/null for the run;
// the final summary goes to `summary_stream`, a duplicate of the original stdout taken first.
// Errors and warnings go to stderr, which quiet never touches.
inline int verbosity = 1;
inline FILE* summary_stream = stdout;

inline void set_verbosity(int level) {
    verbosity = level;
    if (level > 0) return;
    fflush(stdout);
    int original = dup(fileno(stdout));
    FILE* saved = original >= 0 ? fdopen(original, "w") : nullptr;
    if (saved && freopen("/dev/null", "w", stdout)) summary_stream = saved;
}

// Parses argv into `o`, which starts from the trainer's defaults (default_options). A mistake
// (unknown flag, missing or malformed value, a flag of the other trainer) gets one line naming it
// and exits with code 2.
inline void parse_command_line(int argc, char** argv, Trainer trainer, TrainOptions* o) {
    *o = default_options(trainer);
    std::vector<FlagSpec> table = flag_table(*o);
    for (int i = 1; i < argc; i++) {
        std::string arg = argv[i];
        if (arg == "-h") arg = "--help";
        if (arg.rfind("--", 0) != 0) usage_fail("unexpected argument '%s': flags start with -- (see --help)", argv[i]);
        std::string name = arg.substr(2), value;
        bool has_inline_value = false;
        size_t eq = name.find('=');
        if (eq != std::string::npos) {
            value = name.substr(eq + 1);
            name = name.substr(0, eq);
            has_inline_value = true;
        }
        const FlagSpec* spec = nullptr;
        for (const FlagSpec& f : table)
            if (name == f.name) spec = &f;
        o->given.push_back(name);
        if (!spec) {
            std::string best;
            int best_distance = 4;
            for (const FlagSpec& f : table) {
                int d = edit_distance(name, f.name);
                if (d < best_distance && flag_applies(f, trainer)) best_distance = d, best = f.name;
            }
            if (!best.empty()) usage_fail("unknown flag --%s; did you mean --%s? (see --help)", name.c_str(), best.c_str());
            usage_fail("unknown flag --%s (see --help)", name.c_str());
        }
        if (!flag_applies(*spec, trainer)) {
            // the help may say why after "trainer only: " (--offload: the CPU's state is already on the host)
            const char* why = strstr(spec->help, "trainer only: ");
            std::string reason = why ? std::string(": ") + (why + strlen("trainer only: ")) : std::string();
            if (!reason.empty() && reason.back() == ')') reason.pop_back();
            usage_fail("--%s applies only to the %s trainer%s", spec->name, trainer == Trainer::CPU ? "GPU" : "CPU", reason.c_str());
        }
        if (spec->kind == FlagSpec::Switch) {
            if (has_inline_value) usage_fail("--%s takes no value", spec->name);
            *(bool*)spec->target = true;
            continue;
        }
        if (!has_inline_value) {
            if (i + 1 >= argc) usage_fail("--%s needs a value (%s)", spec->name, spec->value_name);
            value = argv[++i];
        }
        parse_flag_value(*spec, value);
    }
    if (o->help || o->help_all) {
        print_help(argv[0], trainer, o->help_all);
        exit(0);
    }
    if (o->version) {
        printf("llmc %s (%s trainer)\n", LLMC_VERSION, trainer == Trainer::CPU ? "CPU" : "GPU");
        exit(0);
    }
    if (o->quiet && o->verbose) usage_fail("--quiet and --verbose contradict each other: pass one of them");
    set_verbosity(o->quiet ? 0 : o->verbose ? 2 : 1);
}

inline bool flag_given(const TrainOptions& o, const char* name) {
    return std::find(o.given.begin(), o.given.end(), name) != o.given.end();
}

// Every training run ends with a checkpoint unless it is told not to: --no-checkpoint, or an
// explicit --checkpoint-every 0 (the default 0 means "only at the end").
inline bool end_checkpoint(const TrainOptions& o) {
    return !o.no_checkpoint && !(o.checkpoint_every == 0 && flag_given(o, "checkpoint-every"));
}

// --generate or --prompt-file: the trainer generates from a prompt and exits (llmc/run/generate.h).
inline bool generation_mode(const TrainOptions& o) { return flag_given(o, "generate") || flag_given(o, "prompt-file"); }

// --moe-capacity-factor as a number: none is 0 (no dropping); NaN for text that is not a number.
inline float moe_capacity_factor_value(const TrainOptions& o) {
    if (o.moe_capacity_factor == "none") return 0.0f;
    char* end = nullptr;
    float f = strtof(o.moe_capacity_factor.c_str(), &end);
    return (o.moe_capacity_factor.empty() || *end) ? NAN : f;
}

// The MoE flags' checks that need neither the model nor the layer (the shape's own, top-2 of one
// expert and the like, are moe_shape_problem's in llmc/model/moe.h; the combinations the MoE blocks
// are not built for are rows of llmc/run/compatibility.h), each named with its way out.
inline void validate_moe_options(const TrainOptions& o) {
    if (o.moe_experts < 0) usage_fail("--moe-experts must be 0 (dense) or a positive number of experts, got %d", o.moe_experts);
    if (o.moe_every < 1) usage_fail("--moe-every must be at least 1 (1: every block is an MoE block), got %d", o.moe_every);
    if (std::isnan(moe_capacity_factor_value(o)))
        usage_fail("--moe-capacity-factor must be none, 0 (no dropping) or a positive number, got '%s'", o.moe_capacity_factor.c_str());
    if (o.moe_experts == 0) {
        for (const char* flag : {"moe-top-k", "moe-every", "moe-capacity-factor", "moe-aux-alpha", "moe-z-loss", "expert-parallel"})
            if (flag_given(o, flag)) usage_fail("--%s shapes MoE blocks, and there are none: add --moe-experts E, or drop it", flag);
        return;
    }
    if (o.expert_parallel < 1 || o.moe_experts % o.expert_parallel != 0)
        usage_fail("--expert-parallel %d: the %d experts of a block must split evenly over the ranks; pick a divisor of --moe-experts "
                   "(1 = no split)", o.expert_parallel, o.moe_experts);
}

// --precision names the binary's own element type or is refused, naming the binary that has the one
// asked for. The type is a compile-time choice (floatX in llmc/kernels/cuda_common.cuh: every kernel
// is compiled for it), not a run-time switch: one binary per precision keeps the kernels free of
// branches on the type, and a script that asks for a precision fails at once on the wrong binary
// instead of training in another one. `built` is "bf16" or "fp32".
inline void validate_precision(const TrainOptions& o, Trainer trainer, const char* built) {
    const std::string& p = o.precision;
    // the loss scaler's flags mean something in the fp16 build only (bf16 and fp32 run at S = 1)
    if ((o.loss_scale_init != 0 || o.loss_scale_window != 0) && strcmp(built, "fp16") != 0)
        usage_fail("--loss-scale-init and --loss-scale-window set fp16's loss scaler; this binary is built for %s, which "
                   "needs none: run ./train_gpt_fp16, or drop them", built);
    if (o.fp8_amax_history != 0 && p != "fp8")
        usage_fail("--fp8-amax-history sets fp8's delayed scaling: add --precision fp8, or drop it");
    if (o.fp8_amax_history < 0 || o.fp8_amax_history > 1024)
        usage_fail("--fp8-amax-history must be 1..1024 (0 = 16), got %d", o.fp8_amax_history);
    if (p.empty() || p == built) return;
    // a run-time choice of the bf16 build: its four linear layers' matmuls (llmc/kernels/fp8.cuh); the trainer and
    // the builds it does not run in are rows of llmc/run/compatibility.h
    if (p == "fp8") return;
    if (p != "bf16" && p != "fp16" && p != "fp32")
        usage_fail("--precision must be bf16, fp16, fp32 or fp8, got '%s'", p.c_str());
    if (p == "fp16" && trainer == Trainer::CPU)
        usage_fail("--precision fp16: the CPU trainer computes in fp32 only, where loss scaling means nothing; drop "
                   "--precision, or run ./train_gpt_fp16 (fp16 with dynamic loss scaling)");
    const char* binary = p == "bf16"   ? "./train_gpt (the GPU trainer)"
                         : p == "fp16" ? "./train_gpt_fp16"
                         : trainer == Trainer::GPU ? "./train_gpt_fp32" : "";
    if (trainer == Trainer::CPU)
        usage_fail("--precision %s: the CPU trainer computes in fp32 only; run %s, or drop --precision", p.c_str(), binary);
    usage_fail("--precision %s: this binary is built for %s; run %s, or drop --precision", p.c_str(), built, binary);
}

inline void flag_positive(const char* name, long long v) {
    if (v <= 0) usage_fail("--%s must be positive, got %lld", name, v);
}
inline void flag_non_negative(const char* name, long long v) {
    if (v < 0) usage_fail("--%s must be zero or positive, got %lld", name, v);
}

// The run: batch, steps, evaluation, samples, checkpoints.
inline void validate_run_options(const TrainOptions& o) {
    flag_positive("batch-size", o.batch_size);
    flag_non_negative("seq-len", o.seq_len);
    flag_non_negative("total-batch-tokens", o.total_batch_tokens);
    flag_non_negative("steps", o.steps);
    flag_non_negative("warmup-steps", o.warmup_steps);
    flag_non_negative("val-every", o.val_every);
    flag_non_negative("val-tokens", o.val_tokens);
    if (flag_given(o, "val-batches")) flag_positive("val-batches", o.val_batches);
    if (flag_given(o, "val-batches") && flag_given(o, "val-tokens"))
        usage_fail("--val-batches and --val-tokens both size the validation: pass --val-tokens N alone");
    flag_non_negative("sample-every", o.sample_every);
    flag_non_negative("sample-tokens", o.sample_tokens);
    flag_non_negative("top-k", o.top_k);
    flag_non_negative("checkpoint-every", o.checkpoint_every);
    flag_non_negative("keep-checkpoints", o.keep_checkpoints);
    flag_non_negative("more-steps", o.more_steps);
    if (o.no_checkpoint && o.checkpoint_every > 0)
        usage_fail("--no-checkpoint and --checkpoint-every %d contradict each other: pass one of them", o.checkpoint_every);
    flag_non_negative("hellaswag-every", o.hellaswag_every);
    if (o.hellaswag_every > 0 && o.hellaswag.empty()) usage_fail("--hellaswag-every needs --hellaswag FILE, the examples to evaluate");
    if (o.eval_only && o.hellaswag.empty() && o.val_data == "none") {
        usage_fail("--eval-only has nothing to evaluate: give --val-data shards or a --hellaswag file");
    }
    flag_non_negative("threads", o.threads);
}

// The optimizer and its schedule.
inline void validate_optimizer_options(const TrainOptions& o) {
    if (o.lr < 0) usage_fail("--lr must be zero or positive, got %g", o.lr);
    if (o.final_lr_fraction < 0 || o.final_lr_fraction > 1) usage_fail("--final-lr-fraction must be in [0, 1], got %g", o.final_lr_fraction);
    if (o.decay_fraction < 0 || o.decay_fraction > 1) usage_fail("--decay-fraction must be in [0, 1], got %g", o.decay_fraction);
    if (o.beta1 < 0 || o.beta1 >= 1) usage_fail("--beta1 must be in [0, 1), got %g", o.beta1);
    if (o.beta2 < 0 || o.beta2 >= 1) usage_fail("--beta2 must be in [0, 1), got %g", o.beta2);
    if (o.adam_eps <= 0) usage_fail("--adam-eps must be positive, got %g", o.adam_eps);
    if (o.optimizer != "adamw" && o.optimizer != "adafactor" && o.optimizer != "sm3") {
        usage_fail("--optimizer must be adamw, adafactor or sm3, got '%s'", o.optimizer.c_str());
    }
    if (o.optimizer_state != "fp32" && o.optimizer_state != "bf16") {
        usage_fail("--optimizer-state must be fp32 or bf16, got '%s'", o.optimizer_state.c_str());
    }
    if (o.optimizer != "adamw") {  // factored state is per whole matrix (llmc/optim/optimizer_state.h)
        const char* name = o.optimizer.c_str();
        for (const char* adam_only : {"beta1", "beta2", "adam-eps"})
            if (flag_given(o, adam_only))
                usage_fail("--%s is AdamW's; --optimizer %s has no such setting (adafactor: beta1 = 0, beta2_t = 1 - t^-0.8, "
                           "eps1 = 1e-30; sm3: none): drop it", adam_only, name);
    }
    if (o.weight_decay < 0) usage_fail("--weight-decay must be zero or positive, got %g", o.weight_decay);
    if (o.grad_clip < 0) usage_fail("--grad-clip must be zero or positive, got %g", o.grad_clip);
    if (o.max_bad_steps < 1) usage_fail("--max-bad-steps must be at least 1 (1: stop at the first bad step), got %d", o.max_bad_steps);
}

// --generate and the samples.
inline void validate_generation_options(const TrainOptions& o) {
    if (o.temperature < 0) usage_fail("--temperature must be zero or positive, got %g", o.temperature);
    if (!(o.top_p > 0 && o.top_p <= 1)) usage_fail("--top-p must be in (0, 1], got %g", o.top_p);
    flag_positive("num-samples", o.num_samples);
    if (o.kv_cache != 0 && o.kv_cache != 1) usage_fail("--kv-cache must be 0 or 1, got %d", o.kv_cache);
    bool prompt_given = flag_given(o, "generate"), file_given = flag_given(o, "prompt-file");
    if (prompt_given && file_given) usage_fail("--generate and --prompt-file both give a prompt: pass one of them");
    if (prompt_given && o.generate.empty()) usage_fail("--generate: the prompt is empty; give some text to continue");
    if (o.json && !prompt_given && !file_given) usage_fail("--json prints generated samples: it needs --generate TEXT or --prompt-file FILE");
}

// Memory: recompute, the stash, master weights, offload.
inline void validate_memory_options(const TrainOptions& o) {
    if (o.recompute < 0 || o.recompute > 2) usage_fail("--recompute must be 0, 1 or 2, got %d", o.recompute);
    if (o.stash_precision != "fp32" && o.stash_precision != "bf16" && o.stash_precision != "fp8")
        usage_fail("--stash-precision must be fp32, bf16 (CPU trainer) or fp8 (GPU trainer), got '%s'", o.stash_precision.c_str());
    if (o.master_weights != 0 && o.master_weights != 1) usage_fail("--master-weights must be 0 or 1, got %d", o.master_weights);
    if (o.offload != "none" && o.offload != "optimizer") usage_fail("--offload must be none or optimizer, got '%s'", o.offload.c_str());
    if (o.offload_delay != 0 && o.offload_delay != 1) usage_fail("--offload-delay must be 0 or 1, got %d", o.offload_delay);
    if (o.offload_bucket_layers < 0) usage_fail("--offload-bucket-layers must be 0 or more, got %d", o.offload_bucket_layers);
    for (const char* flag : {"offload-delay", "offload-bucket-layers"})
        if (flag_given(o, flag) && o.offload != "optimizer")
            usage_fail("--%s shapes --offload optimizer's step: give --offload optimizer too, or drop it", flag);
    flag_positive("offload-chunk-kib", o.offload_chunk_kib);
    if (o.offload_chunk_kib > (1 << 22)) usage_fail("--offload-chunk-kib %d is over 4 GiB: the buffer holds 4 chunks; give at most 4194304", o.offload_chunk_kib);
    if (flag_given(o, "offload-chunk-kib") && o.offload_dir.empty())
        usage_fail("--offload-chunk-kib sizes --offload-dir's chunks: give --offload-dir DIR too, or drop it");
}

// The attention path, --estimate and --plan.
inline void validate_estimate_options(const TrainOptions& o) {
    if (o.attention != "cudnn" && o.attention != "simple") usage_fail("--attention must be cudnn or simple, got '%s'", o.attention.c_str());
    if (o.estimate_memory_gib < 0) usage_fail("--estimate-memory-gib must be zero or positive, got %g", o.estimate_memory_gib);
    if (o.estimate_mfu <= 0 || o.estimate_mfu > 1) usage_fail("--estimate-mfu must be in (0, 1], got %g", o.estimate_mfu);
    if (o.estimate_peak_tflops < 0) usage_fail("--estimate-peak-tflops must be zero or positive, got %g", o.estimate_peak_tflops);
    flag_positive("estimate-ranks", o.estimate_ranks);
    if (flag_given(o, "plan") && o.plan < 1) usage_fail("--plan needs at least 1 rank to plan for, got %d", o.plan);
    if (o.plan > 0 && o.estimate) usage_fail("--plan and --estimate both print a prediction and exit: pass one of them");
    if (o.plan > 0 && (o.eval_only || generation_mode(o))) {
        usage_fail("--plan prints the ranked grids and exits: it does not %s; drop one of them", o.eval_only ? "evaluate (--eval-only)" : "generate");
    }
    if (o.plan_tflops < 0) usage_fail("--plan-tflops must be zero (the default) or positive, got %g", o.plan_tflops);
    if (o.plan_bandwidth < 0) usage_fail("--plan-bandwidth must be zero (the default) or positive, got %g", o.plan_bandwidth);
    if (o.plan_node_bandwidth < 0) usage_fail("--plan-node-bandwidth must be zero (the default) or positive, got %g", o.plan_node_bandwidth);
    flag_non_negative("plan-node-size", o.plan_node_size);
    if (o.plan_latency < 0 && o.plan_latency != -1)
        usage_fail("--plan-latency must be -1 (the default), 0 (no latency term) or positive microseconds, got %g", o.plan_latency);
}

// Parallelism: the grid, the pipeline schedule, gradient compression, communication.
inline void validate_parallel_options(const TrainOptions& o) {
    if (o.zero_stage < 0 || o.zero_stage > 3) usage_fail("--zero must be 0, 1, 2 or 3, got %d", o.zero_stage);
    if (o.tensor_parallel < 1) usage_fail("--tensor-parallel must be at least 1, got %d", o.tensor_parallel);
    if (o.pipeline_parallel < 1) usage_fail("--pipeline-parallel must be at least 1, got %d", o.pipeline_parallel);
    if (o.sequence_parallel != 0 && o.sequence_parallel != 1) usage_fail("--sequence-parallel must be 0 or 1, got %d", o.sequence_parallel);
    if (o.pipeline_schedule != "gpipe" && o.pipeline_schedule != "1f1b" && o.pipeline_schedule != "interleaved" &&
        o.pipeline_schedule != "zb-h1" && o.pipeline_schedule != "2bw" && o.pipeline_schedule != "2bw-flush")
        usage_fail("--pipeline-schedule must be gpipe, 1f1b, interleaved, zb-h1, 2bw or 2bw-flush, got '%s'", o.pipeline_schedule.c_str());
    bool interleaved = o.pipeline_schedule == "interleaved";
    if (o.virtual_stages < 1) usage_fail("--virtual-stages must be at least 1, got %d", o.virtual_stages);
    if (!interleaved && o.virtual_stages > 1)
        usage_fail("--virtual-stages %d needs --pipeline-schedule interleaved (%s has one chunk per stage): add it, or drop --virtual-stages",
                   o.virtual_stages, o.pipeline_schedule.c_str());
    if (interleaved && o.virtual_stages < 2)
        usage_fail("--pipeline-schedule interleaved needs --virtual-stages 2 or more (with one chunk per stage it is 1f1b)");
    if (o.max_memory_mib < 0) usage_fail("--max-memory must be zero or positive, got %g", o.max_memory_mib);
    if (o.grad_compression != "none" && o.grad_compression != "bf16" && o.grad_compression != "powersgd") {
        usage_fail("--grad-compression must be none, bf16 or powersgd, got '%s'", o.grad_compression.c_str());
    }
    if (o.data_parallel != "allreduce" && o.data_parallel != "server")
        usage_fail("--data-parallel must be allreduce or server, got '%s'", o.data_parallel.c_str());
    if (o.powersgd_rank < 1) usage_fail("--powersgd-rank must be at least 1 (the rank of each approximation), got %d", o.powersgd_rank);
    flag_non_negative("powersgd-start-step", o.powersgd_start_step);
    if (o.comm_timeout < 0) usage_fail("--comm-timeout must be zero or positive, got %g", o.comm_timeout);
}

// Range checks, one flag at a time, section by section; those that need the model (seq-len <= maxT)
// live in the trainers, and which techniques combine is llmc/run/compatibility.h's table.
inline void validate_options(const TrainOptions& o) {
    validate_run_options(o);
    validate_optimizer_options(o);
    validate_generation_options(o);
    validate_memory_options(o);
    validate_estimate_options(o);
    validate_parallel_options(o);
    validate_moe_options(o);
}
