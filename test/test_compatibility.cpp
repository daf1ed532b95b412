// test_compatibility.cpp — walks llmc/run/compatibility.h's table against the trainers themselves.
//
//   rows      every row's example flags, at the smallest shape (L=4, C=64, H=4, T=64, B=1), on each
//             trainer the row refuses in (and whose flag table takes the flags): the table, asked
//             in-process, names this row; the trainer's --estimate (train_gpt_cpu, or the emulated
//             build/emu/train_gpt, _fp16, _fp32 for a row of a build) exits 2 with exactly the row's
//             line on stderr: "error: <line>".
//   pairs     every pair of the techniques below, on each trainer that takes both: the table's verdict
//             (allowed, or the first refusing row's line) is the trainer's: exit 0, or exit 2 and that
//             line. So an allowed pair is accepted by the flag checks, --estimate and the Shape rows
//             alike, and a refused one refused with the table's words.
//   plan      with each technique alone, every grid --plan 4 --verbose ranks is one the table allows
//             for those flags on that grid (the planner reads the same rows for every grid it tries).
//   census    the table holds CENSUS_ROWS rows, no two alike (a, b, trainers): deleting or adding a row
//             is a change this test makes visible, to be written here too.
//   planted   negative controls, in-process: the same walks with a table one row short (the 2BW x
//             tensor-parallel row deleted) must fail: the census counts one row less, and the pair
//             walk finds the pair (2bw, tensor-parallel) allowed by the short table and refused by the
//             trainer. A walk that cannot see a missing row would pass them.
//
// Run time: 663 --estimate runs (83 rows' examples, 580 pairs) and 46 of --plan, 8 at a time: 3 to
// 10 s on a loaded 2-core machine.
#include <sys/wait.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>
#include "test/checks.h"
#include "llmc/memory/estimate.h"  // estimate_config: the --model spec's shape, as --estimate reads it
#include "llmc/run/compatibility.h"

static const int CENSUS_ROWS = 68;
static const char* BASE = "--model L=4,C=64,H=4,T=64 --batch-size 1 --seq-len 64 --total-batch-tokens 768";

// The techniques of the pair walk: compatibility.h's compat_techniques(), with their references.

static std::vector<std::string> words(const std::string& s) {
    std::istringstream in(s);
    std::vector<std::string> w;
    for (std::string x; in >> x;) w.push_back(x);
    return w;
}

// One configuration: its flags (name -> value, "" for a switch, in order) and its GPU build.
struct Config {
    std::vector<std::pair<std::string, std::string>> flags;
    std::string build = "bf16";
    bool conflict = false;  // two techniques set one flag to different values
    std::set<std::string> base;  // the flags BASE set, which a technique may change
};

static void add_flags(Config* c, const std::string& text) {
    std::vector<std::string> w = words(text);
    bool base = c->flags.empty();
    for (size_t i = 0; i < w.size(); i++) {
        if (w[i][0] == '@') { c->build = w[i].substr(1); continue; }
        std::string name = w[i], value = (i + 1 < w.size() && w[i + 1].rfind("--", 0) != 0 && w[i + 1][0] != '@') ? w[++i] : "";
        auto at = std::find_if(c->flags.begin(), c->flags.end(), [&](const auto& f) { return f.first == name; });
        if (at == c->flags.end()) {
            c->flags.push_back({name, value});
            if (base) c->base.insert(name);
        } else if (c->base.count(name)) at->second = value, c->base.erase(name);
        else if (at->second != value) c->conflict = true;
    }
}

static std::vector<std::string> argv_of(const Config& c) {
    std::vector<std::string> a;
    for (const auto& f : c.flags) {
        a.push_back(f.first);
        if (!f.second.empty()) a.push_back(f.second);
    }
    return a;
}

