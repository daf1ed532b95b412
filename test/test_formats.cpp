// test_formats.cpp — the file formats round-trip exactly, and bad files fail with a clear message.
//
// Each "bad input" case runs the reader in a forked child (the readers exit on error, as the
// trainers should) and checks that the child exited non-zero and that its message names the
// problem. The byte layouts are also checked against the documented headers directly, so a writer
// and a reader that were wrong in the same way would still be caught.
#include <cstddef>
#include <sys/wait.h>
#include <unistd.h>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>
#include "llmc/io/formats.h"
#include "llmc/io/dataloader.h"
#include "llmc/model/model.h"
#include "llmc/optim/schedule.h"
#include "test/checks.h"

// Runs fn in a child process; returns (exit code, stderr text).
static std::pair<int, std::string> run_child(const std::function<void()>& fn) {
    char path[] = "/tmp/llmc_test_stderr_XXXXXX";
    int fd = mkstemp(path);
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fd, 2);
        fn();
        exit(0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    std::vector<char> text = read_whole_file(path, "stderr capture");
    close(fd);
    unlink(path);
    return {WIFEXITED(status) ? WEXITSTATUS(status) : 128, std::string(text.begin(), text.end())};
}

static void check_fails(const std::string& name, const std::function<void()>& fn, const std::string& must_contain) {
    auto [code, err] = run_child(fn);
    bool ok = code != 0 && err.find(must_contain) != std::string::npos && err.rfind("error: ", 0) == 0;
    check(ok, name, strprintf("exit %d, stderr: %s (expected a message containing '%s')", code, err.c_str(), must_contain.c_str()));
}

static void write_bytes(const std::string& path, const std::vector<char>& bytes) {
    FILE* f = fopen(path.c_str(), "wb");
    fwrite(bytes.data(), 1, bytes.size(), f);
    fclose(f);
}

