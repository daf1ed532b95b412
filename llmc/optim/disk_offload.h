// disk_offload.h — --offload-dir DIR (CPU trainer): AdamW's moments m and v live in two files on disk
// and stream through a small buffer during the optimizer step. ZeRO-Infinity's idea (Rajbhandari et
// al. 2021, "ZeRO-Infinity: Breaking the GPU Memory Wall for Extreme Scale Deep Learning": optimizer
// state on NVMe, moved in chunks and overlapped with the update) at the scale of one CPU.
//
// Why m and v, and nothing else: AdamW's update of an element needs its own p, g, m, v and nothing
// else (llmc/optim/adamw.h), so the step can walk the moments chunk by chunk. The weights and the
// gradient cannot go: the forward and backward passes read every weight and write every gradient in
// an order set by the layers, not by a stream. So with fp32 weights as their own master copy, the
// 16 bytes per parameter of a run in RAM (weights 4, gradient 4, m 4, v 4) become 8 in RAM and 8 on
// disk. (One rank: no separate gradient shard; llmc/parallel/zero.h.)
//
// The step, for the n moments this rank updates, in chunks of c floats (--offload-chunk-kib):
//   read chunk 0 of m and v
//   for k = 0, 1, ...:   a helper thread writes chunk k-1 back, then reads     } overlapped
//                        chunk k+1 into the slot k-1 used                      }
//                        AdamW updates chunk k (adamw_update, the same code)   }
//   write the last chunk back
// The update of chunk k is adamw_update on the parts of the rank's pieces (one per tensor, for
// weight decay) that fall in [k c, (k+1) c), which is why the weights come out bit for bit those of
// the run in RAM: the same function, on the same floats, in pieces (each element's update is alone).
//
// --optimizer-state bf16 (llmc/optim/adamw_bf16.h): m and v rest in bf16 on disk as they would in RAM,
// 2 bytes each, and the chunk's update is adamw_update_bf16, its rounding keyed by each element's
// index in the flat array (not by its place in the chunk): the files, the disk traffic and the free
// space the run needs halve, and the weights are the in-RAM bf16 run's bit for bit. The file holds
// the moments exactly as RAM would (`elem` bytes each); a chunk is --offload-chunk-kib bytes either way.
//
// Bytes moved per step: 2 x 8 bytes per parameter (m and v read, m and v written): 16n (8n with bf16
// moments). Memory: 4 slots of a chunk (m and v, two each: the one updated and the one being read),
// 16 MiB at the default 4 MiB chunk, whatever the model's size. Disk: 8n bytes per rank (4n with bf16 moments), preallocated
// at start (posix_fallocate), so that a full disk is found before the first step, not in the middle
// of one: rewriting preallocated blocks needs no new space (in place, as ext4 rewrites them).
//
// The page cache: the files are read and written through it (no O_DIRECT, which would need
// aligned buffers and offsets). When RAM is free the kernel keeps the files' pages and the reads
// come from memory; the writes still go to the disk, in the background, and once enough written
// pages wait for it the kernel makes the writer wait too: so the step runs at the disk's write speed
// (docs/benchmarks.md measures it). The cached pages are the kernel's to reclaim, not the process's:
// they are not in its resident set, and a run that would not fit with m and v in its memory trains.
//
// What the files are not: the checkpoint. A step overwrites them in place, so a run killed in the
// middle of a step leaves them half old, half new; a checkpoint copies them (through the same chunk
// buffer) into its own state file, and a resumed run rebuilds the files from the checkpoint. So the
// last checkpoint is whole whenever the run dies, and the files are scratch.
//
// Hook points: none in the passes. In optimizer_step (llmc/run/step.h), the trainer's AdamW loop over
// its pieces (gpt2_update) runs inside disk_offload_stream; checkpoints write and read m and v
// through it too (TrainState::moments, llmc/io/formats.h).
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>
#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>
#include "llmc/memory/size_table.h"  // format_bytes
#include "llmc/utils.h"

constexpr int DISK_OFFLOAD_DEFAULT_CHUNK_KIB = 4096;  // 1 Mi floats per chunk: 16 MiB of slots

