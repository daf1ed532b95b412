// checkpoint.h — checkpoints, all of them: how a run is saved so that it can stop at any moment and
// continue bit for bit, on the same grid or on another. A checkpoint is a directory,
// out_dir/ckpt_<step, 8 digits>, written by every rank together:
//   model.bin                      the weights (llm.c's model file)
//   state.bin, state_rank<r>.bin   AdamW's m and v (and weights), or --optimizer adafactor's or
//                                  sm3's row and column statistics (state.bin only), the step, the
//                                  data loader's position and the sampler's RNG, in global coordinates
//   checksums.txt                  a hash and a size per file, to find bytes damaged after writing
// The state files' headers also record the run's options, for a resumed run to continue with
// (llmc/run/resume.h). --keep-checkpoints removes older ones once a new one is in place (prune_checkpoints).
// In order below: the checksums; which directories are complete, and which one --resume picks;
// writing (into "<dir>.tmp", then one atomic rename, so a crash leaves no new checkpoint or a
// complete one); reading the state back on any grid (and model.bin assembled from it, when no rank
// held every weight); and checking it against the run that resumes.
// Why one file: saving, publishing, verifying, choosing and reading back are one protocol, and a
// change to one of them (a new file in the directory) must be made in all. The bytes of each file
// are llmc/io/formats.h's; the weights a resumed run starts from are loaded by llmc/run/plan.h.
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>
#include "llmc/run/cli.h"
#include "llmc/io/formats.h"
#include "llmc/model/model.h"
#include "llmc/optim/optimizer_state.h"
#include "llmc/run/plan.h"
#include "llmc/parallel/process_grid.h"
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
// Checkpoints: out_dir/ckpt_00001000/{model.bin, state.bin} (state_rank<r>.bin with ZeRO-1)

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
inline std::string latest_checkpoint(const std::string& out_dir, bool announce = false) {
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

// Resolves --resume to a checkpoint directory ("" when not resuming). 'auto' is what a script that
// may be interrupted and rerun wants: the newest checkpoint if there is one, else a fresh start.
// `announce`: the rank that prints says which newer checkpoints it skipped, and why.
// A run's folder (no model.bin of its own, ckpt_* directories in it) stands for its newest sound checkpoint.
inline std::string resolve_resume_dir(const TrainOptions& o, bool announce = false) {
    if (o.resume.empty()) return "";
    if (o.resume == "auto") return latest_checkpoint(o.out_dir, announce);
    bool run_folder = o.resume != "latest" && dir_exists(o.resume) && !file_exists(o.resume + "/model.bin") &&
                      !expand_glob(o.resume + "/ckpt_*").empty();
    std::string dir = o.resume == "latest" ? latest_checkpoint(o.out_dir, announce)
                      : run_folder         ? latest_checkpoint(o.resume, announce) : o.resume;
    if (dir.empty() && run_folder) fail("--resume '%s': the run's folder holds no complete checkpoint", o.resume.c_str());
    if (dir.empty()) fail("--resume latest: there is no complete checkpoint in '%s'", o.out_dir.c_str());
    if (!dir_exists(dir)) fail("--resume '%s': no such checkpoint directory", dir.c_str());
    std::string problem = o.resume == "latest" || run_folder ? "" : checkpoint_checksum_problem(dir);  // (latest verified it)
    if (!problem.empty()) fail("--resume '%s': %s; resume from another checkpoint", dir.c_str(), problem.c_str());
    return dir;
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

// --keep-checkpoints N: after checkpoint `step` is published (complete, checksummed, renamed into
// place), the checkpoints of earlier steps beyond the newest N sound ones are removed. The new one is
// sound and counts first; an older one counts only if it is sound (checkpoint_problem: its files and
// checksums), so a damaged checkpoint never takes the place of a sound one; those of later steps (an
// earlier, longer run's) are left alone. A removal renames the directory out of the ckpt_<8 digits>
// pattern first (atomic), then deletes it: a crash midway leaves no half-deleted checkpoint that
// --resume latest could take for a whole one.
inline void prune_checkpoints(const std::string& out_dir, int step, int keep) {
    if (keep <= 0) return;
    std::vector<std::string> older;
    for (const std::string& path : expand_glob(out_dir + "/ckpt_*")) {
        std::string name = path.substr(path.rfind('/') + 1);
        if (name.size() == 13 && dir_exists(path) && atoi(name.c_str() + 5) < step) older.push_back(path);
    }
    int kept = 1;  // the new one
    for (size_t i = older.size(); i-- > 0;) {  // newest first
        if (kept < keep) {
            kept += checkpoint_problem(older[i]).empty();
            continue;
        }
        std::string doomed = older[i] + ".removing";
        if (rename(older[i].c_str(), doomed.c_str()) != 0 || system(("rm -rf '" + doomed + "'").c_str()) != 0)
            fprintf(stderr, "warning: --keep-checkpoints: could not remove '%s'\n", older[i].c_str());
    }
}

template <class Barrier>
inline void publish_checkpoint_together(const std::string& out_dir, int step, int rank, Barrier barrier, int keep = 0) {
    barrier("the barrier after writing the checkpoint");
    if (rank == 0) {
        write_checkpoint_checksums(checkpoint_dir(out_dir, step) + ".tmp");
        printf("checkpoint: %s\n", publish_checkpoint(out_dir, step).c_str());
        prune_checkpoints(out_dir, step, keep);
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

// A checkpoint, every rank together (open_checkpoint_together and publish_checkpoint_together above: written into "<dir>.tmp", checksummed, then
// renamed into place, so a crash leaves no new checkpoint or a complete one). The files hold the
// model in global coordinates, so any grid can resume from them (read_state_runs):
//   model.bin          the weights; written by rank 0 when it holds them all (data parallelism,
//                      ZeRO-0..2), else assembled on rank 0 from every rank's
//   state.bin          ZeRO-0 data parallelism (and one rank): rank 0's optimizer state, for everything
//   state_rank<r>.bin  otherwise rank r's m and v, and weights (fp32 master weights, or the
//                      weights themselves when model.bin cannot come from rank 0 alone), for the
//                      elements it writes (zero_state_runs), as runs of the model
// What differs between the trainers is only where the bytes live, so they hand in three callbacks.
struct CheckpointParts {
    bool master_weights = false;  // the state files carry fp32 master weights beside m and v
    std::function<void(const std::string& path)> write_model_bin;     // rank 0, holding every weight
    std::function<void(TrainState* s)> fill_state;                     // this rank's share (zero_fill_state)
    std::function<void(const std::string& dir)> assemble_model_bin;   // every rank, when none holds them all
    // every rank, optional: files of its own beside the state, for a technique's per-rank state
    // (gradient compression's error feedback: grad_compression_rank<r>.bin, llmc/parallel/grad_compression.h)
    std::function<void(const std::string& dir)> write_rank_files;
    int updates_skipped = 0;  // the run's steps skipped for a loss or norm that was not finite (BadSteps, llmc/run/step.h)
};

// `options`: the run's options as llmc/run/resume.h records them, in every state file's header; `keep`: --keep-checkpoints.
template <class Barrier>
inline void write_checkpoint(const ProcessGrid& g, const std::string& out_dir, int step, size_t num_params, const RunPlan& plan,
                             uint64_t sampler_rng, const LoaderPosition& train_position, const CheckpointParts& parts,
                             Barrier barrier, const std::string& options, int keep) {
    bool leader = g.rank == 0;
    bool rank0_holds_weights = g.tp == 1 && g.pp == 1 && g.zero_stage <= 2;
    bool one_state_file = g.tp == 1 && g.pp == 1 && g.zero_stage == 0;
    std::string tmp = open_checkpoint_together(out_dir, step, g.rank, barrier);
    if (leader && rank0_holds_weights) parts.write_model_bin(tmp + "/model.bin");
    if (leader || !one_state_file) {
        TrainState s;
        s.header = train_state_header(step, num_params, ShardRange{}, g.rank, g.world, g.zero_stage, plan, sampler_rng,
                                      train_position);
        s.header.has_master_weights = parts.master_weights || !rank0_holds_weights;
        s.header.updates_skipped = parts.updates_skipped;
        parts.fill_state(&s);
        s.header.options_version = OPTIONS_VERSION;
        if (options.size() >= sizeof(s.header.options)) fail("internal: the recorded options take %zu bytes", options.size());
        memcpy(s.header.options, options.data(), options.size());
        write_train_state(tmp + "/" + (one_state_file ? std::string("state.bin") : strprintf("state_rank%d.bin", g.rank)), s);
    }
    if (parts.write_rank_files) parts.write_rank_files(tmp);
    if (!rank0_holds_weights) parts.assemble_model_bin(tmp);
    publish_checkpoint_together(out_dir, step, g.rank, barrier, keep);
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

// Resuming with another optimizer than the one that wrote the checkpoint: one optimizer's state
// means nothing to another (AdamW's per-element moments against Adafactor's row and column sums), so
// it is refused rather than silently restarted.
inline void refuse_other_optimizer(const std::string& dir, int written, int wanted) {
    fail("checkpoint '%s' holds the optimizer state of --optimizer %s, this run uses --optimizer %s: resume with "
         "--optimizer %s (one optimizer's state is no use to another)", dir.c_str(), optimizer_name(written),
         optimizer_name(wanted), optimizer_name(written));
}

// A run of one state file: `count` elements from global index `global`, at element `at` of the file's arrays.
struct StateFileRun { size_t global, count, at; int file; };

// Sorts the state files' runs by their global index; they must tile [0, num_params): no gap, no overlap.
inline void sort_state_file_runs(const std::string& dir, const std::vector<std::string>& files, size_t num_params,
                                 std::vector<StateFileRun>* runs) {
    std::sort(runs->begin(), runs->end(), [](const StateFileRun& a, const StateFileRun& b) { return a.global < b.global; });
    size_t covered = 0;
    for (const StateFileRun& r : *runs) {
        if (r.global != covered) {
            fail("the training state in '%s' %s at parameter %zu (%s): the checkpoint is incomplete or mixed up", dir.c_str(),
                 r.global > covered ? "has a gap" : "holds some parameters twice", covered, files[(size_t)r.file].c_str());
        }
        covered += r.count;
    }
    if (covered != num_params) {
        fail("the training state in '%s' covers %zu of %zu parameters: the checkpoint is incomplete", dir.c_str(), covered, num_params);
    }
}

// Reads AdamW's m and v and the weights (`master`; only from files that hold them) for the wanted
// elements from a checkpoint, however it was cut: the files' runs together must cover every
// parameter exactly once, and this rank reads from each file the parts that overlap what it wants.
// So a run may resume on another grid (world size, ZeRO stage, tensor or pipeline degree); on the
// same grid each rank simply reads its own file whole. Null arrays are skipped. Returns the first
// file's header (has_master_weights: whether the weights came from the state files).
inline TrainStateHeader read_state_runs(const std::string& dir, size_t num_params, std::vector<WantedRun> wanted, float* m,
                                        float* v, float* master) {
    using FileRun = StateFileRun;
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
        if (h.optimizer != (int)Optimizer::AdamW) {
            // a factored optimizer's checkpoint: no per-element state, and its weights are in model.bin
            // (with tensor parallelism assembled from the state files' weights: take them from there)
            if (m || v) refuse_other_optimizer(dir, h.optimizer, (int)Optimizer::AdamW);
            if (!master || !h.has_master_weights) {
                TrainStateHeader none = h;
                none.has_master_weights = 0;  // none read here
                return none;
            }
            // the GPU's fp32 master weights after the statistics (train_gpt.cu's fill_factored_state): read below
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
    sort_state_file_runs(dir, files, num_params, &runs);
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
                // where the array starts: after m and v, or (a factored optimizer's: only the weights) its statistics
                size_t first = h.optimizer != (int)Optimizer::AdamW ? (size_t)h.optimizer_state_floats : (size_t)array * h.shard_count;
                long at = (long)(sizeof(TrainStateHeader) + state_table_bytes(h) + (first + it->at + (lo - it->global)) * 4);
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

// A factored optimizer's tensor-parallel checkpoint on another grid: one line, no reshard.
inline void refuse_factored_reshard(const std::string& dir, const TrainStateHeader& h, int world, int tp) {
    fail("checkpoint '%s' holds %s state written by %d rank%s with --tensor-parallel %d; this run has %d with "
         "--tensor-parallel %d: a factored optimizer resumes a tensor-parallel checkpoint on the same grid only (its cut "
         "statistics are not resharded)", dir.c_str(), optimizer_name(h.optimizer), h.world_size, h.world_size == 1 ? "" : "s",
         std::max(1, h.tensor_parallel), world, tp);
}

// A factored optimizer's state (Adafactor, SM3: llmc/optim/optimizer_state.h) from a checkpoint:
// state.bin (every rank held all of it), or with ZeRO-1 state_rank<r>.bin, each rank's slice of whole
// blocks (llmc/optim/factored_sharding.h), which read in rank order are the whole model's state.
// Takes floats [begin, begin + count) of the whole into `state`, so any number of ranks resumes
// any other's checkpoint. Refuses another optimizer's checkpoint and a model of another shape.
inline TrainStateHeader read_factored_state(const std::string& dir, size_t num_params, Optimizer optimizer, size_t whole,
                                            size_t begin, size_t count, float* state, int world = 1) {
    std::vector<std::string> files = checkpoint_state_files(dir);
    std::vector<float> all;
    TrainStateHeader h;
    for (size_t i = 0; i < files.size(); i++) {
        TrainState s = read_train_state(files[i]);
        if (i == 0) h = s.header;
        if (s.header.num_params != (int64_t)num_params) {
            fail("checkpoint '%s' holds optimizer state for %lld parameters, the model has %zu", dir.c_str(),
                 (long long)s.header.num_params, num_params);
        }
        if (s.header.optimizer != (int)optimizer) refuse_other_optimizer(dir, s.header.optimizer, (int)optimizer);
        if (s.header.tensor_parallel > 1) refuse_factored_reshard(dir, s.header, world, 1);
        all.insert(all.end(), s.factored.begin(), s.factored.end());
    }
    if (all.size() != whole || begin + count > whole) {
        fail("checkpoint '%s' holds %zu values of %s state in %zu file%s, this model needs %zu: the checkpoint is damaged or "
             "mixed up", dir.c_str(), all.size(), optimizer_name(h.optimizer), files.size(), files.size() == 1 ? "" : "s", whole);
    }
    std::copy(all.begin() + (long)begin, all.begin() + (long)(begin + count), state);
    return h;
}

// A factored optimizer's state under tensor parallelism (llmc/optim/factored_tensor_parallel.h): each
// rank's statistics are of its slice's cut blocks, some of them shared with the tensor group, so a
// rank reads its own file, written on the same grid; another grid is refused (no reshard is built).
inline TrainStateHeader read_factored_state_tensor_parallel(const std::string& dir, size_t num_params, Optimizer optimizer,
                                                            const ProcessGrid& g, size_t count, float* state) {
    std::string path = dir + "/" + strprintf("state_rank%d.bin", g.rank);
    TrainStateHeader h0 = read_train_state(checkpoint_state_files(dir)[0]).header;
    if (h0.tensor_parallel != g.tp || h0.world_size != g.world || !file_exists(path))
        refuse_factored_reshard(dir, h0, g.world, g.tp);
    TrainState s = read_train_state(path);
    if (s.header.num_params != (int64_t)num_params)
        fail("checkpoint '%s' holds optimizer state for %lld parameters, the model has %zu", dir.c_str(), (long long)s.header.num_params, num_params);
    if (s.header.optimizer != (int)optimizer) refuse_other_optimizer(dir, s.header.optimizer, (int)optimizer);
    if (s.factored.size() != count)
        fail("checkpoint '%s': rank %d's file holds %zu values of %s state, this rank needs %zu: the checkpoint is damaged or "
             "mixed up", dir.c_str(), g.rank, s.factored.size(), optimizer_name(s.header.optimizer), count);
    std::copy(s.factored.begin(), s.factored.end(), state);
    return s.header;
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
        size_t before = h.optimizer != 0 ? (size_t)h.optimizer_state_floats : 2 * (size_t)h.shard_count;  // the state, then the weights
        long at = (long)(sizeof(TrainStateHeader) + state_table_bytes(h) + (before + r.at) * 4);
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

// The start-up line both trainers print after a resume on another grid, about the resharding.
// Empty when the checkpoint was written by the grid (ranks, ZeRO stage, tensor x pipeline) of this run.
inline std::string describe_reshard(const TrainStateHeader& written, int world, int zero_stage, int tp, int pp) {
    int old_tp = std::max(1, (int)written.tensor_parallel), old_pp = std::max(1, (int)written.pipeline_parallel);
    if (written.world_size == world && written.zero_stage == zero_stage && old_tp == tp && old_pp == pp) return "";
    auto grid_of = [](int t, int p) { return t > 1 || p > 1 ? strprintf(" (tp %d x pp %d)", t, p) : std::string(); };
    return strprintf("resharded: the checkpoint was written by %d rank%s with ZeRO-%d%s, this run has %d with ZeRO-%d%s\n",
                     (int)written.world_size, written.world_size == 1 ? "" : "s", (int)written.zero_stage,
                     grid_of(old_tp, old_pp).c_str(), world, zero_stage, grid_of(tp, pp).c_str());
}
