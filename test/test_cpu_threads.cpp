// test_cpu_threads.cpp — the thread count on a shared machine (llmc/run/cpu_threads.h), from fake
// /proc/stat readings: the arithmetic by hand, nothing timed.
//
//   parse          a CPU's busy ticks are user + nice + system + irq + softirq + steal (not idle, not
//                  iowait), summed over the CPUs of the affinity mask only; the "cpu " total is not a
//                  CPU; procs_running is read
//   free cores     threads = cores - others, rounded to the nearest, between 1 and OpenMP's count
//   interval       two readings 1 s apart: two busy programs on 2 cores -> 1 thread; one -> 1; our
//                  own threads' time is not the others' -> every core; a daemon's 0.1 core -> every core
//   set-up         runnable tasks less this one, spread over the machine's cores
//   in the trainer cpu_threads_start on a fake /proc/stat with one more runnable task than cores
//                  lowers OpenMP's count to 1 and prints one "threads:" line when the work starts,
//                  not before (none under --quiet); a quiet machine keeps the count; --threads N and OMP_NUM_THREADS fix it;
//                  cpu_threads_adapt over a quiet interval raises the count again, a busy one lowers it
//                  without a second note
#include <fcntl.h>
#include <sched.h>
#include <unistd.h>
#include <cstdio>
#include <string>
#include <vector>
#include "llmc/run/cpu_threads.h"
#include "test/checks.h"

// /proc/stat's text for `cpus` CPUs, each with these busy ticks (user) and large idle and iowait.
static std::string fake_stat(const std::vector<int>& cpus, unsigned long long user_ticks, int runnable) {
    std::string t = "cpu  1 2 3 4 5 6 7 8 0 0\n";
    for (int c : cpus)
        t += "cpu" + std::to_string(c) + " " + std::to_string(user_ticks) + " 0 0 900000 50000 0 0 0 0 0\n";
    t += "intr 12345 0 0\nctxt 999\nprocs_running " + std::to_string(runnable) + "\nprocs_blocked 0\n";
    return t;
}

static void write_file(const std::string& path, const std::string& text) {
    FILE* f = fopen(path.c_str(), "w");
    fputs(text.c_str(), f);
    fclose(f);
}

// What cpu_threads_start printed on stderr, and then the first cpu_threads_adapt (the work starts).
static std::string stderr_of_start(int threads_flag, bool quiet, const char* path, std::string* at_start = nullptr) {
    std::string out = "/tmp/test_cpu_threads_stderr_" + std::to_string(getpid());
    fflush(stderr);
    int saved = dup(2), fd = open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    dup2(fd, 2);
    cpu_threads_start(threads_flag, quiet, stderr, path);
    fflush(stderr);
    if (at_start) *at_start = std::to_string(lseek(fd, 0, SEEK_CUR));
    cpu_threads_adapt();
    fflush(stderr);
    dup2(saved, 2);
    close(fd), close(saved);
    FILE* f = fopen(out.c_str(), "r");
    std::string text(4096, '\0');
    text.resize(fread(&text[0], 1, text.size(), f));
    fclose(f);
    unlink(out.c_str());
    return text;
}