// Whether this trainer's flag table takes every flag (a GPU-only flag is refused by the CPU's parser).
static bool takes(const Config& c, Trainer t) {
    TrainOptions o = default_options(t);
    std::vector<FlagSpec> table = flag_table(o);
    for (const auto& f : c.flags) {
        const FlagSpec* spec = nullptr;
        for (const FlagSpec& s : table)
            if (f.first == std::string("--") + s.name) spec = &s;
        if (!spec || !flag_applies(*spec, t)) return false;
    }
    return t == Trainer::GPU || c.build == "bf16";
}

// The table's verdict, in-process, as the trainer's main reaches it: the Flags rows, then (--estimate)
// the Shape rows on the flags' grid. "" = allowed.
static std::string table_verdict(const Config& c, Trainer t, const std::vector<CompatRow>& table) {
    std::vector<std::string> a = argv_of(c);
    std::vector<char*> argv = {(char*)"trainer"};
    for (std::string& s : a) argv.push_back(&s[0]);
    TrainOptions o;
    parse_command_line((int)argv.size(), argv.data(), t, &o);
    validate_options(o);
    CompatRun r;
    r.o = &o, r.trainer = t, r.build = t == Trainer::CPU ? "fp32" : c.build.c_str();
    std::string why = compatibility_problem(r, CompatMoment::Flags, table);
    if (!why.empty()) return why;
    int world = o.estimate_ranks * o.tensor_parallel * o.pipeline_parallel;
    if (!make_grid(world, 0, o.tensor_parallel, o.pipeline_parallel, 0, o.zero_stage, o.sequence_parallel, &r.grid).empty())
        return "(no grid)";
    r.cfg = estimate_config(o);
    RunPlan plan = plan_run(o, r.cfg, r.grid.dp, 0);
    r.B = plan.B, r.T = plan.T, r.micro_batches = plan.accumulation_steps;
    return compatibility_problem(r, CompatMoment::Shape, table);
}

static std::string binary_of(const Config& c, Trainer t) {
    if (t == Trainer::CPU) return "./train_gpt_cpu";
    return c.build == "bf16" ? "build/emu/train_gpt" : "build/emu/train_gpt_" + c.build;
}

// The trainer's answer: its exit code and its stderr, from --estimate (stdout discarded).
struct Answer {
    int code = -1;
    std::string err, out;
};

static std::string slurp(const std::string& path) {
    std::string text;
    FILE* f = fopen(path.c_str(), "r");
    if (!f) return text;
    char buf[4096];
    for (size_t n; (n = fread(buf, 1, sizeof buf, f)) > 0;) text.append(buf, n);
    fclose(f);
    remove(path.c_str());
    return text;
}

// Runs the commands 8 at a time (each writes its stdout and stderr to files of its own).
static std::vector<Answer> run_all(const std::vector<std::string>& commands) {
    std::vector<Answer> out(commands.size());
    char dir[] = "/tmp/test_compatibility_XXXXXX";
    if (!mkdtemp(dir)) { perror("mkdtemp"); exit(1); }
    for (size_t i = 0; i < commands.size(); i += 8) {
        std::string batch;
        for (size_t k = i; k < std::min(commands.size(), i + 8); k++) {
            std::string base = std::string(dir) + "/" + std::to_string(k);
            batch += "(" + commands[k] + " >" + base + ".out 2>" + base + ".err; echo $? > " + base + ".rc) & ";
        }
        batch += "wait";
        if (system(batch.c_str()) != 0) fprintf(stderr, "warning: a batch of runs returned non-zero\n");
        for (size_t k = i; k < std::min(commands.size(), i + 8); k++) {
            std::string base = std::string(dir) + "/" + std::to_string(k);
            std::string rc = slurp(base + ".rc");
            out[k].code = rc.empty() ? -1 : atoi(rc.c_str());
            out[k].err = slurp(base + ".err");
            out[k].out = slurp(base + ".out");
        }
    }
    rmdir(dir);
    return out;
}

static std::string command_of(const Config& c, Trainer t, const char* mode = "--estimate") {
    std::string cmd = binary_of(c, t);
    for (const std::string& a : argv_of(c)) cmd += " " + a;
    return cmd + " " + mode;
}

