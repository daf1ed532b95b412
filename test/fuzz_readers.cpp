// fuzz_readers.cpp — a libFuzzer target for every reader of an untrusted file header: model files,
// token shards, training states (header and run table), and the JSON parser behind the HellaSwag
// and tokenizer files. Built with clang -fsanitize=fuzzer,address,undefined by
// test/test_sanitizers.sh, which runs it for a bounded time on the seed corpus test/fuzz_corpus/.
//
// What a fuzzer teaches: a reader is a function of bytes an attacker (or a full disk, or a copy cut
// short) chooses. libFuzzer mutates the seeds, keeping inputs that reach new code, and the
// sanitizers turn a read past a buffer, an overflow or a huge allocation into a crash it reports.
// Here a reader may only (a) accept the bytes, and then what it accepted must be self-consistent
// (the checks below), or (b) refuse them through fail(), which we turn into an exception, so the
// fuzzer goes on. Anything else (a crash, a hang, an allocation past -rss_limit_mb) is a bug; each
// input that ever found one belongs in the corpus, as a regression test.
//
// Every reader is given the bytes as a FILE* (fmemopen): the harness owns it and closes it however
// the reader ends, so millions of refused inputs leak nothing.
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>
#include "llmc/io/formats.h"
#include "llmc/io/json.h"

struct Refused : std::runtime_error {
    using std::runtime_error::runtime_error;
};

static void throw_on_fail(int) { throw Refused("refused"); }

static void check(bool ok, const char* what) {
    if (!ok) {
        fprintf(stderr, "fuzz_readers: accepted an inconsistent input: %s\n", what);
        abort();
    }
}

// Runs one reader on the bytes; a refusal is a normal outcome.
template <class Reader>
static void on_bytes(const uint8_t* data, size_t size, Reader reader) {
    if (size == 0) return;
    FILE* f = fmemopen((void*)data, size, "rb");
    if (!f) return;
    try {
        reader(f, (int64_t)size);
    } catch (const Refused&) {
    }
    fclose(f);
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    on_fail = throw_on_fail;
    const std::string path = "fuzz-input";
    on_bytes(data, size, [&](FILE* f, int64_t n) {  // a model file's header
        int32_t h[HEADER_INTS];
        read_exactly(f, h, sizeof(h), path, "model file");
        ModelHeader mh = parse_model_header(h, path);
#ifdef FUZZ_PLANTED_BUG  // the negative control: issue 16's reader, allocating from the header before the length check
        std::vector<float> params(param_layout(mh.config).total);
#endif
        check_model_file_size(f, mh, path);
        check(model_file_bytes(mh) == n, "a model header whose size differs from the file's");
        check(param_layout(mh.config).total <= (size_t)n, "a model with more parameters than bytes");
    });
    on_bytes(data, size, [&](FILE* f, int64_t n) {  // a token shard's header
        int64_t count = read_token_shard_header(f, path);
        check(count >= 0 && (int64_t)sizeof(int32_t) * HEADER_INTS + 2 * count == n, "a shard whose length differs from its count");
    });
    on_bytes(data, size, [&](FILE* f, int64_t n) {  // a training state's header and run table
        TrainStateHeader h = read_train_state_header(f, path);
        check(train_state_header_problem(h).empty() && h.step >= 0 && h.train_loader.position >= 0, "a state header with a problem");
        std::vector<int64_t> runs = read_state_run_table(f, h, path);
        int64_t total = 0;
        for (size_t k = 0; k < runs.size(); k += 2) {
            check(runs[k] >= 0 && runs[k + 1] >= 0 && runs[k] + runs[k + 1] <= h.num_params, "a run outside the model");
            total += runs[k + 1];
        }
        check(total == h.shard_count, "runs that do not add up to the file's elements");
        check((int64_t)sizeof(h) + state_table_bytes(h) + h.shard_count * 4 * (h.has_master_weights ? 3 : 2) == n,
              "a state whose length differs from its header");
    });
    JsonValue v;  // a line of a HellaSwag file, or encoder.json
    std::string error;
    json_parse(std::string_view((const char*)data, size), &v, &error);
    return 0;
}