int main() {
    // ---- parse: busy fields, the affinity mask, procs_running
    {
        std::string t = "cpu  100 100 100 100 100 100 100 100 0 0\n"
                        "cpu0 10 1 2 1000 500 3 4 5 0 0\n"      // busy 10+1+2+3+4+5 = 25
                        "cpu1 20 0 0 1000 500 0 0 0 0 0\n"      // 20
                        "cpu2 400 0 0 1000 500 0 0 0 0 0\n"     // 400, not ours
                        "cpu3 7 0 0 1000 500 0 0 1 0 0\n"       // 8
                        "procs_running 6\n";
        cpu_set_t ours;
        CPU_ZERO(&ours);
        CPU_SET(0, &ours), CPU_SET(1, &ours), CPU_SET(3, &ours);
        ProcStat s = parse_proc_stat(t.c_str(), &ours);
        check(s.busy_ticks == 53 && s.cores == 3 && s.machine_cores == 4 && s.runnable == 6,
              "parse: busy ticks without idle and iowait, over the mask's CPUs only; procs_running",
              "busy " + std::to_string(s.busy_ticks) + " cores " + std::to_string(s.cores) + " of " +
                  std::to_string(s.machine_cores) + " runnable " + std::to_string(s.runnable));
        ProcStat all = parse_proc_stat(t.c_str(), nullptr);
        check(all.busy_ticks == 453 && all.cores == 4, "parse: no mask counts every CPU (not the \"cpu \" total)",
              std::to_string(all.busy_ticks));
    }
    // ---- the free cores
    {
        struct Case { double others; int cores, most, want; };
        Case cases[] = {{2.0, 2, 2, 1}, {1.0, 2, 2, 1}, {0.0, 2, 2, 2}, {0.1, 2, 2, 2}, {0.4, 2, 2, 2},
                        {0.6, 2, 2, 1}, {6.7, 2, 2, 1}, {0.0, 16, 4, 4}, {3.2, 16, 16, 13}, {0.0, 1, 8, 1}};
        bool ok = true;
        std::string why;
        for (const Case& c : cases) {
            int got = threads_for_free_cores(c.others, c.cores, c.most);
            if (got != c.want) ok = false, why += std::to_string(c.others) + " of " + std::to_string(c.cores) + " -> " +
                                                  std::to_string(got) + " (want " + std::to_string(c.want) + ") ";
        }
        check(ok, "free cores: cores - others, rounded, between 1 and OpenMP's count", why);
    }
    // ---- an interval: two readings 1 s apart on 2 cores (100 ticks a second each)
    {
        std::vector<int> two = {0, 1};
        auto busy_s = [&](unsigned long long ticks) { return parse_proc_stat(fake_stat(two, ticks, 1).c_str(), nullptr).busy_ticks / 100.0; };
        double d = busy_s(1200) - busy_s(1100);  // each CPU busy all the second: 2 s
        check(threads_for_free_cores(others_over_interval(d, 0.0, 1.0), 2, 2) == 1,
              "interval: one busy program per core, ours asleep -> 1 thread");
        check(threads_for_free_cores(others_over_interval(d, 1.0, 1.0), 2, 2) == 1,
              "interval: they got 1 core, we the other -> 1 thread (capped use still reads as busy)");
        check(threads_for_free_cores(others_over_interval(d, 1.95, 1.0), 2, 2) == 2,
              "interval: all the busy time is ours -> every core");
        check(threads_for_free_cores(others_over_interval(busy_s(1110) - busy_s(1100), 0.0, 1.0), 2, 2) == 2,
              "interval: a daemon's tenth of a core -> every core");
        check(others_over_interval(0.5, 0.7, 1.0) == 0.0, "interval: our time above the busy time (tick rounding) is 0, not negative");
    }
    // ---- set-up: runnable tasks now
    {
        ProcStat s;
        s.runnable = 3, s.cores = 2, s.machine_cores = 2;
        double a = others_from_runnable(s);
        s.runnable = 9, s.cores = 2, s.machine_cores = 8;
        double b = others_from_runnable(s);
        s.runnable = 1;
        double c = others_from_runnable(s);
        check(a == 2.0 && b == 2.0 && c == 0.0, "set-up: runnable tasks less this one, our cores' share of them",
              std::to_string(a) + " " + std::to_string(b) + " " + std::to_string(c));
    }
    // ---- in the trainer: a fake /proc/stat for the CPUs this process may use
    {
        unsetenv("OMP_NUM_THREADS");
        cpu_set_t mask;
        sched_getaffinity(0, sizeof mask, &mask);
        std::vector<int> cpus;
        for (int c = 0; c < CPU_SETSIZE; c++)
            if (CPU_ISSET(c, &mask)) cpus.push_back(c);
        int n = (int)cpus.size();
        std::string path = "/tmp/test_cpu_threads_stat_" + std::to_string(getpid());
        const int most = 4;  // OpenMP's count, whatever this machine has (the cores cap it)
        if (n < 2) {  // (one CPU: nothing to lower)
            printf("SKIP: trainer: the count on a busy machine (this process may use one CPU only)\n");
            return check_exit_code();
        }
        std::string instead = "running on 1 thread instead of " + std::to_string(std::min(most, n));

        write_file(path, fake_stat(cpus, 1000, n + 1));  // one busy program per core, and this one
        cpu_threads = CpuThreads{}, omp_set_num_threads(most);
        std::string at_start;
        std::string note = stderr_of_start(0, false, path.c_str(), &at_start);
        check(omp_get_max_threads() == 1 && cpu_threads.adapts, "trainer: one busy program per core -> 1 thread",
              std::to_string(omp_get_max_threads()));
        check(note.rfind("threads: ", 0) == 0 && note.find(instead) != std::string::npos &&
                  note.find('\n') == note.size() - 1 && at_start == "0",
              "trainer: one line says so, when the work starts (not at set-up: an error stays one line)",
              note + " (bytes at set-up: " + at_start + ")");

        cpu_threads = CpuThreads{}, omp_set_num_threads(most);
        note = stderr_of_start(0, true, path.c_str());
        check(omp_get_max_threads() == 1 && note.empty(), "trainer: --quiet lowers it without the line", note);

        // cpu_threads_adapt, the clock's last look moved back a second: the file is unchanged (a quiet
        // interval) -> every core; then each CPU busy all that second -> 1 thread, without a second note
        cpu_threads.quiet = false;
        cpu_threads.wall_s -= 1.0;
        cpu_threads_adapt();
        int raised = omp_get_max_threads();
        write_file(path, fake_stat(cpus, 1000 + 100, 1));
        cpu_threads.wall_s -= 1.0;
        std::string out = "/tmp/test_cpu_threads_adapt_" + std::to_string(getpid());
        fflush(stderr);
        int saved = dup(2), fd = open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
        dup2(fd, 2);
        cpu_threads_adapt();
        fflush(stderr);
        dup2(saved, 2);
        close(fd), close(saved);
        FILE* f = fopen(out.c_str(), "r");
        int c0 = fgetc(f);
        fclose(f);
        unlink(out.c_str());
        check(raised == std::min(most, n) && omp_get_max_threads() == 1 && c0 == EOF,
              "trainer: a quiet interval raises the count, a busy one lowers it again, noted once",
              std::to_string(raised) + " then " + std::to_string(omp_get_max_threads()));

        write_file(path, fake_stat(cpus, 1000, 1));  // only this process runs
        cpu_threads = CpuThreads{}, omp_set_num_threads(most);
        note = stderr_of_start(0, false, path.c_str());
        check(omp_get_max_threads() == std::min(most, n) && note.empty(), "trainer: a quiet machine keeps the free cores, silently",
              std::to_string(omp_get_max_threads()) + " " + note);

        write_file(path, fake_stat(cpus, 1000, n + 1));
        cpu_threads = CpuThreads{}, omp_set_num_threads(most);
        note = stderr_of_start(3, false, path.c_str());
        bool flag_fixed = omp_get_max_threads() == 3 && !cpu_threads.adapts && note.empty();
        setenv("OMP_NUM_THREADS", "4", 1);
        cpu_threads = CpuThreads{}, omp_set_num_threads(most);
        note = stderr_of_start(0, false, path.c_str());
        check(flag_fixed && omp_get_max_threads() == most && !cpu_threads.adapts && note.empty(),
              "trainer: --threads N and OMP_NUM_THREADS fix the count on a busy machine");
        unsetenv("OMP_NUM_THREADS");
        unlink(path.c_str());
    }
    return check_exit_code();
}