// Whether the trainer said what the table says: exit 0 for "", else exit 2 and exactly "error: <line>".
static bool agrees(const std::string& verdict, const Answer& a) {
    if (verdict.empty()) return a.code == 0;
    return a.code == 2 && a.err == "error: " + verdict + "\n";
}

struct PairCase {
    std::string name;
    Config config;
    Trainer trainer;
    size_t i = 0, j = 0;  // its two techniques (compat_techniques())
};

static std::vector<PairCase> pair_cases() {
    std::vector<PairCase> cases;
    const std::vector<CompatTechnique>& TECHNIQUES = compat_techniques();
    for (size_t i = 0; i < TECHNIQUES.size(); i++)
        for (size_t j = i + 1; j < TECHNIQUES.size(); j++)
            for (Trainer t : {Trainer::CPU, Trainer::GPU}) {
                Config c;
                add_flags(&c, BASE);
                add_flags(&c, TECHNIQUES[i].flags);
                add_flags(&c, TECHNIQUES[j].flags);
                if (c.conflict || !takes(c, t)) continue;
                cases.push_back({std::string(t == Trainer::CPU ? "cpu " : "gpu ") + TECHNIQUES[i].name + " x " + TECHNIQUES[j].name,
                                 c, t, i, j});
            }
    return cases;
}

// A pair's reference (test/test_combination_walk.py runs both): the techniques of its most exact kind
// replaced by their references (bits, then a tolerance, then grid; own ones stay). `exact` names how the two
// runs must agree ("bits", "grid" or the tolerances, '+'-joined); "" = no reference (two own techniques).
struct Reference {
    std::string exact;
    Config config;
    Trainer trainer = Trainer::CPU;
};

static int exact_rank(const std::string& e) {
    return e == "bits" ? 0 : e == "grid" ? 2 : e == "own" ? 3 : 1;
}

// A technique's exactness on this trainer ("cpu/gpu": one each).
static std::string exact_on(const CompatTechnique& t, Trainer trainer) {
    std::string e = t.exact;
    size_t slash = e.find('/');
    if (slash == std::string::npos) return e;
    return trainer == Trainer::CPU ? e.substr(0, slash) : e.substr(slash + 1);
}

static Reference reference_of(const PairCase& p) {
    const std::vector<CompatTechnique>& tq = compat_techniques();
    const CompatTechnique* two[2] = {&tq[p.i], &tq[p.j]};
    std::string exact[2] = {exact_on(*two[0], p.trainer), exact_on(*two[1], p.trainer)};
    int kind = std::min(exact_rank(exact[0]), exact_rank(exact[1]));
    Reference ref;
    ref.trainer = p.trainer;
    if (kind == 3) return ref;
    add_flags(&ref.config, BASE);
    ref.config.build = p.config.build;
    for (int k = 0; k < 2; k++) {
        const CompatTechnique* t = two[k];
        const CompatTechnique* other = two[1 - k];
        if (exact_rank(exact[k]) != kind) { add_flags(&ref.config, t->flags); continue; }
        if (std::string(other->loosens) == t->name) {  // (kept, the other makes this one agree within its own bounds)
            add_flags(&ref.config, t->reference);
            ref.exact = exact[1 - k];
            continue;
        }
        if (std::string(t->reference) == "@cpu") ref.trainer = Trainer::CPU;
        else add_flags(&ref.config, t->reference);
        if (ref.exact.find(exact[k]) == std::string::npos) ref.exact += (ref.exact.empty() ? "" : "+") + exact[k];
    }
    if (ref.trainer == Trainer::CPU) ref.config.build = "bf16";
    return ref;
}

// The flags after BASE's (a technique's own), as one string.
static std::string own_flags(const Config& c) {
    Config base;
    add_flags(&base, BASE);
    std::string out;
    for (const auto& f : c.flags) {
        auto at = std::find_if(base.flags.begin(), base.flags.end(), [&](const auto& b) { return b.first == f.first; });
        if (at != base.flags.end() && at->second == f.second) continue;
        out += (out.empty() ? "" : " ") + f.first + (f.second.empty() ? "" : " " + f.second);
    }
    return out;
}

