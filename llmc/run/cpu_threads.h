// cpu_threads.h — the CPU trainer's thread count on a machine it shares: wait for a late thread
// asleep, not spinning, and run only on the cores that other programs leave free.
//
// Why a shared machine hurts. Every kernel is one OpenMP parallel region: the rows are split over a
// team of threads, and the region ends when the last thread is done (a barrier, some 200 of them a
// training step). On cores of its own the team ends together. When another busy program wants the
// same core as one of our threads, the kernel's scheduler gives the core to each in turn, a time
// slice (milliseconds) at a time: every barrier then waits, often a whole slice, for the thread that
// is not running. Worse, libgomp's early threads wait by spinning, 300,000 rounds before they sleep,
// so they take the slice the late thread (or the other program) needed. Measured on 2 shared cores
// (load average 13-15), 5 steps of the main job's model (L=8, C=64, B=8, T=64), the whole process:
// 44.5 s on 2 threads against 5.4 s on 1; with GOMP_SPINCOUNT=10000, 10.9 s on 2 against 7.4-8.6 s
// on 1 (waiting asleep narrows the gap; only fewer threads closes it).
//
// Two remedies, both here, both leaving the numbers unchanged:
//  1. Wait asleep sooner. GOMP_SPINCOUNT=10000 spins (a pause instruction each: a few microseconds to
//     half a millisecond), then sleeps in the kernel until the last thread arrives; on a quiet
//     machine it costs nothing measurable (docs/benchmarks.md, "Sized by time"). libgomp
//     reads it once, as the library loads, before main: so when the user set neither GOMP_SPINCOUNT
//     nor OMP_WAIT_POLICY, the trainer sets it and starts itself again (execv of /proc/self/exe, the
//     same process id, arguments and environment; one exec, a few milliseconds).
//  2. Use only the free cores. A thread on a core that another program also wants runs at half
//     speed or less, and the team runs at its slowest thread's speed, so it is worth less than no
//     thread. With --threads 0 (the default) and no OMP_NUM_THREADS, the trainer counts the cores
//     that other programs keep busy and runs on the others (at least 1, at most what OpenMP offers):
//       at set-up   the tasks that are runnable now (/proc/stat's procs_running, less this one: there
//                   is no interval to measure yet), shared out evenly over the machine's cores;
//       then        at a training step's start and a generated token's, once 0.5 s has passed since
//                   the last look: over that interval, the busy time of our cores (/proc/stat's
//                   per-CPU lines, the CPUs our affinity allows) less our own CPU time is the other
//                   programs' use, in cores: others = (busy - ours) / seconds.
//     free = cores - others, rounded to the nearest (a daemon's tenth of a core costs no thread);
//     threads = free, between 1 and OpenMP's count. One busy program per core: others = cores, 1
//     thread. A quiet machine: others ~ 0, every core, as before. Busy time is capped at the cores,
//     so others that want 2 cores but got 1 (our threads had the other) read as 1: free = 1, and at
//     1 thread they get more, so the count stays at 1 rather than climbing back.
//
// The numbers do not depend on the thread count: every kernel splits its outputs over the threads
// and sums each output in one fixed order whatever the count (test/test_cpu_trainer.py: 1, 2 and 3
// threads train the same weights and losses, bit for bit; test/test_generate.py: they generate the
// same tokens and log-probabilities). So the count may change between any two steps or tokens, and
// a run is reproducible on any machine, busy or not. When the count goes below every count noted
// before, one line says so (rank 0, not under --quiet): on stdout with the training log, on stderr
// beside generation's samples; the set-up's when the first step or token starts, so that an error
// in the flags stays one line. --threads N or OMP_NUM_THREADS fixes the count, and nothing here looks
// at the load. test/test_cpu_threads.cpp checks the arithmetic on fake /proc/stat readings.
#pragma once

#include <omp.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