struct DiskOffload {
    bool on = false;
    std::string path[2];          // DIR/rank<r>_m.bin, DIR/rank<r>_v.bin
    int fd[2] = {-1, -1};
    dev_t device[2] = {0, 0};     // the files' identity: a file removed or replaced is noticed at the next step
    ino_t inode[2] = {0, 0};
    size_t n = 0, chunk = 0;      // moments per file; per chunk
    size_t elem = sizeof(float);  // bytes per moment: 4, or 2 with --optimizer-state bf16 (they rest in bf16 on disk too)
    char* slots[2] = {nullptr, nullptr};    // m's two chunks, v's two chunks (the size table's adam_m, adam_v rows)
};

// The moments in one chunk of chunk_kib KiB, and the buffer each of m and v keeps in RAM: two chunks
// (no more than the state itself). `elem`: 4 bytes per moment, or 2 in bf16.
inline size_t disk_offload_chunk_elements(size_t n, int chunk_kib, size_t elem) {
    return std::max<size_t>(1, std::min(n, (size_t)chunk_kib * 1024 / elem));
}
inline size_t disk_offload_buffer_elements(size_t n, int chunk_kib, size_t elem) {
    return n == 0 ? 0 : 2 * disk_offload_chunk_elements(n, chunk_kib, elem);
}

inline std::string disk_offload_file(const std::string& dir, int rank, int which) {
    return strprintf("%s/rank%d_%s.bin", dir.c_str(), rank, which == 0 ? "m" : "v");
}

// Why DIR cannot hold the files of every rank (rank r's two files of moments[r] values of `elem` bytes each; "" when it
// can): it must be a writable directory with the space free (statvfs), counting the space the
// ranks' files from an earlier run hold, since they are replaced. Every rank checks every rank's
// need, so all reach the same verdict before any allocates. `free_override` >= 0 replaces the
// measured free space (a test's way to make a small disk: llmc/probes/fault_injection.h).
inline std::string disk_offload_dir_problem(const std::string& dir, const std::vector<size_t>& moments, size_t elem,
                                            int64_t free_override) {
    struct stat st;
    if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
        return strprintf("--offload-dir '%s' is not a directory: create it, or name one that exists", dir.c_str());
    if (access(dir.c_str(), W_OK | X_OK) != 0)
        return strprintf("--offload-dir '%s' is not writable (%s): name a directory this user can write", dir.c_str(), strerror(errno));
    struct statvfs fs;
    if (statvfs(dir.c_str(), &fs) != 0) return strprintf("--offload-dir '%s': cannot read its free space (%s)", dir.c_str(), strerror(errno));
    double free_bytes = free_override >= 0 ? (double)free_override : (double)fs.f_bavail * fs.f_frsize, need = 0;
    size_t params = 0;
    for (size_t r = 0; r < moments.size(); r++) {
        need += 2.0 * moments[r] * elem, params += moments[r];
        for (int which = 0; which < 2; which++)
            if (stat(disk_offload_file(dir, (int)r, which).c_str(), &st) == 0) free_bytes += (double)st.st_size;
    }
    if (free_bytes < need)
        return strprintf("--offload-dir '%s' has %s free, the AdamW moments need %s (m and v, %zu bytes for each of the %zu "
                         "parameters %zu rank%s update): free some space or name a larger disk", dir.c_str(),
                         format_bytes(free_bytes).c_str(), format_bytes(need).c_str(), 2 * elem, params, moments.size(),
                         moments.size() == 1 ? "" : "s");
    return "";
}

// Creates this rank's two files of n zeros (the moments of a fresh run), their blocks reserved now.
// The buffer slots are the caller's: disk_offload_buffer_elements values of `elem` bytes for each of m and v.
inline void disk_offload_open(DiskOffload* d, const std::string& dir, int rank, size_t n, int chunk_kib, size_t elem,
                              void* m_slots, void* v_slots) {
    d->on = true;
    d->n = n;
    d->elem = elem;
    d->chunk = disk_offload_chunk_elements(n, chunk_kib, elem);
    d->slots[0] = (char*)m_slots, d->slots[1] = (char*)v_slots;
    for (int which = 0; which < 2; which++) {
        d->path[which] = disk_offload_file(dir, rank, which);
        d->fd[which] = open(d->path[which].c_str(), O_RDWR | O_CREAT | O_TRUNC, 0644);
        if (d->fd[which] < 0) fail("--offload-dir: cannot create '%s' (%s)", d->path[which].c_str(), strerror(errno));
        int err = n == 0 ? 0 : posix_fallocate(d->fd[which], 0, (off_t)(n * elem));
        if (err != 0)
            fail("--offload-dir: cannot reserve %s for '%s' (%s): free some space or name a larger disk",
                 format_bytes((double)(n * elem)).c_str(), d->path[which].c_str(), strerror(err));
        struct stat st;
        fstat(d->fd[which], &st);
        d->device[which] = st.st_dev, d->inode[which] = st.st_ino;
    }
}