// The pair walk against `table`: the pairs where the trainers disagree with it.
static std::vector<std::string> pair_walk(const std::vector<PairCase>& cases, const std::vector<Answer>& answers,
                                          const std::vector<CompatRow>& table, int* allowed, int* refused) {
    std::vector<std::string> disagree;
    *allowed = *refused = 0;
    for (size_t k = 0; k < cases.size(); k++) {
        std::string verdict = table_verdict(cases[k].config, cases[k].trainer, table);
        (verdict.empty() ? *allowed : *refused) += 1;
        if (!agrees(verdict, answers[k]))
            disagree.push_back(cases[k].name + ": the table says '" + (verdict.empty() ? "allowed" : verdict) + "', the trainer exit " +
                               std::to_string(answers[k].code) + " '" + answers[k].err.substr(0, 200) + "'");
    }
    return disagree;
}

static int census(const std::vector<CompatRow>& table, std::string* why) {
    std::set<std::string> seen;
    for (const CompatRow& r : table) {
        std::string key = std::string(r.a) + " | " + r.b + " | " + std::to_string(r.trainers) + " | " + std::to_string((int)r.moment);
        if (!seen.insert(key).second) *why += "two rows " + key + "; ";
    }
    return (int)table.size();
}

// --pairs: the allowed pairs and their references, one a line, for test/test_combination_walk.py:
//   trainer <tab> name <tab> exact <tab> build <tab> flags <tab> reference trainer <tab> its build <tab> its flags
static int print_pairs() {
    for (const PairCase& p : pair_cases()) {
        if (!table_verdict(p.config, p.trainer, compatibility_table()).empty()) continue;
        Reference r = reference_of(p);
        if (r.exact.empty()) r.exact = "elsewhere";  // (MoE with a factored optimizer: test_moe_trainer.py)
        auto trainer = [](Trainer t) { return t == Trainer::CPU ? "cpu" : "gpu"; };
        printf("%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", trainer(p.trainer), p.name.substr(4).c_str(), r.exact.c_str(),
               p.config.build.c_str(), own_flags(p.config).c_str(), trainer(r.trainer), r.config.build.c_str(),
               own_flags(r.config).c_str());
    }
    return 0;
}