// 1. Passive waiting: start again with GOMP_SPINCOUNT set, unless the user chose a waiting policy.
// Returns only when it did not start again (already set, or the exec failed: then as before).
inline void cpu_threads_wait_asleep(char** argv) {
    if (getenv("GOMP_SPINCOUNT") || getenv("OMP_WAIT_POLICY")) return;
    setenv("GOMP_SPINCOUNT", "10000", 0);
    execv("/proc/self/exe", argv);  // (set now: a failed exec cannot start again in a loop)
}

// One reading of /proc/stat: the busy ticks of our CPUs, how many of them there are, the machine's
// CPUs, and the tasks runnable now (this one included).
struct ProcStat {
    double busy_ticks = 0;
    int cores = 0, machine_cores = 0, runnable = 0;
};

// `text` is /proc/stat's; `ours` the CPUs counted (null: all). A CPU's line is
// "cpuN user nice system idle iowait irq softirq steal ...": busy is all but idle and iowait.
inline ProcStat parse_proc_stat(const char* text, const cpu_set_t* ours) {
    ProcStat s;
    for (const char* line = text; line && *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : nullptr) {
        int cpu;
        unsigned long long v[8] = {};
        if (strncmp(line, "cpu", 3) == 0 && isdigit((unsigned char)line[3]) &&  // ("cpu " is the machine's sum)
            sscanf(line, "cpu%d %llu %llu %llu %llu %llu %llu %llu %llu", &cpu, &v[0], &v[1], &v[2], &v[3], &v[4], &v[5],
                   &v[6], &v[7]) >= 5) {
            s.machine_cores++;
            if (ours && (cpu < 0 || cpu >= CPU_SETSIZE || !CPU_ISSET(cpu, ours))) continue;
            s.cores++;
            s.busy_ticks += (double)(v[0] + v[1] + v[2] + v[5] + v[6] + v[7]);  // (steal: a hypervisor's other guests)
        }
        sscanf(line, "procs_running %d", &s.runnable);
    }
    return s;
}

// The thread count when other programs keep `others` of our `cores` busy: the free cores, rounded
// to the nearest, between 1 and `most`.
inline int threads_for_free_cores(double others, int cores, int most) {
    int free = (int)std::floor(cores - others + 0.5);
    return std::max(1, std::min(most, free));
}

// The set-up's estimate, before there is an interval: the runnable tasks other than this one, spread
// evenly over the machine, the share that falls on our cores.
inline double others_from_runnable(const ProcStat& s) {
    return s.machine_cores > 0 ? std::max(0, s.runnable - 1) * (double)s.cores / s.machine_cores : 0.0;
}

// Over an interval of `seconds`: the busy seconds of our cores, less our own CPU seconds, per second.
inline double others_over_interval(double busy_seconds, double own_seconds, double seconds) {
    return std::max(0.0, busy_seconds - own_seconds) / seconds;
}

// The one-line note when the count is lowered.
inline std::string lowered_threads_note(double others, int cores, int threads, int most) {
    char line[256];
    snprintf(line, sizeof line, "threads: other programs' load is %.1f cores of the %d here; running on %d thread%s instead "
             "of %d (the same numbers; --threads N fixes the count)", others, cores, threads, threads == 1 ? "" : "s", most);
    return line;
}

// The process's choice: set up once in main, looked at again by cpu_threads_adapt.
struct CpuThreads {
    bool adapts = false;  // --threads 0 and no OMP_NUM_THREADS
    bool quiet = false;
    FILE* note_to = stdout;  // (generation's stdout is its samples: stderr there)
    bool working = false;    // the first step or token has started
    std::string pending;     // the set-up's note, said when the work starts (after the inputs are checked:
                             // an error stays the one line on stderr)
    int most = 1, now = 1, lowest_noted = 0;  // OpenMP's count, the count now, the lowest the note gave
    const char* stat_path = "/proc/stat";
    cpu_set_t ours;
    double busy_s = 0, own_s = 0, wall_s = 0;  // at the last look
};
inline CpuThreads cpu_threads;