int main() {
    std::string dir = "/tmp/llmc_test_formats_" + std::to_string(getpid());
    make_dirs(dir);

    // ---- model files
    GPT2Config cfg;
    parse_model_descriptor("L=2,C=32,H=4,T=16,V=300", &cfg);
    check(cfg.padded_vocab_size == 384, "vocab 300 pads to 384");
    ParamLayout layout = param_layout(cfg);
    size_t C = 32, L = 2, Vp = 384, T = 16;
    check(layout.total == Vp * C + T * C + L * (12 * C * C + 13 * C) + 2 * C, "parameter count formula");
    GPT2Config d12;
    parse_model_descriptor("d12", &d12);
    check(param_layout(d12).total == 124475904, "d12 has 124,475,904 parameters (GPT-2 small with padded vocab)");

    std::vector<float> params(layout.total);
    init_gpt2_params(cfg, 7, params.data(), 0, params.size());
    std::string model_path = dir + "/model.bin";
    write_model_file(model_path, cfg, params.data(), false);
    {
        std::vector<char> raw = read_whole_file(model_path, "model");
        const int32_t* h = (const int32_t*)raw.data();
        check(raw.size() == 1024 + layout.total * 4 && h[0] == 20240326 && h[1] == 3 && h[2] == 16 && h[3] == 300 &&
              h[4] == 2 && h[5] == 4 && h[6] == 32 && h[7] == 384,
              "model v3 header is llm.c's layout");
        GPT2Config back;
        std::vector<float> loaded;
        read_model_file(model_path, &back, &loaded);
        check(loaded == params && back.channels == 32 && back.padded_vocab_size == 384, "model v3 round trip is exact");
    }
    std::string bf16_path = dir + "/model_bf16.bin";
    write_model_file(bf16_path, cfg, params.data(), true);
    {
        GPT2Config back;
        std::vector<float> loaded;
        read_model_file(bf16_path, &back, &loaded);
        bool close = true;
        for (size_t i = 0; i < params.size(); i++)
            if (std::fabs(loaded[i] - params[i]) > std::fabs(params[i]) * (1.0f / 256.0f)) close = false;
        check(close, "model v5 (bf16) round trip within bf16 rounding (2^-9 relative)");
        write_model_file(bf16_path, cfg, loaded.data(), true);
        std::vector<float> again;
        read_model_file(bf16_path, &back, &again);
        check(again == loaded, "bf16 values survive a second bf16 round trip exactly");
    }
    {   // version 7, a mixture-of-experts model: E, top-k, every in h[8..10], the MoE table after the 16 tensors
        MoEConfig moe{3, 2};  // 3 experts in block 1 of 2
        std::vector<float> table(moe_layout(cfg, moe).total);
        init_moe_params(cfg, moe, moe_layout(cfg, moe), 7, table.data());
        std::string moe_path = dir + "/model_moe.bin";
        write_moe_model_file(moe_path, cfg, moe, 2, params.data(), table.data());
        std::vector<char> raw = read_whole_file(moe_path, "model");
        const int32_t* h = (const int32_t*)raw.data();
        size_t expected = 1024 + (layout.total + 1 * (3 * C + 2 * (8 * C * C + 5 * C))) * 4;  // docs/formats.md's size
        check(raw.size() == expected && h[1] == 7 && h[8] == 3 && h[9] == 2 && h[10] == 2, "model v7 (MoE): header and size");
        GPT2Config back;
        std::vector<float> loaded, loaded_moe;
        read_model_file(moe_path, &back, &loaded, &loaded_moe);
        check(loaded == params && loaded_moe == table, "model v7 round trip is exact (dense table and MoE table)");
        check_fails("a dense-only reader refuses model v7", [&] { GPT2Config c; std::vector<float> p; read_model_file(moe_path, &c, &p); },
                    "is a mixture-of-experts model (version 7: 3 experts)");
        std::vector<float> m(table.size(), 0.5f), v(table.size(), 0.25f), m2(table.size()), v2(table.size());
        write_moe_state(dir + "/moe_state.bin", moe, 2, 0, m.data(), v.data(), m.size());
        read_moe_state(dir + "/moe_state.bin", moe, 2, 0, table.size(), &m2, &v2);
        check(m2 == m && v2 == v, "moe_state.bin round trip is exact");
        check_fails("moe_state.bin of another top-k is refused", [&] { read_moe_state(dir + "/moe_state.bin", moe, 1, 0, table.size(), &m2, &v2); },
                    "does not belong with this checkpoint");
        // version 2: a factored optimizer's statistics (one array), and the optimizer named in field 7
        std::vector<float> stats(37, 0.125f), stats2, none;
        write_moe_state(dir + "/moe_factored.bin", moe, 2, 1, stats.data(), nullptr, stats.size());
        std::vector<char> fraw = read_whole_file(dir + "/moe_factored.bin", "MoE state");
        const int32_t* fh = (const int32_t*)fraw.data();
        read_moe_state(dir + "/moe_factored.bin", moe, 2, 1, stats.size(), &stats2, &none);
        check(fraw.size() == 1024 + 37 * 4 && fh[1] == 2 && fh[7] == 1 && stats2 == stats && none.empty(),
              "moe_state.bin version 2 with Adafactor's statistics: header, size and round trip");
        check_fails("moe_state.bin of Adafactor resumed with SM3 is refused",
                    [&] { read_moe_state(dir + "/moe_factored.bin", moe, 2, 2, stats.size(), &stats2, &none); }, "resume with --optimizer adafactor");
        // a version 1 file (AdamW's, before field 7) is still read
        std::vector<char> v1 = read_whole_file(dir + "/moe_state.bin", "MoE state");
        ((int32_t*)v1.data())[1] = 1;
        { FILE* f = fopen((dir + "/moe_v1.bin").c_str(), "wb"); fwrite(v1.data(), 1, v1.size(), f); fclose(f); }
        read_moe_state(dir + "/moe_v1.bin", moe, 2, 0, table.size(), &m2, &v2);
        check(m2 == m && v2 == v, "moe_state.bin version 1 (AdamW's m and v) is still read");
    }
    {   // --expert-parallel's slices of the MoE table (llmc/parallel/expert_parallel.h): E = 8 in 2 blocks of 2,
        // over 4 ranks. Each rank's initialisation is the whole table's at its runs, and the 4 slices'
        // runs cover every expert once and the routers on every rank
        MoEConfig moe{8, 1};
        MoELayout whole = moe_layout(cfg, moe);
        std::vector<float> table(whole.total), cover(whole.total, 0.0f);
        init_moe_params(cfg, moe, whole, 7, table.data());
        bool same = true;
        size_t held_total = 0;
        for (int q = 0; q < 4; q++) {
            MoELayout mine = moe_layout(cfg, moe, moe_held_experts(moe, 4, q));
            std::vector<float> slice(mine.total);
            init_moe_params(cfg, moe, mine, 7, slice.data());
            for (const MoETableRun& r : moe_table_runs(whole, mine))
                for (size_t i = 0; i < r.count; i++) {
                    same = same && slice[r.held + i] == table[r.whole + i];
                    cover[r.whole + i] += 1.0f;
                }
            held_total += mine.total - mine.count[MOE_ROUTER];
            check(mine.held_experts == (q == 0 ? 1 : 2) && mine.first_expert == (q == 0 ? 1 : 2 * q),
                  "expert parallel: rank q holds experts max(1, 2q) .. 2q + 1");
        }
        bool covered = held_total == whole.total - whole.count[MOE_ROUTER];
        for (size_t i = 0; i < whole.total; i++) covered = covered && cover[i] == (i < whole.count[MOE_ROUTER] ? 4.0f : 1.0f);
        check(same, "expert parallel: a rank's slice initialises to the whole table's values at its runs");
        check(covered, "expert parallel: the 4 slices hold each expert once, the routers on every rank");
    }
    check(float_to_bf16_round_nearest(1.0f + 1.0f / 256.0f) == 0x3f80 && float_to_bf16_round_nearest(1.0f + 3.0f / 256.0f) == 0x3f82,
          "bf16 rounding is round-half-to-even");

    // ---- initialisation
    {
        std::vector<float> again(layout.total);
        init_gpt2_params(cfg, 7, again.data(), 0, again.size());
        std::vector<float> slice(1000);
        size_t begin = layout.offset[QKVW] + 123;
        init_gpt2_params(cfg, 7, slice.data(), begin, begin + slice.size());
        bool slice_ok = std::equal(slice.begin(), slice.end(), params.begin() + begin);
        check(again == params && slice_ok, "init is deterministic and any slice initialises identically");
        auto stats = [&](int t, size_t skip_tail) {
            double s = 0, s2 = 0;
            size_t n = layout.count[t] - skip_tail;
            for (size_t i = 0; i < n; i++) { double x = params[layout.offset[t] + i]; s += x; s2 += x * x; }
            return std::make_pair(s / n, std::sqrt(s2 / n - (s / n) * (s / n)));
        };
        auto [m_qkv, sd_qkv] = stats(QKVW, 0);
        auto [m_proj, sd_proj] = stats(FCPROJW, 0);
        check(std::fabs(m_qkv) < 1e-3 && std::fabs(sd_qkv - 0.02) < 0.001, "qkvw ~ N(0, 0.02)",
              strprintf("mean %g std %g", m_qkv, sd_qkv));
        check(std::fabs(sd_proj - 0.02 / std::sqrt(4.0)) < 0.0007, "fcprojw ~ N(0, 0.02/sqrt(2L))", strprintf("std %g", sd_proj));
        bool padding_zero = true;
        for (size_t i = 300 * C; i < Vp * C; i++) padding_zero &= params[layout.offset[WTE] + i] == 0.0f;
        bool gains = params[layout.offset[LN1W]] == 1.0f && params[layout.offset[LN1B]] == 0.0f && params[layout.offset[QKVB]] == 0.0f;
        check(padding_zero && gains, "padded wte rows are 0, LayerNorm gains 1, biases 0");
    }

    // ---- token shards
    std::vector<uint16_t> tokens(1000);
    for (size_t i = 0; i < tokens.size(); i++) tokens[i] = (uint16_t)((i * 7919) % 50257);
    std::string shard_path = dir + "/shard.bin";
    write_token_shard(shard_path, tokens);
    {
        std::vector<char> raw = read_whole_file(shard_path, "shard");
        const int32_t* h = (const int32_t*)raw.data();
        check(raw.size() == 1024 + 2000 && h[0] == 20240520 && h[1] == 1 && h[2] == 1000 &&
              ((const uint16_t*)(raw.data() + 1024))[5] == tokens[5], "token shard header is llm.c's layout");
        check(read_token_shard(shard_path) == tokens, "token shard round trip is exact");
    }

    // ---- training state
    {
        TrainState s;
        s.header.step = 1234;
        s.header.num_params = 10;
        s.header.shard_begin = 4;
        s.header.shard_count = 3;
        s.header.rank = 1;
        s.header.world_size = 2;
        s.header.has_master_weights = 1;
        s.header.sampler_rng = 0xDEADBEEFCAFEull;
        s.header.train_loader = LoaderPosition{2, 4096, 1};
        s.m = {1, 2, 3};
        s.v = {4, 5, 6};
        s.master = {7, 8, 9};
        write_train_state(dir + "/state.bin", s);
        TrainState r = read_train_state(dir + "/state.bin");
        check(r.header.step == 1234 && r.header.shard_begin == 4 && r.header.rank == 1 && r.header.world_size == 2 &&
              r.header.sampler_rng == 0xDEADBEEFCAFEull && r.header.train_loader.position == 4096 &&
              r.header.train_loader.shard_index == 2 && r.m == s.m && r.v == s.v && r.master == s.master,
              "training state round trip is exact");
    }

    // ---- atomic writes: an uncommitted write leaves the previous file untouched
    {
        std::string path = dir + "/atomic.bin";
        write_token_shard(path, tokens);
        pid_t pid = fork();
        if (pid == 0) {  // a writer that dies halfway
            AtomicFile out(path, "token shard");
            out.write(tokens.data(), 100);
            _exit(3);
        }
        int status;
        waitpid(pid, &status, 0);
        check(read_token_shard(path) == tokens, "a writer killed mid-write leaves the old file intact");
    }

    // ---- bad inputs
    check_fails("missing model file", [&] { GPT2Config c; std::vector<float> p; read_model_file(dir + "/nope.bin", &c, &p); },
                "cannot open model file");
    {
        std::vector<char> raw = read_whole_file(model_path, "model");
        std::vector<char> cut(raw.begin(), raw.begin() + raw.size() - 100);
        write_bytes(dir + "/truncated_model.bin", cut);
        check_fails("truncated model file", [&] { GPT2Config c; std::vector<float> p; read_model_file(dir + "/truncated_model.bin", &c, &p); },
                    "truncated");
        std::vector<char> bad = raw;
        ((int32_t*)bad.data())[1] = 4;
        write_bytes(dir + "/badversion.bin", bad);
        check_fails("model file with unknown version", [&] { GPT2Config c; std::vector<float> p; read_model_file(dir + "/badversion.bin", &c, &p); },
                    "has version 4");
        std::vector<char> header_only(raw.begin(), raw.begin() + 100);
        write_bytes(dir + "/tiny.bin", header_only);
        check_fails("model file shorter than its header", [&] { GPT2Config c; std::vector<float> p; read_model_file(dir + "/tiny.bin", &c, &p); },
                    "truncated");
    }
    check_fails("a token shard passed as a model", [&] { GPT2Config c; std::vector<float> p; read_model_file(shard_path, &c, &p); },
                "it looks like a token shard");
    check_fails("a model passed as a token shard", [&] { read_token_shard(model_path); }, "it looks like a model file");
    {
        std::vector<char> raw = read_whole_file(shard_path, "shard");
        std::vector<char> cut(raw.begin(), raw.end() - 10);
        write_bytes(dir + "/truncated_shard.bin", cut);
        check_fails("truncated token shard", [&] { read_token_shard(dir + "/truncated_shard.bin"); }, "truncated");
        std::vector<char> bad = raw;
        ((int32_t*)bad.data())[1] = 2;
        write_bytes(dir + "/shard_v2.bin", bad);
        check_fails("token shard with unknown version", [&] { read_token_shard(dir + "/shard_v2.bin"); }, "has version 2");
    }
    {
        std::vector<char> raw = read_whole_file(dir + "/state.bin", "state");
        std::vector<char> cut(raw.begin(), raw.end() - 4);
        write_bytes(dir + "/state_cut.bin", cut);
        check_fails("truncated training state", [&] { read_train_state(dir + "/state_cut.bin"); }, "damaged or truncated");
    }
    {  // fp16's loss scaler (docs/formats.md, bytes 144..159): kept exactly; a scale that is no power of two refused
        TrainState s = read_train_state(dir + "/state.bin");
        s.header.loss_scale = 8192.0f;
        s.header.loss_scale_clean_steps = 17;
        s.header.loss_scale_overflows = 5;
        write_train_state(dir + "/state_fp16.bin", s);
        TrainState r = read_train_state(dir + "/state_fp16.bin");
        check(offsetof(TrainStateHeader, loss_scale) == 144 && offsetof(TrainStateHeader, loss_scale_overflows) == 152 &&
              r.header.loss_scale == 8192.0f && r.header.loss_scale_clean_steps == 17 && r.header.loss_scale_overflows == 5,
              "the loss scaler's state round trip is exact, at bytes 144..159");
        s.header.loss_scale = 3.0f;
        write_train_state(dir + "/state_scale3.bin", s);
        check_fails("a loss scale of 3 in a training state", [&] { read_train_state(dir + "/state_scale3.bin"); },
                    "a loss scale of 3");
    }

    // ---- data loader: rank slicing covers the stream exactly once per step
    {
        std::vector<uint16_t> stream(4 * 2 * 8 * 3 + 1);
        for (size_t i = 0; i < stream.size(); i++) stream[i] = (uint16_t)i;
        write_token_shard(dir + "/stream.bin", stream);
        bool ok = true, counters_ok = true, seek_ok = true;
        // the position the checkpoint saves, after each batch: the next block's first token (the same on
        // every rank), back to 0 with the epoch counted when a block and its last target no longer fit
        const LoaderPosition after[4] = {{0, 64, 0}, {0, 128, 0}, {0, 0, 1}, {0, 64, 1}};
        for (int rank = 0; rank < 4; rank++) {
            DataLoader dl;
            dataloader_init(&dl, dir + "/stream.bin", 2, 8, rank, 4, 60000, "training data", "--train-data");
            for (int step = 0; step < 3; step++) {
                dataloader_next_batch(&dl);
                int expect = step * 64 + rank * 16;
                for (int i = 0; i < 16; i++) ok &= dl.inputs[i] == expect + i && dl.targets[i] == expect + i + 1;
                const LoaderPosition& want = after[step];
                counters_ok &= dl.pos.shard_index == want.shard_index && dl.pos.position == want.position && dl.pos.epoch == want.epoch;
                DataLoader resumed;  // a resume from this position reads what this loader reads next
                dataloader_init(&resumed, dir + "/stream.bin", 2, 8, rank, 4, 60000, "training data", "--train-data");
                dataloader_seek(&resumed, dl.pos, false);
                DataLoader next = dl;
                dataloader_next_batch(&next);
                dataloader_next_batch(&resumed);
                seek_ok &= resumed.inputs == next.inputs && resumed.pos.position == next.pos.position && resumed.pos.epoch == next.pos.epoch;
            }
            dataloader_next_batch(&dl);  // wrapped around: epoch 1 starts again at the beginning
            ok &= dl.inputs[0] == rank * 16 && dl.pos.epoch == 1;
            counters_ok &= dl.pos.position == after[3].position && dl.pos.epoch == after[3].epoch;
        }
        check(ok, "data loader: rank r reads the r-th B*T of each block of world*B*T tokens, then wraps");
        check(counters_ok, "data loader: its position (the checkpoint's counter) after each batch: 64, 128, then 0 of epoch 1, 64");
        // (planted once: a seek restoring the shard and epoch but not the position; only this check failed)
        check(seek_ok, "data loader: a loader sought to a saved position reads the same next batch and moves the same");
        check_fails("token id outside the model's vocabulary", [&] {
            DataLoader dl;
            dataloader_init(&dl, dir + "/stream.bin", 2, 8, 0, 1, 50, "training data", "--train-data");
        }, "different vocabulary");
        check_fails("no shards match the pattern", [&] {
            DataLoader dl;
            dataloader_init(&dl, dir + "/none_*.bin", 2, 8, 0, 1, 50, "training data", "--train-data");
        }, "no files match --train-data");
        check_fails("shard smaller than one step", [&] {
            DataLoader dl;
            dataloader_init(&dl, dir + "/stream.bin", 64, 64, 0, 1, 60000, "training data", "--train-data");
        }, "fewer than one step needs");
    }

    // ---- schedules
    {
        ScheduleConfig s;
        s.max_lr = 1.0f;
        s.warmup_steps = 10;
        s.total_steps = 110;
        s.final_lr_fraction = 0.1f;
        s.kind = LRSchedule::Cosine;
        bool warm = std::fabs(learning_rate(s, 0) - 0.1f) < 1e-6f && std::fabs(learning_rate(s, 9) - 1.0f) < 1e-6f;
        bool ends = std::fabs(learning_rate(s, 10) - 1.0f) < 1e-6f && std::fabs(learning_rate(s, 109) - 0.1f) < 1e-6f;
        bool mid = std::fabs(learning_rate(s, 10 + 99 / 2) - (0.1f + 0.9f * 0.5f * (1 + std::cos(3.14159265f * 49.0f / 99.0f)))) < 1e-5f;
        bool monotone = true;
        for (int i = 11; i < 110; i++) monotone &= learning_rate(s, i) <= learning_rate(s, i - 1);
        check(warm && ends && mid && monotone, "cosine: linear warmup to the peak, cosine down to final_lr_fraction at the last step");
        s.kind = LRSchedule::Linear;
        check(std::fabs(learning_rate(s, 10 + 99 / 3) - (1.0f - 0.9f * 33.0f / 99.0f)) < 1e-5f && std::fabs(learning_rate(s, 109) - 0.1f) < 1e-6f,
              "linear decays linearly to the final lr");
        s.kind = LRSchedule::WSD;
        s.decay_fraction = 0.2f;  // the last 22 steps decay
        check(learning_rate(s, 87) == 1.0f && learning_rate(s, 88) == 1.0f && learning_rate(s, 89) < 1.0f &&
              std::fabs(learning_rate(s, 109) - 0.1f) < 1e-6f, "wsd: stable at the peak, then a linear decay over the last 20%");
        s.kind = LRSchedule::Constant;
        check(learning_rate(s, 50) == 1.0f && learning_rate(s, 5) == 0.6f, "constant after warmup");
    }

    int rc = system(("rm -rf " + dir).c_str());
    (void)rc;
    return check_exit_code();
}