int main(int argc, char** argv) {
    if (argc > 1 && std::string(argv[1]) == "--pairs") return print_pairs();
    const std::vector<CompatRow>& table = compatibility_table();

    // ---- census
    std::string dup;
    int rows = census(table, &dup);
    check(rows == CENSUS_ROWS && dup.empty(), "census: the table holds " + std::to_string(CENSUS_ROWS) + " rows, no two alike",
          std::to_string(rows) + " rows; " + dup);

    // ---- rows: each example refused by the trainer(s) with the row's line
    std::vector<std::string> commands;
    std::vector<std::pair<size_t, Trainer>> row_runs;
    std::vector<std::string> unusable;
    for (size_t i = 0; i < table.size(); i++) {
        Config c;
        add_flags(&c, BASE);
        add_flags(&c, table[i].example);
        bool any = false;
        for (Trainer t : {Trainer::CPU, Trainer::GPU}) {
            if (!(table[i].trainers & (t == Trainer::CPU ? ON_CPU : ON_GPU)) || !takes(c, t)) continue;
            any = true;
            row_runs.push_back({i, t});
            commands.push_back(command_of(c, t));
        }
        if (!any) unusable.push_back(std::string(table[i].a) + " x " + table[i].b);
    }
    check(unusable.empty(), "rows: every row's example runs on a trainer it refuses in", "not: " + std::to_string(unusable.size()));
    std::vector<Answer> answers = run_all(commands);
    std::vector<std::string> wrong;
    std::map<Trainer, int> per_trainer;
    for (size_t k = 0; k < row_runs.size(); k++) {
        const CompatRow& row = table[row_runs[k].first];
        Trainer t = row_runs[k].second;
        Config c;
        add_flags(&c, BASE);
        add_flags(&c, row.example);
        // the example meets this row first: the table's verdict is this row's line
        std::string verdict = table_verdict(c, t, table);
        std::string name = std::string(t == Trainer::CPU ? "cpu " : "gpu ") + row.a + " x " + row.b;
        std::vector<CompatRow> only = {row};
        bool this_row = !verdict.empty() && verdict == table_verdict(c, t, only);
        if (!this_row || !agrees(verdict, answers[k]))
            wrong.push_back(name + ": table '" + verdict + "'" + (this_row ? "" : " (not this row's)") + ", trainer exit " +
                            std::to_string(answers[k].code) + " '" + answers[k].err.substr(0, 200) + "'");
        per_trainer[t]++;
    }
    std::string first_wrong = wrong.empty() ? "" : wrong[0];
    if (getenv("VERBOSE")) for (const std::string& d : wrong) printf("  %s\n", d.c_str());
    check(wrong.empty(), "rows: " + std::to_string(row_runs.size()) + " examples (" + std::to_string(per_trainer[Trainer::CPU]) +
          " on train_gpt_cpu, " + std::to_string(per_trainer[Trainer::GPU]) + " on build/emu/train_gpt*) exit 2 with their row's line",
          std::to_string(wrong.size()) + " wrong, the first: " + first_wrong);

    // ---- pairs: the trainers' verdict is the table's
    std::vector<PairCase> cases = pair_cases();
    commands.clear();
    for (const PairCase& p : cases) commands.push_back(command_of(p.config, p.trainer));
    std::vector<Answer> pair_answers = run_all(commands);
    int allowed = 0, refused = 0;
    std::vector<std::string> disagree = pair_walk(cases, pair_answers, table, &allowed, &refused);
    check(disagree.empty(), "pairs: " + std::to_string(cases.size()) + " technique pairs on the trainers that take them (" +
          std::to_string(allowed) + " allowed: exit 0; " + std::to_string(refused) + " refused: exit 2, the table's line)",
          std::to_string(disagree.size()) + " disagree, the first: " + (disagree.empty() ? "" : disagree[0]));
    if (getenv("VERBOSE")) for (const std::string& d : disagree) printf("  %s\n", d.c_str());

    // ---- references: every allowed pair has one (compat_techniques()), which the table allows on its trainer
    std::vector<std::string> no_reference, elsewhere;
    int with_reference = 0;
    for (const PairCase& p : cases) {
        if (!table_verdict(p.config, p.trainer, table).empty()) continue;
        Reference r = reference_of(p);
        if (r.exact.empty() && p.config.flags.end() != std::find_if(p.config.flags.begin(), p.config.flags.end(), [](const auto& f) {
                return f.first == "--moe-experts"; })) {
            elsewhere.push_back(p.name);  // (own x own: MoE with a factored optimizer, test_moe_trainer.py's)
            continue;
        }
        std::string why = r.exact.empty() ? "none" : table_verdict(r.config, r.trainer, table);
        bool itself = argv_of(r.config) == argv_of(p.config) && r.trainer == p.trainer && r.config.build == p.config.build;
        if (why.empty() && !itself) with_reference++;
        else no_reference.push_back(p.name + ": " + (why.empty() ? "the reference is the pair itself" : why));
    }
    std::string others;
    for (const std::string& e : elsewhere) others += (others.empty() ? "" : ", ") + e;
    check(no_reference.empty(), "references: each of the " + std::to_string(with_reference) + " allowed pairs has a reference run "
          "the table allows (two own techniques together are refused, but " + others + ": test_moe_trainer.py)",
          std::to_string(no_reference.size()) +
          " without, the first: " + (no_reference.empty() ? "" : no_reference[0]));

    // ---- plan: every grid --plan 4 ranks, with each technique, is one the table allows
    std::vector<PairCase> plans;
    commands.clear();
    for (const CompatTechnique& tq : compat_techniques())
        for (Trainer t : {Trainer::CPU, Trainer::GPU}) {
            Config c;
            add_flags(&c, BASE);
            add_flags(&c, tq.flags);
            if (!takes(c, t) || !table_verdict(c, t, table).empty()) continue;  // (a refused flag set plans nothing)
            c.flags.erase(std::remove_if(c.flags.begin(), c.flags.end(), [](const auto& f) { return f.first == "--estimate-ranks"; }),
                          c.flags.end());  // (the planner picks the data degree, but for experts: train_gpt_cpu's main wants it)
            if (std::string(tq.flags).find("--expert-parallel") != std::string::npos) add_flags(&c, "--estimate-ranks 4");
            plans.push_back({std::string(t == Trainer::CPU ? "cpu " : "gpu ") + tq.name, c, t});
            commands.push_back(command_of(c, t, "--plan 4 --verbose"));
        }
    std::vector<Answer> plan_answers = run_all(commands);
    int grids = 0;
    std::vector<std::string> bad_plans;
    for (size_t k = 0; k < plans.size(); k++) {
        std::istringstream out(plan_answers[k].out);
        for (std::string line; std::getline(out, line);) {
            int dp, tp, pp, zero, m;
            if (sscanf(line.c_str(), " %d %d %d %d %d ", &dp, &tp, &pp, &zero, &m) != 5 || line.find("MiB") == std::string::npos) continue;
            Config c = plans[k].config;
            c.base = {"--tensor-parallel", "--pipeline-parallel", "--zero", "--estimate-ranks", "--sequence-parallel"};
            for (const auto& f : c.flags) c.base.insert(f.first);  // (the grid's degrees replace the technique's)
            add_flags(&c, "--tensor-parallel " + std::to_string(tp) + " --pipeline-parallel " + std::to_string(pp) + " --zero " +
                          std::to_string(zero) + " --estimate-ranks " + std::to_string(dp));
            if (tp == 1) add_flags(&c, "--sequence-parallel 0");
            grids++;
            std::string verdict = table_verdict(c, plans[k].trainer, table);
            if (!verdict.empty()) bad_plans.push_back(plans[k].name + ": --plan ranks dp " + std::to_string(dp) + " tp " +
                                                      std::to_string(tp) + " pp " + std::to_string(pp) + " zero " +
                                                      std::to_string(zero) + ", which the table refuses: " + verdict);
        }
        if (plan_answers[k].code != 0) bad_plans.push_back(plans[k].name + ": --plan exit " + std::to_string(plan_answers[k].code));
    }
    check(bad_plans.empty() && grids > 0, "plan: " + std::to_string(grids) + " grids ranked by --plan 4 over " +
          std::to_string(plans.size()) + " technique runs, each one the table allows",
          std::to_string(bad_plans.size()) + " refused, the first: " + (bad_plans.empty() ? "" : bad_plans[0]));
    if (getenv("VERBOSE")) for (const std::string& d : bad_plans) printf("  %s\n", d.c_str());

    // ---- planted: the table one row short (2BW x tensor parallelism) must fail both walks
    std::vector<CompatRow> planted;
    for (const CompatRow& r : table)
        if (!(std::string(r.a) == "--pipeline-schedule 2bw" && std::string(r.b) == "--tensor-parallel")) planted.push_back(r);
    std::string none;
    check(planted.size() == table.size() - 1 && census(planted, &none) != CENSUS_ROWS,
          "planted: the census notices a deleted row", std::to_string(planted.size()) + " rows");
    int a2 = 0, r2 = 0;
    std::vector<std::string> caught = pair_walk(cases, pair_answers, planted, &a2, &r2);
    bool names_it = !caught.empty() && std::all_of(caught.begin(), caught.end(), [](const std::string& s) {
        return s.find("2bw") != std::string::npos && s.find("tensor-parallel") != std::string::npos;
    });
    check(names_it, "planted: the pair walk notices the deleted row (" + std::to_string(caught.size()) +
          " pairs of 2bw x tensor-parallel disagree)", caught.empty() ? "none disagree" : caught[0]);
    return check_exit_code();
}