inline double cpu_threads_clock(clockid_t id) {
    timespec t;
    clock_gettime(id, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

inline bool read_proc_stat(const CpuThreads& ct, ProcStat* s) {
    FILE* f = fopen(ct.stat_path, "r");
    if (!f) return false;
    std::string text(1 << 16, '\0');
    text.resize(fread(&text[0], 1, text.size() - 1, f));
    fclose(f);
    *s = parse_proc_stat(text.c_str(), &ct.ours);
    return s->cores > 0;
}

inline void cpu_threads_set(CpuThreads* ct, double others, int cores) {
    int n = threads_for_free_cores(others, cores, ct->most);
    if (n == ct->now) return;
    omp_set_num_threads(n);
    ct->now = n;
    if (n >= ct->lowest_noted) return;
    ct->lowest_noted = n;
    if (ct->quiet) return;
    std::string note = lowered_threads_note(others, cores, n, ct->most);
    if (!ct->working) ct->pending = note;
    else fprintf(ct->note_to, "%s\n", note.c_str()), fflush(ct->note_to);
}

// At set-up (main, before any parallel region): --threads N fixes the count; with 0, choose it.
inline void cpu_threads_start(int threads_flag, bool quiet, FILE* note_to, const char* stat_path = "/proc/stat") {
    CpuThreads& ct = cpu_threads;
    if (threads_flag > 0) omp_set_num_threads(threads_flag);
    if (threads_flag > 0 || getenv("OMP_NUM_THREADS")) return;
    ct.quiet = quiet;
    ct.note_to = note_to;
    ct.stat_path = stat_path;
    if (sched_getaffinity(0, sizeof ct.ours, &ct.ours) != 0) return;
    ProcStat look[5];
    // an instant's count flickers: the median of five readings, back to back (a sleep between them
    // would cost a whole time slice on a busy machine)
    for (ProcStat& l : look)
        if (!read_proc_stat(ct, &l)) return;  // (no /proc: OpenMP's count, as before)
    std::sort(look, look + 5, [](const ProcStat& a, const ProcStat& b) { return a.runnable < b.runnable; });
    const ProcStat& s = look[2];
    ct.adapts = true;
    ct.now = omp_get_max_threads();
    ct.most = ct.lowest_noted = std::min(ct.now, s.cores);  // (more threads than cores is never faster)
    ct.busy_s = s.busy_ticks / sysconf(_SC_CLK_TCK);
    ct.own_s = cpu_threads_clock(CLOCK_PROCESS_CPUTIME_ID);
    ct.wall_s = cpu_threads_clock(CLOCK_MONOTONIC);
    cpu_threads_set(&ct, others_from_runnable(s), s.cores);
}

// At a step's or a token's start: after 0.5 s, the others' use over the interval sets the count.
inline void cpu_threads_adapt() {
    CpuThreads& ct = cpu_threads;
    if (!ct.adapts) return;
    if (!ct.working && !ct.pending.empty()) fprintf(ct.note_to, "%s\n", ct.pending.c_str()), fflush(ct.note_to);
    ct.working = true;
    double wall = cpu_threads_clock(CLOCK_MONOTONIC);
    if (wall - ct.wall_s < 0.5) return;  // (10 ms ticks: half a second reads a core's use to 2%)
    ProcStat s;
    if (!read_proc_stat(ct, &s)) return;
    double busy = s.busy_ticks / sysconf(_SC_CLK_TCK), own = cpu_threads_clock(CLOCK_PROCESS_CPUTIME_ID);
    double others = others_over_interval(busy - ct.busy_s, own - ct.own_s, wall - ct.wall_s);
    ct.busy_s = busy, ct.own_s = own, ct.wall_s = wall;
    cpu_threads_set(&ct, others, s.cores);
}
