// training.h — the bookkeeping of a training run, shared by the CPU and the GPU trainer.
//
// Everything about a run that is not arithmetic on tensors: where the model comes from (a
// checkpoint, a file, or a fresh initialisation), the batch geometry (micro-batch, accumulation,
// tokens per step), the learning-rate schedule, checkpoint directories and how they are published
// atomically, the one-line step report, and the --dump-state file the tests read. The trainers
// differ in how they compute a step; they must not differ in any of this.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>
#include <vector>
#include "llmc/run/cli.h"
#include "llmc/io/dataloader.h"
#include "llmc/io/formats.h"
#include "llmc/model/model.h"
#include "llmc/io/safetensors.h"
#include "llmc/optim/schedule.h"
#include "llmc/io/tokenizer.h"
#include "llmc/parallel/sharding.h"
#include "llmc/utils.h"

// ----------------------------------------------------------------------------------------------
// Checkpoint checksums

// Checksums: a checkpoint's files can still be damaged after they were written whole (a bad disk, a
// copy between machines cut short, a byte flipped). So before publishing, rank 0 reads every file of
// the directory back (from the page cache, as a rule) and writes checksums.txt, a line per file:
// "<hash, 16 hex digits> <bytes> <name>". Loading verifies it; a checkpoint without it (written
// before it existed) loads unverified. The hash is FNV-1a over 64-bit little-endian words (then
// the tail bytes): not cryptographic, one multiply per 8 bytes, and any flipped bit changes it.
inline uint64_t checksum_update(uint64_t h, const unsigned char* p, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h = (h ^ w) * 0x100000001b3ull;
    }
    for (; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

// The file's checksum and size (a read of 1 MiB at a time), or false when it cannot be read.
inline bool file_checksum(const std::string& path, uint64_t* hash, int64_t* bytes) {
    FILE* f = fopen(path.c_str(), "rb");
    if (!f) return false;
    std::vector<unsigned char> buffer(1 << 20);
    uint64_t h = 0xcbf29ce484222325ull;
    int64_t total = 0;
    size_t n;
    // (8-byte words of each chunk: the chunk size is a multiple of 8, so the words are the file's)
    while ((n = fread(buffer.data(), 1, buffer.size(), f)) > 0) h = checksum_update(h, buffer.data(), n), total += (int64_t)n;
    bool ok = !ferror(f);
    fclose(f);
    *hash = h, *bytes = total;
    return ok;
}

constexpr const char* CHECKSUM_FILE = "checksums.txt";

inline void write_checkpoint_checksums(const std::string& dir) {
    std::string lines;
    for (const std::string& path : expand_glob(dir + "/*")) {
        std::string name = path.substr(path.rfind('/') + 1);
        if (name == CHECKSUM_FILE || !file_exists(path)) continue;
        uint64_t h;
        int64_t n;
        if (!file_checksum(path, &h, &n)) fail("cannot read back '%s' to checksum it", path.c_str());
        lines += strprintf("%016llx %lld %s\n", (unsigned long long)h, (long long)n, name.c_str());
    }
    AtomicFile out(dir + "/" + CHECKSUM_FILE, "checksum file");
    out.write(lines.data(), lines.size());
    out.commit();
}

// "" when every file listed in dir/checksums.txt has its size and hash (or there is no list), else
// what is wrong, naming the file.
inline std::string checkpoint_checksum_problem(const std::string& dir) {
    FILE* f = fopen((dir + "/" + CHECKSUM_FILE).c_str(), "r");
    if (!f) return "";
    char line[1024];
    std::string problem;
    while (problem.empty() && fgets(line, sizeof(line), f)) {
        unsigned long long want_hash;
        long long want_bytes;
        char name[512];
        if (sscanf(line, "%16llx %lld %511s", &want_hash, &want_bytes, name) != 3) {
            problem = strprintf("%s has a line it cannot read", CHECKSUM_FILE);
            break;
        }
        uint64_t h;
        int64_t n;
        if (!file_checksum(dir + "/" + name, &h, &n)) problem = strprintf("%s is missing", name);
        else if (n != want_bytes) problem = strprintf("%s has %lld bytes, %s says %lld", name, (long long)n, CHECKSUM_FILE, want_bytes);
        else if (h != want_hash) problem = strprintf("%s does not match its checksum (damaged bytes)", name);
    }
    fclose(f);
    return problem;
}

// ----------------------------------------------------------------------------------------------
// The model to start from

// Resolves --resume to a checkpoint directory ("" when not resuming). 'auto' is what a script that
// may be interrupted and rerun wants: the newest checkpoint if there is one, else a fresh start.
// `announce`: the rank that prints says which newer checkpoints it skipped, and why.
inline std::string latest_checkpoint(const std::string& out_dir, bool announce = false);
inline std::string resolve_resume_dir(const TrainOptions& o, bool announce = false) {
    if (o.resume.empty()) return "";
    if (o.resume == "auto") return latest_checkpoint(o.out_dir, announce);
    std::string dir = o.resume == "latest" ? latest_checkpoint(o.out_dir, announce) : o.resume;
    if (dir.empty()) fail("--resume latest: there is no complete checkpoint in '%s'", o.out_dir.c_str());
    if (!dir_exists(dir)) fail("--resume '%s': no such checkpoint directory", dir.c_str());
    std::string problem = o.resume == "latest" ? "" : checkpoint_checksum_problem(dir);  // (latest verified it)
    if (!problem.empty()) fail("--resume '%s': %s; resume from another checkpoint", dir.c_str(), problem.c_str());
    return dir;
}

// Loads the weights from the checkpoint (when resuming) or --model (a file or a descriptor), as fp32
// on the host. Returns a description of where they came from, for the log.
inline std::string load_initial_model(const TrainOptions& o, const std::string& resume_dir, GPT2Config* cfg,
                                      std::vector<float>* params) {
    if (resume_dir.empty() && parse_model_descriptor(o.model, cfg)) {
        std::string why;
        if (!config_is_valid(*cfg, &why)) usage_fail("--model %s: %s", o.model.c_str(), why.c_str());
        params->assign(param_layout(*cfg).total, 0.0f);
        init_gpt2_params(*cfg, o.seed, params->data(), 0, params->size());
        return "new " + o.model + ", seed " + std::to_string(o.seed);
    }
    std::string path = resume_dir.empty() ? o.model : resume_dir + "/model.bin";
    if (!file_exists(path)) {
        fail("--model '%s' is neither a model file nor a descriptor (d12, d24, L=2,C=64,H=4, ...)", path.c_str());
    }
    read_model_file(path, cfg, params);
    return path;
}

// The model's shape, from the checkpoint (when resuming), a model file, or a descriptor, without
// reading any weights (a rank of a process grid reads only its slice of them). Sets *new_model when
// the weights are to be initialised. Returns a description of the source, for the log.
inline std::string load_model_config(const TrainOptions& o, const std::string& resume_dir, GPT2Config* cfg, bool* new_model) {
    *new_model = resume_dir.empty() && parse_model_descriptor(o.model, cfg);
    if (*new_model) {
        std::string why;
        if (!config_is_valid(*cfg, &why)) usage_fail("--model %s: %s", o.model.c_str(), why.c_str());
        return "new " + o.model + ", seed " + std::to_string(o.seed);
    }
    std::string path = resume_dir.empty() ? o.model : resume_dir + "/model.bin";
    if (!file_exists(path)) {
        fail("--model '%s' is neither a model file nor a descriptor (d12, d24, L=2,C=64,H=4, ...)", path.c_str());
    }
    *cfg = read_model_header(path).config;
    return path;
}

// ----------------------------------------------------------------------------------------------
// Batch geometry and schedule

struct RunPlan {
    int B = 0, T = 0;                   // micro-batch per rank
    int world_size = 1;                 // data-parallel ranks
    int64_t total_batch_tokens = 0;     // tokens per optimizer step, all ranks together
    int accumulation_steps = 1;         // micro-batches per rank per step
    int steps = 0;
    ScheduleConfig schedule;
};

inline RunPlan plan_run(const TrainOptions& o, const GPT2Config& cfg, int world_size, int64_t train_tokens_per_epoch) {
    RunPlan r;
    r.B = o.batch_size;
    r.T = o.seq_len > 0 ? o.seq_len : cfg.max_seq_len;
    r.world_size = world_size;
    if (r.T > cfg.max_seq_len) usage_fail("--seq-len %d exceeds the model's maximum sequence length %d", r.T, cfg.max_seq_len);
    int64_t tokens_per_micro_step = (int64_t)r.B * r.T * world_size;
    r.total_batch_tokens = o.total_batch_tokens > 0 ? o.total_batch_tokens : tokens_per_micro_step;
    if (r.total_batch_tokens % tokens_per_micro_step != 0) {
        usage_fail("--total-batch-tokens %lld is not a multiple of B*T*ranks = %d*%d*%d = %lld", (long long)r.total_batch_tokens,
                   r.B, r.T, world_size, (long long)tokens_per_micro_step);
    }
    r.accumulation_steps = (int)(r.total_batch_tokens / tokens_per_micro_step);
    r.steps = o.steps > 0 ? o.steps : (int)std::max<int64_t>(1, train_tokens_per_epoch / r.total_batch_tokens);
    if (!parse_lr_schedule(o.lr_schedule, &r.schedule.kind)) {
        usage_fail("--lr-schedule '%s' is not one of cosine, linear, constant, wsd", o.lr_schedule.c_str());
    }
    r.schedule.max_lr = o.lr;
    r.schedule.warmup_steps = o.warmup_steps;
    r.schedule.total_steps = r.steps;
    r.schedule.final_lr_fraction = o.final_lr_fraction;
    r.schedule.decay_fraction = o.decay_fraction;
    return r;
}

// ----------------------------------------------------------------------------------------------
// Checkpoints: out_dir/ckpt_00001000/{model.bin, state.bin} (state_rank<r>.bin with ZeRO-1)

// The start-up lines both trainers print about their data and, after a resume on another grid,
// about the resharding. `val` is null without validation data; `train` is unused with --eval-only.
inline std::string describe_data(const DataLoader& train, const DataLoader* val, bool eval_only) {
    std::string out;
    if (!eval_only) out = strprintf("data: %zu training shard%s (%lld tokens)", train.files.size(),
                                    train.files.size() == 1 ? "" : "s", (long long)train.tokens_per_epoch);
    if (val) out += strprintf("%s%zu validation shard%s", eval_only ? "data: " : ", ", val->files.size(), val->files.size() == 1 ? "" : "s");
    return out + "\n";
}
// Empty when the checkpoint was written by the grid (ranks, ZeRO stage, tensor x pipeline) of this run.
inline std::string describe_reshard(const TrainStateHeader& written, int world, int zero_stage, int tp, int pp) {
    int old_tp = std::max(1, (int)written.tensor_parallel), old_pp = std::max(1, (int)written.pipeline_parallel);
    if (written.world_size == world && written.zero_stage == zero_stage && old_tp == tp && old_pp == pp) return "";
    auto grid_of = [](int t, int p) { return t > 1 || p > 1 ? strprintf(" (tp %d x pp %d)", t, p) : std::string(); };
    return strprintf("resharded: the checkpoint was written by %d rank%s with ZeRO-%d%s, this run has %d with ZeRO-%d%s\n",
                     (int)written.world_size, written.world_size == 1 ? "" : "s", (int)written.zero_stage,
                     grid_of(old_tp, old_pp).c_str(), world, zero_stage, grid_of(tp, pp).c_str());
}

inline std::string checkpoint_dir(const std::string& out_dir, int step) {
    return out_dir + strprintf("/ckpt_%08d", step);
}

// What a checkpoint directory lacks to be resumed from ("" when nothing): the weights (model.bin) or
// the training state (state.bin, or state_rank0.bin and the other ranks' files it names). The rename
// protocol below never publishes a partial checkpoint, but a disk that filled up, a copy interrupted
// by hand or a deleted file can leave one; model.bin and the state are missing alike.
inline std::string checkpoint_missing(const std::string& dir) {
    if (!file_exists(dir + "/model.bin")) return "no model.bin";
    if (file_exists(dir + "/state.bin")) return "";
    if (!file_exists(dir + "/state_rank0.bin")) return "no state.bin or state_rank0.bin";
    FILE* f = fopen((dir + "/state_rank0.bin").c_str(), "rb");
    TrainStateHeader h;
    bool read = f && fread(&h, sizeof(h), 1, f) == 1;
    if (f) fclose(f);
    if (!read || h.magic != STATE_MAGIC || h.world_size < 1 || h.world_size > (1 << 20)) return "a damaged state_rank0.bin";
    for (int r = 1; r < h.world_size; r++)
        if (!file_exists(dir + strprintf("/state_rank%d.bin", r))) return strprintf("no state_rank%d.bin", r);
    return "";
}

// Why a checkpoint directory cannot be resumed from ("" when it can): a file missing, or one that
// does not match its checksum.
inline std::string checkpoint_problem(const std::string& dir) {
    std::string missing = checkpoint_missing(dir);
    return missing.empty() ? checkpoint_checksum_problem(dir) : missing + " (incomplete)";
}

// The newest complete checkpoint in out_dir, or "" (directories still named *.tmp are incomplete).
inline std::string latest_checkpoint(const std::string& out_dir, bool announce) {
    std::vector<std::string> found;
    for (const std::string& path : expand_glob(out_dir + "/ckpt_*")) {
        std::string name = path.substr(path.rfind('/') + 1);
        if (name.size() == 13 && dir_exists(path)) found.push_back(path);
    }
    for (size_t i = found.size(); i-- > 0;) {  // sorted: the last is the newest
        std::string problem = checkpoint_problem(found[i]);
        if (problem.empty()) return found[i];
        if (announce) printf("resume: skipping %s: %s\n", found[i].c_str(), problem.c_str());
    }
    return "";
}

// A checkpoint is written into "<dir>.tmp" and then renamed to <dir>: the rename is atomic, so a
// checkpoint directory either exists complete or not at all, and a crash mid-write loses nothing.
inline std::string begin_checkpoint(const std::string& out_dir, int step) {
    std::string tmp = checkpoint_dir(out_dir, step) + ".tmp";
    if (dir_exists(tmp) && system(("rm -rf '" + tmp + "'").c_str()) != 0) fail("cannot clear '%s'", tmp.c_str());
    make_dirs(tmp);
    return tmp;
}

inline std::string publish_checkpoint(const std::string& out_dir, int step) {
    std::string dir = checkpoint_dir(out_dir, step), tmp = dir + ".tmp", old = dir + ".old";
    if (dir_exists(dir)) {  // a checkpoint of the same step from an earlier run: set it aside first
        if (system(("rm -rf '" + old + "'").c_str()) != 0 || rename(dir.c_str(), old.c_str()) != 0)
            fail("cannot replace the existing checkpoint '%s'", dir.c_str());
    }
    if (rename(tmp.c_str(), dir.c_str()) != 0) fail("cannot move checkpoint into place at '%s': %s", dir.c_str(), strerror(errno));
    if (dir_exists(old) && system(("rm -rf '" + old + "'").c_str()) != 0) fprintf(stderr, "warning: could not remove '%s'\n", old.c_str());
    return dir;
}

// A checkpoint of several ranks, in three steps (`barrier(what)` is the run's barrier: MPI on the
// CPU, MPI or NCCL on GPUs):
//   1. open_checkpoint_together: rank 0 creates "<ckpt>.tmp"; a barrier; every rank checks that it
//      sees the directory (with several nodes --out-dir must be on a filesystem they all share);
//   2. each rank writes its own files into it (the trainer);
//   3. publish_checkpoint_together: a barrier, then rank 0 renames the directory into place.
// A crash at any point leaves either no new checkpoint or a complete one.
template <class Barrier>
inline std::string open_checkpoint_together(const std::string& out_dir, int step, int rank, Barrier barrier) {
    std::string tmp = checkpoint_dir(out_dir, step) + ".tmp";
    if (rank == 0) begin_checkpoint(out_dir, step);
    barrier("the barrier after creating the checkpoint directory");
    if (!dir_exists(tmp)) {
        fail("rank %d cannot see the checkpoint directory '%s' that rank 0 created: with several nodes, --out-dir "
             "must be on a filesystem that every node shares", rank, tmp.c_str());
    }
    return tmp;
}

template <class Barrier>
inline void publish_checkpoint_together(const std::string& out_dir, int step, int rank, Barrier barrier) {
    barrier("the barrier after writing the checkpoint");
    if (rank == 0) {
        write_checkpoint_checksums(checkpoint_dir(out_dir, step) + ".tmp");
        printf("checkpoint: %s\n", publish_checkpoint(out_dir, step).c_str());
    }
}

// The header of one rank's training-state file: the slice of the optimizer state it holds, who wrote
// it, and where the run stands (has_master_weights is the caller's to set).
inline TrainStateHeader train_state_header(int step, size_t num_params, ShardRange slice, int rank, int world_size,
                                           int zero_stage, const RunPlan& plan, uint64_t sampler_rng,
                                           const LoaderPosition& train_loader) {
    TrainStateHeader h;
    h.step = step;
    h.num_params = (int64_t)num_params;
    h.shard_begin = (int64_t)slice.begin;
    h.shard_count = (int64_t)slice.size();
    h.rank = rank;
    h.world_size = world_size;
    h.zero_stage = zero_stage;
    h.batch_size = plan.B;
    h.seq_len = plan.T;
    h.total_batch_tokens = plan.total_batch_tokens;
    h.sampler_rng = sampler_rng;
    h.train_loader = train_loader;
    return h;
}

// The optimizer state of a checkpoint is in one file, state.bin, when one rank held all of it
// (ZeRO-0 data parallelism, any number of ranks), or in one file per rank, state_rank<r>.bin, each
// holding what that rank owned: its ZeRO shard, or on a grid with tensor or pipeline parallelism a
// list of runs of the global parameter array. Every file's header says which elements it holds.
inline std::string state_file_name(int zero_stage, int rank) {
    return zero_stage == 0 ? "state.bin" : strprintf("state_rank%d.bin", rank);
}

// The state files of a checkpoint directory, in rank order.
inline std::vector<std::string> checkpoint_state_files(const std::string& dir) {
    std::vector<std::string> files;
    if (file_exists(dir + "/state.bin")) {
        files.push_back(dir + "/state.bin");
    } else if (file_exists(dir + "/state_rank0.bin")) {
        FILE* f = open_for_reading(dir + "/state_rank0.bin", "training-state file");
        TrainStateHeader h0 = read_train_state_header(f, dir + "/state_rank0.bin");
        fclose(f);
        for (int r = 0; r < h0.world_size; r++) files.push_back(dir + "/" + state_file_name(1, r));
    } else {
        fail("checkpoint '%s' has no training state (neither state.bin nor state_rank0.bin): it is incomplete; "
             "resume from an earlier checkpoint", dir.c_str());
    }
    return files;
}

// Global elements [global, global + count) of m, v and the weights go to index `dst` of the arrays
// a rank passes (its own storage order).
struct WantedRun {
    size_t global, count, dst;
};

// Reads AdamW's m and v and the weights (`master`; only from files that hold them) for the wanted
// elements from a checkpoint, however it was cut: the files' runs together must cover every
// parameter exactly once, and this rank reads from each file the parts that overlap what it wants.
// So a run may resume on another grid (world size, ZeRO stage, tensor or pipeline degree); on the
// same grid each rank simply reads its own file whole. Null arrays are skipped. Returns the first
// file's header (has_master_weights: whether the weights came from the state files).
inline TrainStateHeader read_state_runs(const std::string& dir, size_t num_params, std::vector<WantedRun> wanted, float* m,
                                        float* v, float* master) {
    struct FileRun { size_t global, count, at; int file; };
    std::vector<std::string> files = checkpoint_state_files(dir);
    std::vector<TrainStateHeader> headers;
    std::vector<FileRun> runs;
    for (size_t i = 0; i < files.size(); i++) {
        TrainState table;  // header and run table only
        FILE* f = open_for_reading(files[i], "training-state file");
        table.header = read_train_state_header(f, files[i]);
        const TrainStateHeader& h = table.header;
        table.runs = read_state_run_table(f, h, files[i]);
        fclose(f);
        if (h.num_params != (int64_t)num_params) {
            fail("checkpoint '%s' holds optimizer state for %lld parameters, the model has %zu", dir.c_str(),
                 (long long)h.num_params, num_params);
        }
        if (i > 0 && (h.step != headers[0].step || h.world_size != headers[0].world_size)) {
            fail("training-state file '%s' does not belong with the others in '%s' (step %lld of %d ranks; expected step %lld "
                 "of %d): the checkpoint is mixed up", files[i].c_str(), dir.c_str(), (long long)h.step, h.world_size,
                 (long long)headers[0].step, headers[0].world_size);
        }
        size_t at = 0;
        for (size_t k = 0; k < table.runs.size(); k += 2) {
            size_t g = (size_t)table.runs[k], n = (size_t)table.runs[k + 1];
            if (n > 0) runs.push_back({g, n, at, (int)i});
            at += n;
        }
        headers.push_back(h);
    }
    // the files must tile [0, num_params): no gap, no overlap
    std::sort(runs.begin(), runs.end(), [](const FileRun& a, const FileRun& b) { return a.global < b.global; });
    size_t covered = 0;
    for (const FileRun& r : runs) {
        if (r.global != covered) {
            fail("the training state in '%s' %s at parameter %zu (%s): the checkpoint is incomplete or mixed up", dir.c_str(),
                 r.global > covered ? "has a gap" : "holds some parameters twice", covered, files[(size_t)r.file].c_str());
        }
        covered += r.count;
    }
    if (covered != num_params) {
        fail("the training state in '%s' covers %zu of %zu parameters: the checkpoint is incomplete", dir.c_str(), covered, num_params);
    }
    // read every overlap of a wanted run with a file's run
    std::vector<FILE*> open(files.size(), nullptr);
    std::sort(wanted.begin(), wanted.end(), [](const WantedRun& a, const WantedRun& b) { return a.global < b.global; });
    for (const WantedRun& w : wanted) {
        auto it = std::upper_bound(runs.begin(), runs.end(), w.global, [](size_t g, const FileRun& r) { return g < r.global; });
        if (it != runs.begin()) --it;
        for (; it != runs.end() && it->global < w.global + w.count; ++it) {
            size_t lo = std::max(w.global, it->global), hi = std::min(w.global + w.count, it->global + it->count);
            if (lo >= hi) continue;
            const TrainStateHeader& h = headers[(size_t)it->file];
            const std::string& path = files[(size_t)it->file];
            FILE*& f = open[(size_t)it->file];
            if (!f) f = open_for_reading(path, "training-state file");
            float* dst[3] = {m, v, h.has_master_weights ? master : nullptr};
            for (int array = 0; array < 3; array++) {
                if (!dst[array]) continue;
                long at = (long)(sizeof(TrainStateHeader) + state_table_bytes(h) +
                                 ((size_t)array * h.shard_count + it->at + (lo - it->global)) * 4);
                if (fseek(f, at, SEEK_SET) != 0) fail("cannot seek in '%s'", path.c_str());
                read_exactly(f, dst[array] + w.dst + (lo - w.global), (hi - lo) * 4, path, "training-state file");
            }
        }
    }
    for (FILE* f : open)
        if (f) fclose(f);
    return headers[0];
}

// The contiguous case: elements [range.begin, range.end) into m, v (and master) from index 0.
inline TrainStateHeader read_optimizer_state(const std::string& dir, size_t num_params, ShardRange range, float* m,
                                             float* v, float* master) {
    std::vector<WantedRun> wanted;
    if (range.size() > 0) wanted.push_back({range.begin, range.size(), 0});
    return read_state_runs(dir, num_params, wanted, m, v, master);
}

// Writes `dir`/model.bin from the weights in the checkpoint's state files (when no single rank held
// them all: tensor or pipeline parallelism, ZeRO-3). One rank does it, one run at a time, in the
// order of the file: it never holds more than one run of the model.
inline void assemble_model_file(const std::string& dir, const GPT2Config& cfg) {
    struct Run { size_t global, count, at; int file; };
    std::vector<std::string> files = checkpoint_state_files(dir);
    std::vector<TrainState> tables(files.size());
    std::vector<Run> runs;
    for (size_t i = 0; i < files.size(); i++) {
        FILE* f = open_for_reading(files[i], "training-state file");
        TrainStateHeader h = read_train_state_header(f, files[i]);
        if (!h.has_master_weights) fail("internal: '%s' holds no weights to assemble model.bin from", files[i].c_str());
        std::vector<int64_t> table = read_state_run_table(f, h, files[i]);
        fclose(f);
        tables[i].header = h;
        size_t at = 0;
        for (size_t k = 0; k < table.size(); k += 2) {
            if (table[k + 1] > 0) runs.push_back({(size_t)table[k], (size_t)table[k + 1], at, (int)i});
            at += (size_t)table[k + 1];
        }
    }
    std::sort(runs.begin(), runs.end(), [](const Run& a, const Run& b) { return a.global < b.global; });
    int32_t header[HEADER_INTS];
    fill_model_header(header, cfg, MODEL_VERSION_FP32);
    AtomicFile out(dir + "/model.bin", "model file");
    out.write(header, sizeof(header));
    size_t written = 0;
    std::vector<float> buffer;
    std::vector<FILE*> open(files.size(), nullptr);
    for (const Run& r : runs) {
        if (r.global != written) fail("internal: the weights in '%s' do not tile the model at %zu", dir.c_str(), written);
        const TrainStateHeader& h = tables[(size_t)r.file].header;
        const std::string& path = files[(size_t)r.file];
        FILE*& f = open[(size_t)r.file];
        if (!f) f = open_for_reading(path, "training-state file");
        long at = (long)(sizeof(TrainStateHeader) + state_table_bytes(h) + (2 * (size_t)h.shard_count + r.at) * 4);
        if (fseek(f, at, SEEK_SET) != 0) fail("cannot seek in '%s'", path.c_str());
        buffer.resize(r.count);
        read_exactly(f, buffer.data(), r.count * sizeof(float), path, "training-state file");
        out.write(buffer.data(), r.count * sizeof(float));
        written += r.count;
    }
    for (FILE* f : open)
        if (f) fclose(f);
    if (written != param_layout(cfg).total) fail("internal: the weights in '%s' cover %zu of the model's parameters", dir.c_str(), written);
    out.commit();
}

// Checks a training state against the run about to continue from it. A trainer that reads its
// optimizer state with read_optimizer_state() (any world size, any ZeRO stage) passes can_reshard.
inline void check_resume_state(const TrainStateHeader& h, const std::string& dir, size_t num_params, const RunPlan& plan,
                               bool can_reshard = false) {
    if ((size_t)h.num_params != num_params) {
        fail("checkpoint '%s' holds optimizer state for %lld parameters, the model has %zu", dir.c_str(),
             (long long)h.num_params, num_params);
    }
    if (h.world_size != plan.world_size && !can_reshard) {
        fail("checkpoint '%s' was written by %d rank%s, this run has %d: resume with the same number of ranks",
             dir.c_str(), h.world_size, h.world_size == 1 ? "" : "s", plan.world_size);
    }
    if (h.batch_size != plan.B || h.seq_len != plan.T || h.total_batch_tokens != plan.total_batch_tokens) {
        fprintf(stderr, "warning: resuming with a different batch geometry (B=%d T=%d total=%lld; the checkpoint has "
                "B=%d T=%d total=%lld): the data order will differ from an uninterrupted run\n", plan.B, plan.T,
                (long long)plan.total_batch_tokens, h.batch_size, h.seq_len, (long long)h.total_batch_tokens);
    }
}

// ----------------------------------------------------------------------------------------------
// A step that went wrong

// A loss or gradient norm that is not finite (an overflow in one micro-batch, a learning rate far too
// high) would write NaN into every weight the update touches, and the next checkpoint would save
// them: a run that cannot be resumed. So such a step's update is skipped: the weights and AdamW's
// state stay those of the last sound step, and the step counts as done (the schedule and the data
// move on, as they would have). One bad batch is survived; --max-bad-steps in a row (default 3) mean
// the run has diverged, and it stops, naming the step, before a checkpoint could be written from bad
// weights. Every rank sees the same all-reduced loss and norm, so every rank decides the same.
struct BadSteps {
    int in_a_row = 0;
};

// Whether to apply this step's update (`step` counts from 1); prints a line when skipping (`leader`),
// fails when the run has diverged.
inline bool step_is_sound(BadSteps* b, int step, double loss, float norm, int max_bad_steps, bool leader) {
    if (std::isfinite(loss) && std::isfinite(norm)) {
        b->in_a_row = 0;
        return true;
    }
    b->in_a_row++;
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

// "step    3/10 | loss 10.951200 | lr 1.00e-04 | norm 1.2345 | 812.3 ms | 315 tok/s[ | MFU 48.1% | ETA 1h02m]"
// (scripts parse "<number> ms" and "<number> tok/s" from this line).
inline void print_step_line(int step, int steps, double loss, float lr, float norm, double seconds, int64_t tokens,
                            double mfu_percent, double eta_seconds) {
    printf("step %5d/%d | loss %.6f | lr %.2e | norm %.4f | %.1f ms | %.0f tok/s", step, steps, loss, lr, norm,
           seconds * 1e3, tokens / seconds);
    if (mfu_percent >= 0) printf(" | MFU %.1f%%", mfu_percent);
    if (eta_seconds >= 0) {
        int s = (int)eta_seconds;
        if (s >= 3600) printf(" | ETA %dh%02dm", s / 3600, (s % 3600) / 60);
        else printf(" | ETA %dm%02ds", s / 60, s % 60);
    }
    printf("\n");
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

// The --dump-state file (safetensors), identical for both trainers; test/test_vs_pytorch.py reads it:
//   logits [B, T, V]  first micro-batch's logits, padding dropped     loss [1]  its mean loss
//   grads  [P]        the first step's gradient, before clipping      losses [steps]  each step's loss
//   params [P]        the weights after the last step
struct DumpState {
    std::vector<float> logits, grads, losses, params;
    float loss = 0.0f;
};

inline void write_dump_state(const std::string& path, const DumpState& d, const GPT2Config& cfg, int B, int T,
                             const char* trainer) {
    std::vector<SafetensorsTensor> tensors = {
        {"logits", "F32", {B, T, cfg.vocab_size}, d.logits.data(), d.logits.size() * 4},
        {"loss", "F32", {1}, &d.loss, 4},
        {"grads", "F32", {(int64_t)d.grads.size()}, d.grads.data(), d.grads.size() * 4},
        {"losses", "F32", {(int64_t)d.losses.size()}, d.losses.data(), d.losses.size() * 4},
        {"params", "F32", {(int64_t)d.params.size()}, d.params.data(), d.params.size() * 4},
    };
    write_safetensors(path, tensors, {{"trainer", trainer}, {"config", describe_config(cfg)}});
}

// ----------------------------------------------------------------------------------------------
// Samples: generated from <|endoftext|>, printed as text through GPT-2's tokenizer when its files are
// in --tokenizer DIR (scripts/get_vocab.sh puts them in data/gpt2), else as token ids.

// Samples are drawn every --sample-every steps after the first, and once more at the end. A resumed
// run samples at the same steps as an uninterrupted one (its RNG state comes from the checkpoint).
inline bool is_sample_step(const TrainOptions& o, int step) {
    return o.sample_every > 0 && step > 0 && step % o.sample_every == 0;
}

struct SampleDecoder {
    Tokenizer tokenizer;
    bool loaded = false;
};

inline void sample_decoder_init(SampleDecoder* d, const TrainOptions& o, const GPT2Config& cfg) {
    if (o.sample_every <= 0) return;
    std::string encoder = o.tokenizer_dir + "/encoder.json", merges = o.tokenizer_dir + "/vocab.bpe";
    if (cfg.vocab_size != 50257) {
        printf("samples: the model's vocabulary (%d) is not GPT-2's; printing token ids\n", cfg.vocab_size);
    } else if (!file_exists(encoder) || !file_exists(merges)) {
        printf("samples: no GPT-2 tokenizer in '%s' (scripts/get_vocab.sh fetches it); printing token ids\n", o.tokenizer_dir.c_str());
    } else {
        std::string error;
        d->loaded = d->tokenizer.load(encoder, merges, &error);
        if (!d->loaded) printf("samples: could not load the tokenizer (%s); printing token ids\n", error.c_str());
    }
}

inline void print_sample_text(const SampleDecoder& d, const std::vector<int>& generated) {
    if (d.loaded) {
        // a byte-level model can emit a lone piece of a multi-byte character: show it as U+FFFD
        printf("sample: %s\n", utf8_replace_invalid(d.tokenizer.decode(generated)).c_str());
    } else {
        printf("sample:");
        for (int id : generated) printf(" %d", id);
        printf("\n");
    }
    printf("--------\n");
    fflush(stdout);
}
