// tokenize_text.cpp — the GPT-2 tokenizer on the command line: text -> token ids -> text.
//
// What it teaches: nothing new; it is the window onto llmc/tokenizer.h. Use it to see how text is
// cut into tokens, to check our ids against another tokenizer (test/test_tokenizer_reference.py
// does this against js-tiktoken), and to time the encoder (scripts/bench_tokenizer.sh).
//
//   ./tokenize_text FILE...           ids of each FILE's text, space-separated, one line per file
//   ./tokenize_text --decode FILE     FILE holds ids; prints the bytes they stand for
//   ./tokenize_text --bench FILE      times encoding on 1 thread and on all threads (MB/s)
//   ./tokenize_text --char-classes    the Unicode class table as ranges (for the tests)
#include <omp.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "llmc/io/tokenizer.h"

// Exit codes as in every tool of the project: 1 for bad input, 2 for a bad command line.
[[noreturn]] static void fail(const std::string& message, int code = 1) {
    fprintf(stderr, "error: %s\n", message.c_str());
    exit(code);
}
[[noreturn]] static void usage_fail(const std::string& message) { fail(message, 2); }

static const char* USAGE =
    "usage: ./tokenize_text [options] [FILE...]   (FILE '-' or absent: standard input)\n"
    "  (default)          print the token ids of each FILE's text, space-separated, a line per file\n"
    "  --decode           FILE holds token ids; print the text they stand for\n"
    "  --bench            time encoding FILE on 1 thread and on --threads threads\n"
    "  --repeat N         with --bench: best of N runs, each with a cold cache (default 3)\n"
    "  --threads N        threads for encoding (default: all cores)\n"
    "  --char-classes     print the pre-tokenizer's Unicode class table as ranges\n"
    "  --encoder PATH     GPT-2 encoder.json (default data/gpt2/encoder.json)\n"
    "  --vocab PATH       GPT-2 vocab.bpe (default data/gpt2/vocab.bpe)\n";

static std::string read_input(const std::string& path) {
    std::string text;
    if (path == "-") {
        char buffer[1 << 16];
        size_t got;
        while ((got = fread(buffer, 1, sizeof buffer, stdin)) > 0) text.append(buffer, got);
        return text;
    }
    if (!Tokenizer::read_whole_file(path, text)) fail("cannot read " + path + ": " + strerror(errno));
    return text;
}

static double seconds_since(std::chrono::steady_clock::time_point start) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Best-of-`repeat` encode time, each run starting from an empty piece cache, so a repeated run
// is not flattered by the cache the previous run filled.
static double time_encode(Tokenizer& tokenizer, const std::string& text, int threads, int repeat, size_t* tokens) {
    double best = 1e30;
    for (int r = 0; r < repeat; r++) {
        tokenizer.reset_cache();
        auto start = std::chrono::steady_clock::now();
        std::vector<int> ids = threads == 1 ? tokenizer.encode(text) : tokenizer.encode_parallel(text, threads);
        best = std::min(best, seconds_since(start));
        *tokens = ids.size();
    }
    return best;
}

int main(int argc, char** argv) {
    std::vector<std::string> inputs;
    std::string encoder_path = "data/gpt2/encoder.json", vocab_path = "data/gpt2/vocab.bpe";
    bool decode = false, bench = false, char_classes = false;
    int threads = omp_get_max_threads(), repeat = 3;
    for (int i = 1; i < argc; i++) {
        std::string arg = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) usage_fail(arg + " needs a value (see --help)");
            return argv[++i];
        };
        if (arg == "--decode") decode = true;
        else if (arg == "--bench") bench = true;
        else if (arg == "--char-classes") char_classes = true;
        else if (arg == "--threads") threads = atoi(value().c_str());
        else if (arg == "--repeat") repeat = atoi(value().c_str());
        else if (arg == "--encoder") encoder_path = value();
        else if (arg == "--vocab") vocab_path = value();
        else if (arg == "-h" || arg == "--help") { fputs(USAGE, stdout); return 0; }
        else if (arg.size() > 1 && arg[0] == '-') usage_fail("unknown option " + arg + " (see --help)");
        else inputs.push_back(arg);
    }
    if (threads < 1) usage_fail("--threads must be at least 1");
    if (repeat < 1) usage_fail("--repeat must be at least 1");
    if (inputs.empty()) inputs.push_back("-");
    if ((decode || bench) && inputs.size() > 1) usage_fail("--decode and --bench take one FILE");

    if (char_classes) {
        // One line per maximal run of equal class: "first last class" in hex, class 0-3.
        uint32_t run_start = 0;
        int run_class = char_class(0);
        for (uint32_t cp = 1; cp <= 0x110000; cp++) {
            int c = cp < 0x110000 ? char_class(cp) : -1;
            if (c != run_class) {
                printf("%X %X %d\n", run_start, cp - 1, run_class);
                run_start = cp;
                run_class = c;
            }
        }
        return 0;
    }

    Tokenizer tokenizer;
    tokenizer.load(encoder_path, vocab_path);
    std::string text = read_input(inputs[0]);

    if (decode) {
        std::vector<int> ids;
        const char* p = text.c_str();
        while (*p) {
            char* end;
            long id = strtol(p, &end, 10);
            if (end == p) {
                if (*p == ' ' || *p == '\n' || *p == '\t' || *p == '\r' || *p == ',') { p++; continue; }
                fail(std::string("--decode expects whitespace-separated token ids, found '") + *p + "'");
            }
            if (id < 0 || id >= tokenizer.vocab_size)
                fail("token id " + std::to_string(id) + " is outside the vocabulary (0.." +
                     std::to_string(tokenizer.vocab_size - 1) + ")");
            ids.push_back((int)id);
            p = end;
        }
        std::string out = tokenizer.decode(ids);
        fwrite(out.data(), 1, out.size(), stdout);
        return 0;
    }

    if (bench) {
        double mb = text.size() / 1e6;
        size_t tokens = 0;
        double one = time_encode(tokenizer, text, 1, repeat, &tokens);
        printf("bench threads=1 bytes=%zu tokens=%zu seconds=%.4f mb_per_s=%.2f\n", text.size(), tokens, one, mb / one);
        if (threads > 1) {
            double many = time_encode(tokenizer, text, threads, repeat, &tokens);
            printf("bench threads=%d bytes=%zu tokens=%zu seconds=%.4f mb_per_s=%.2f\n", threads, text.size(), tokens,
                   many, mb / many);
        }
        return 0;
    }

    for (size_t f = 0; f < inputs.size(); f++) {
        if (f > 0) text = read_input(inputs[f]);
        std::vector<int> ids = tokenizer.encode_parallel(text, threads);
        std::string line;
        line.reserve(ids.size() * 6);
        for (size_t i = 0; i < ids.size(); i++) {
            if (i) line += ' ';
            line += std::to_string(ids[i]);
        }
        line += '\n';
        fwrite(line.data(), 1, line.size(), stdout);
    }
    return 0;
}