// Before each step: the files must still be the ones this run made. (Removing an open file does not
// stop reads and writes through its descriptor, so without this check a run whose DIR was deleted
// would train on, and fail only at exit or never.)
inline void disk_offload_check(const DiskOffload& d) {
    for (int which = 0; which < 2; which++) {
        struct stat st;
        if (stat(d.path[which].c_str(), &st) != 0 || st.st_dev != d.device[which] || st.st_ino != d.inode[which])
            fail("--offload-dir: '%s' was removed or replaced while the run used it: the optimizer state is lost; resume from "
                 "the last checkpoint (it keeps its own copy)", d.path[which].c_str());
    }
}

// Reads or writes moments [begin, begin + count) of file `which` at `data`; "" or what went wrong.
inline std::string disk_offload_io(const DiskOffload& d, int which, bool write, size_t begin, size_t count, char* data) {
    char* p = data;
    size_t bytes = count * d.elem;
    off_t at = (off_t)(begin * d.elem);
    while (bytes > 0) {
        ssize_t done = write ? pwrite(d.fd[which], p, bytes, at) : pread(d.fd[which], p, bytes, at);
        if (done < 0 && errno == EINTR) continue;
        if (done <= 0)
            return strprintf("--offload-dir: %s '%s' failed (%s): the optimizer state is lost; resume from the last checkpoint "
                             "(it keeps its own copy)", write ? "writing" : "reading", d.path[which].c_str(),
                             done < 0 ? strerror(errno) : "the file is shorter than the run made it");
        p += done, bytes -= (size_t)done, at += done;
    }
    return "";
}

// Walks the moments in chunks: visit(begin, count, m, v) sees moments [begin, begin + count) of m and
// v (null for a file neither read nor written; float* or, with bf16 moments, uint16_t* as void*). `read` and `write` say which files (bit 0: m, bit 1:
// v) are read before the visit and written back after it. While chunk k is visited, a helper thread
// writes chunk k-1 back and then reads chunk k+1 into the same slot (k-1 and k+1 share one: two
// slots), so the disk works while AdamW does; the last chunk is written after the loop.
template <class Visit>
inline void disk_offload_stream(DiskOffload* d, int read, int write, Visit visit) {
    size_t chunks = (d->n + d->chunk - 1) / d->chunk;
    auto slot = [&](int which, size_t k) { return d->slots[which] + (k % 2) * d->chunk * d->elem; };
    auto io = [&](int files, bool writing, size_t k) {
        std::string error;
        for (int which = 0; which < 2 && error.empty(); which++)
            if (files & (1 << which))
                error = disk_offload_io(*d, which, writing, k * d->chunk, std::min(d->chunk, d->n - k * d->chunk), slot(which, k));
        return error;
    };
    std::string error = chunks > 0 ? io(read, false, 0) : "";
    for (size_t k = 0; k < chunks && error.empty(); k++) {
        std::string helper_error;
        std::thread helper([&, k] {
            if (k > 0) helper_error = io(write, true, k - 1);
            if (helper_error.empty() && k + 1 < chunks) helper_error = io(read, false, k + 1);
        });
        visit(k * d->chunk, std::min(d->chunk, d->n - k * d->chunk), (read | write) & 1 ? (void*)slot(0, k) : nullptr,
              (read | write) & 2 ? (void*)slot(1, k) : nullptr);
        helper.join();
        error = helper_error;
        if (error.empty() && k + 1 == chunks) error = io(write, true, k);
    }
    if (!error.empty()) fail(error);
}

// At the end of a run the files go: they are scratch, the checkpoints hold the state. (A run that
// dies leaves them; the next run on DIR truncates them.)
inline void disk_offload_close(DiskOffload* d) {
    for (int which = 0; which < 2; which++)
        if (d->fd[which] >= 0) close(d->fd[which]), d->fd[which] = -1, unlink(d->path[which].c_str());
}
