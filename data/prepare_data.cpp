// prepare_data.cpp — raw text -> GPT-2 token shards (llm.c's format), ready for the trainers.
//
// What it teaches: the unglamorous half of training. A model reads token ids, not text, and it
// reads them many times, so text is tokenized once, up front, into flat binary shards:
//
//     <out>/<name>_val_000000.bin     validation tokens
//     <out>/<name>_train_000000.bin   training tokens, --shard-tokens per file
//     <out>/<name>_train_000001.bin   ...
//
// each a 1 KB header (256 int32: magic 20240520, version 1, token count) and then uint16 ids.
// Every document is preceded by <|endoftext|> (50256), so the model learns where texts begin and
// end, and a sampler can start from that token alone.
//
// Inputs: a text file (one document), a .jsonl file (one JSON object per line, the document being
// its "text" field), or a folder (every file in it, recursively, in sorted order; .jsonl files as
// JSONL, any other file as one text document).
//
// The validation split is deterministic, so a re-run gives byte-identical shards:
//   - with at least 1/F documents (F = --val-fraction), whole documents: document i (0-based, in
//     input order) is validation when floor((i+1)*F) > floor(i*F), i.e. every (1/F)-th document,
//     spread evenly through the corpus;
//   - with fewer (say, one book), the last F of each document's tokens are validation.
//
// Speed: documents are gathered into batches of ~32 MB; each is cut into parts (big documents at
// the tokenizer's safe split points) and the parts are encoded on all threads. Output order is
// input order, so the shards do not depend on --threads (a test checks it).
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "llmc/io/formats.h"
#include "llmc/io/json.h"
#include "llmc/io/tokenizer.h"

namespace fs = std::filesystem;


static const char* USAGE =
    "usage: ./prepare_data INPUT [options]\n"
    "  INPUT                   a text file (one document), a .jsonl file (one JSON object per line),\n"
    "                          or a folder of such files (read recursively, in sorted order)\n"
    "  --out-dir DIR           where the shards go (default data/NAME)\n"
    "  --name NAME             shard file prefix (default: INPUT's name without extension)\n"
    "  --text-field FIELD      JSONL field that holds the text (default text)\n"
    "  --val-fraction F        share of the data for validation, 0 <= F < 1 (default 0.1)\n"
    "  --shard-tokens N        tokens per shard file (default 100000000)\n"
    "  --threads N             encoding threads (default: all cores)\n"
    "  --replace-invalid-utf8  replace invalid UTF-8 with U+FFFD instead of stopping\n"
    "  --overwrite             delete earlier shards of the same name in --out-dir first\n"
    "  --progress / --no-progress  force the progress display on or off\n"
    "  --encoder PATH          GPT-2 encoder.json (default data/gpt2/encoder.json)\n"
    "  --vocab PATH            GPT-2 vocab.bpe (default data/gpt2/vocab.bpe)\n";

struct Options {
    std::string input, out_dir, name, text_field = "text";
    std::string encoder_path = "data/gpt2/encoder.json", vocab_path = "data/gpt2/vocab.bpe";
    double val_fraction = 0.1;
    long long shard_tokens = 100000000;
    int threads = 1;
    bool replace_invalid = false, overwrite = false;
    int progress = -1;   // -1: decide (terminal, or a large input); 0 off; 1 on
};

static double seconds_since(std::chrono::steady_clock::time_point start) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

static std::string with_commas(unsigned long long n) {
    std::string digits = std::to_string(n), out;
    for (size_t i = 0; i < digits.size(); i++) {
        if (i && (digits.size() - i) % 3 == 0) out += ',';
        out += digits[i];
    }
    return out;
}

// ---------------------------------------------------------------------------------------------
// Progress: a live bar on a terminal; on a log (not a terminal) one line per 10% for large inputs.

struct Progress {
    bool live = false, lines = false;
    unsigned long long total_bytes = 0, done_bytes = 0;
    std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now(), last_draw = start;
    int last_decile = 0;

    void update(unsigned long long bytes) {
        done_bytes += bytes;
        double elapsed = seconds_since(start);
        double fraction = total_bytes ? std::min(1.0, (double)done_bytes / total_bytes) : 1.0;
        double mb_per_s = elapsed > 0 ? done_bytes / 1e6 / elapsed : 0;
        double eta = (fraction > 0 && fraction < 1) ? elapsed * (1 - fraction) / fraction : 0;
        if (live && (seconds_since(last_draw) > 0.1 || fraction >= 1)) {
            const int width = 30;
            int filled = (int)(fraction * width);
            fprintf(stderr, "\r[%s%s] %5.1f%%  %7.1f MB/s  ETA %2d:%02d ", std::string(filled, '#').c_str(),
                    std::string(width - filled, '.').c_str(), 100 * fraction, mb_per_s, (int)eta / 60, (int)eta % 60);
            fflush(stderr);
            stderr_line_open = true;
            last_draw = std::chrono::steady_clock::now();
        } else if (lines && (int)(fraction * 10) > last_decile) {
            last_decile = (int)(fraction * 10);
            fprintf(stderr, "progress: %3d%%  %.1f MB/s  ETA %d:%02d\n", last_decile * 10, mb_per_s, (int)eta / 60,
                    (int)eta % 60);
        }
    }
    void finish() {
        if (live && stderr_line_open) fprintf(stderr, "\n");
        stderr_line_open = false;
    }
};

// ---------------------------------------------------------------------------------------------
// Reading documents from text files and JSONL files, one at a time, in input order.

static bool is_jsonl(const std::string& path) {
    return path.size() >= 6 && path.compare(path.size() - 6, 6, ".jsonl") == 0;
}

static std::string describe_invalid_utf8(const std::string& where, size_t offset) {
    return where + ": invalid UTF-8 at byte offset " + std::to_string(offset) +
           " (convert the file to UTF-8, or pass --replace-invalid-utf8 to replace bad bytes with U+FFFD)";
}

struct DocumentReader {
    const Options& options;
    std::vector<std::string> files;
    size_t file_index = 0;
    // The JSONL file being read, in blocks; `pending` holds the lines not yet handed out.
    FILE* jsonl = nullptr;
    std::string pending;
    size_t pending_pos = 0;
    // Where the current line is (for error messages) and where the next one starts, in the file.
    unsigned long long line_number = 0, line_offset = 0, next_line_offset = 0;
    unsigned long long invalid_utf8_replaced = 0;          // documents that had bad bytes replaced

    explicit DocumentReader(const Options& o) : options(o) {}

    // The next document's text into *text, with the number of input bytes it used; false at the end.
    bool next(std::string* text, unsigned long long* input_bytes) {
        while (file_index < files.size()) {
            const std::string& path = files[file_index];
            if (!is_jsonl(path)) {
                file_index++;
                if (!Tokenizer::read_whole_file(path, *text)) fail("cannot read " + path + ": " + strerror(errno));
                *input_bytes = text->size();
                check_utf8(path, text);
                return true;
            }
            if (!jsonl) {
                jsonl = fopen(path.c_str(), "rb");
                if (!jsonl) fail("cannot read " + path + ": " + strerror(errno));
                pending.clear();
                pending_pos = 0;
                line_number = 0;
                next_line_offset = 0;
            }
            std::string_view line;
            unsigned long long skipped = 0;
            while (next_line(&line)) {
                if (line.find_first_not_of(" \t\r") == std::string_view::npos) {   // blank lines are no records
                    skipped += line.size() + 1;
                    continue;
                }
                *input_bytes = skipped + line.size() + 1;
                parse_jsonl_record(path, line, text);
                return true;
            }
            fclose(jsonl);
            jsonl = nullptr;
            file_index++;
        }
        return false;
    }

    bool next_line(std::string_view* line) {
        while (true) {
            size_t newline = pending.find('\n', pending_pos);
            if (newline != std::string::npos) {
                *line = std::string_view(pending).substr(pending_pos, newline - pending_pos);
                line_number++;
                line_offset = next_line_offset;
                next_line_offset += newline - pending_pos + 1;
                pending_pos = newline + 1;
                return true;
            }
            // Keep the partial last line and read the next block after it.
            pending.erase(0, pending_pos);
            pending_pos = 0;
            size_t old = pending.size();
            pending.resize(old + (64 << 20));
            size_t got = fread(&pending[old], 1, 64 << 20, jsonl);
            pending.resize(old + got);
            if (got == 0) {
                if (pending.empty()) return false;
                pending += '\n';   // a last line without a newline
            }
        }
    }

    void parse_jsonl_record(const std::string& path, std::string_view line, std::string* text) {
        std::string where = path + ":" + std::to_string(line_number);
        size_t bad = utf8_first_invalid(line);
        std::string repaired;
        if (bad != line.size()) {
            if (!options.replace_invalid) fail(describe_invalid_utf8(path, line_offset + bad) + " (line " +
                                               std::to_string(line_number) + ")");
            repaired = utf8_replace_invalid(line);
            line = repaired;
            invalid_utf8_replaced++;
        }
        JsonValue record;
        std::string error;
        if (!json_parse(line, &record, &error))
            fail(where + ": not valid JSON: " + error + " (each line of a .jsonl file must be one JSON object)");
        if (!record.is_object()) fail(where + ": expected a JSON object, found " + json_type_name(record.type));
        const JsonValue* field = record.find(options.text_field);
        if (!field)
            fail(where + ": the record has no \"" + options.text_field +
                 "\" field (name the field that holds the text with --text-field)");
        if (!field->is_string())
            fail(where + ": field \"" + options.text_field + "\" is " + json_type_name(field->type) + ", expected a string");
        *text = field->string;
    }

    void check_utf8(const std::string& path, std::string* text) {
        size_t bad = utf8_first_invalid(*text);
        if (bad == text->size()) return;
        if (!options.replace_invalid) fail(describe_invalid_utf8(path, bad));
        *text = utf8_replace_invalid(*text);
        invalid_utf8_replaced++;
    }
};

// Whether the input has at least `enough` documents, which decides the split rule before encoding.
// Counting stops as soon as there are enough, so a huge JSONL corpus is not read twice.
static bool has_documents(const std::vector<std::string>& files, unsigned long long enough) {
    unsigned long long count = 0;
    std::vector<char> buffer(1 << 20);
    for (const std::string& path : files) {
        if (count >= enough) return true;
        if (!is_jsonl(path)) { count++; continue; }
        FILE* f = fopen(path.c_str(), "rb");
        if (!f) fail("cannot read " + path + ": " + strerror(errno));
        bool line_has_text = false;   // blank lines are not records
        size_t got;
        while (count < enough && (got = fread(buffer.data(), 1, buffer.size(), f)) > 0) {
            for (size_t i = 0; i < got; i++) {
                char c = buffer[i];
                if (c == '\n') { count += line_has_text; line_has_text = false; }
                else if (c != ' ' && c != '\t' && c != '\r') line_has_text = true;
            }
        }
        count += line_has_text;
        fclose(f);
    }
    return count >= enough;
}

// ---------------------------------------------------------------------------------------------
// Writing shards

struct ShardWriter {
    std::string path_prefix;   // ".../name_train"
    long long shard_tokens = 0;
    std::vector<uint16_t> buffer;
    int shards_written = 0;
    unsigned long long total_tokens = 0;
    std::vector<std::string> paths;

    void add(const int* tokens, size_t count) {
        for (size_t i = 0; i < count; i++) {
            if (tokens[i] < 0 || tokens[i] > 65535)   // load() refused such vocabularies already
                fail("token id " + std::to_string(tokens[i]) + " does not fit the uint16 token shard");
            buffer.push_back((uint16_t)tokens[i]);
            if ((long long)buffer.size() == shard_tokens) flush();
        }
        total_tokens += count;
    }
    void flush() {
        if (buffer.empty()) return;
        char suffix[32];
        snprintf(suffix, sizeof suffix, "_%06d.bin", shards_written);
        paths.push_back(path_prefix + suffix);
        write_token_shard(paths.back(), buffer);
        shards_written++;
        buffer.clear();
    }
};

// ---------------------------------------------------------------------------------------------

static Options parse_options(int argc, char** argv) {
    Options o;
    o.threads = omp_get_max_threads();
    for (int i = 1; i < argc; i++) {
        std::string arg = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) usage_fail(arg + " needs a value (see --help)");
            return argv[++i];
        };
        auto number = [&](double low, double high) {
            std::string v = value();
            char* end;
            double x = strtod(v.c_str(), &end);
            if (end == v.c_str() || *end || !(x >= low && x <= high))
                usage_fail(arg + " " + v + ": expected a number from " + std::to_string(low) + " to " + std::to_string(high));
            return x;
        };
        if (arg == "--out-dir") o.out_dir = value();
        else if (arg == "--name") o.name = value();
        else if (arg == "--text-field") o.text_field = value();
        else if (arg == "--val-fraction") {
            o.val_fraction = number(0, 1);
            if (o.val_fraction >= 1) usage_fail("--val-fraction must be below 1 (some data must be left to train on)");
        }
        else if (arg == "--shard-tokens") o.shard_tokens = (long long)number(1, 2e9);
        else if (arg == "--threads") o.threads = (int)number(1, 4096);
        else if (arg == "--replace-invalid-utf8") o.replace_invalid = true;
        else if (arg == "--overwrite") o.overwrite = true;
        else if (arg == "--progress") o.progress = 1;
        else if (arg == "--no-progress") o.progress = 0;
        else if (arg == "--encoder") o.encoder_path = value();
        else if (arg == "--vocab") o.vocab_path = value();
        else if (arg == "-h" || arg == "--help") { fputs(USAGE, stdout); exit(0); }
        else if (arg.size() > 1 && arg[0] == '-') usage_fail("unknown option " + arg + " (see --help)");
        else if (o.input.empty()) o.input = arg;
        else usage_fail("more than one INPUT given (" + o.input + ", " + arg + "); put the files in one folder instead");
    }
    if (o.input.empty()) usage_fail("no INPUT given (see --help)");
    while (o.input.size() > 1 && o.input.back() == '/') o.input.pop_back();
    if (o.name.empty()) o.name = fs::path(o.input).stem().string();
    if (o.name.empty() || o.name.find('/') != std::string::npos) usage_fail("bad --name '" + o.name + "'");
    if (o.out_dir.empty()) o.out_dir = "data/" + o.name;
    return o;
}

static std::vector<std::string> list_input_files(const std::string& input) {
    std::error_code ec;
    fs::file_status status = fs::status(input, ec);
    if (ec || !fs::exists(status)) fail("cannot read " + input + ": no such file or folder");
    std::vector<std::string> files;
    if (fs::is_directory(status)) {
        for (auto it = fs::recursive_directory_iterator(input, ec); !ec && it != fs::recursive_directory_iterator();
             it.increment(ec)) {
            std::string base = it->path().filename().string();
            if (!base.empty() && base[0] == '.') {   // hidden files and folders (.git, .DS_Store)
                if (it->is_directory()) it.disable_recursion_pending();
                continue;
            }
            if (it->is_regular_file()) files.push_back(it->path().string());
        }
        if (ec) fail("cannot list " + input + ": " + ec.message());
        std::sort(files.begin(), files.end());
        if (files.empty()) fail("the folder " + input + " has no files: the corpus is empty");
    } else {
        files.push_back(input);
    }
    for (const std::string& f : files)
        if (access(f.c_str(), R_OK) != 0) fail("cannot read " + f + ": " + strerror(errno));
    return files;
}

// Removes (with --overwrite) or refuses earlier shards with this name, so the trainer's pattern
// "<name>_train_*.bin" never picks up a stale shard left from a run with more shards.
static void check_out_dir(const Options& o) {
    std::error_code ec;
    fs::create_directories(o.out_dir, ec);
    if (ec) fail("cannot create " + o.out_dir + ": " + ec.message());
    std::vector<fs::path> old;
    for (const auto& entry : fs::directory_iterator(o.out_dir, ec)) {
        std::string base = entry.path().filename().string();
        for (const char* split : {"_train_", "_val_"}) {
            std::string prefix = o.name + split;
            if (base.compare(0, prefix.size(), prefix) == 0 && base.size() > 4 &&
                (base.compare(base.size() - 4, 4, ".bin") == 0 || base.compare(base.size() - 8, 8, ".bin.tmp") == 0))
                old.push_back(entry.path());
        }
    }
    if (old.empty()) return;
    if (!o.overwrite)
        fail(o.out_dir + " already has shards named " + o.name + "_*.bin (e.g. " + old[0].string() +
             "); pass --overwrite to replace them, or choose another --out-dir or --name");
    for (const auto& path : old) fs::remove(path, ec);
}

int main(int argc, char** argv) {
    Options options = parse_options(argc, argv);
    auto start = std::chrono::steady_clock::now();

    std::vector<std::string> files = list_input_files(options.input);
    Tokenizer tokenizer;
    tokenizer.load(options.encoder_path, options.vocab_path);
    if (tokenizer.vocab_size > 65536)
        fail("the vocabulary in " + options.encoder_path + " has token ids up to " +
             std::to_string(tokenizer.vocab_size - 1) +
             ", which do not fit the uint16 ids of llm.c's token shards (at most 65535); "
             "use a vocabulary of at most 65,536 tokens such as GPT-2's");

    unsigned long long total_bytes = 0;
    for (const std::string& f : files) total_bytes += fs::file_size(f);
    // The split rule, in integers (parts per million) so it is exact and the same everywhere:
    // whole documents when there are at least 1/F of them (N * ppm >= 1e6).
    const long long ppm = llround(options.val_fraction * 1e6);
    const bool split_documents = ppm > 0 && has_documents(files, (unsigned long long)((1000000 + ppm - 1) / ppm));

    check_out_dir(options);
    ShardWriter train, val;
    train.path_prefix = options.out_dir + "/" + options.name + "_train";
    val.path_prefix = options.out_dir + "/" + options.name + "_val";
    train.shard_tokens = val.shard_tokens = options.shard_tokens;

    Progress progress;
    progress.total_bytes = total_bytes;
    bool terminal = isatty(fileno(stderr));
    progress.live = options.progress == 1 ? terminal : (options.progress == -1 && terminal && total_bytes > (8 << 20));
    progress.lines = options.progress == 1 ? !terminal : (options.progress == -1 && !terminal && total_bytes > (256ull << 20));

    DocumentReader reader(options);
    reader.files = files;
    unsigned long long document_index = 0, empty_documents = 0, val_documents = 0;
    std::vector<std::string> batch;
    std::vector<int> document_tokens;

    auto encode_batch = [&](unsigned long long batch_input_bytes) {
        // Cut every document into parts that can be encoded independently, encode all parts in
        // parallel, then hand each document's tokens to the writers in input order.
        struct Part { size_t document, begin, end; };
        std::vector<Part> parts;
        for (size_t d = 0; d < batch.size(); d++) {
            std::vector<size_t> bounds = Tokenizer::split_points(batch[d], options.threads);
            for (size_t k = 0; k + 1 < bounds.size(); k++) parts.push_back({d, bounds[k], bounds[k + 1]});
        }
        std::vector<std::vector<int>> part_tokens(parts.size());
        unsigned long long batch_text_bytes = 0, reported = 0, encoded = 0;
        for (const Part& part : parts) batch_text_bytes += part.end - part.begin;
        // Groups of parts between progress updates, so even one huge document shows progress.
        const size_t group = (size_t)options.threads * 8;
        for (size_t first = 0; first < parts.size(); first += group) {
            size_t last = std::min(parts.size(), first + group);
            #pragma omp parallel for schedule(dynamic, 1) num_threads(options.threads)
            for (long p = (long)first; p < (long)last; p++) {
                std::string_view text(batch[parts[p].document]);
                tokenizer.encode_valid_utf8(text.substr(parts[p].begin, parts[p].end - parts[p].begin), part_tokens[p]);
            }
            for (size_t p = first; p < last; p++) encoded += parts[p].end - parts[p].begin;
            unsigned long long now = batch_text_bytes ? batch_input_bytes * encoded / batch_text_bytes : batch_input_bytes;
            progress.update(now - reported);
            reported = now;
        }
        progress.update(batch_input_bytes - reported);
        size_t p = 0;
        for (size_t d = 0; d < batch.size(); d++, document_index++) {
            document_tokens.assign(1, tokenizer.eot_token);
            for (; p < parts.size() && parts[p].document == d; p++)
                document_tokens.insert(document_tokens.end(), part_tokens[p].begin(), part_tokens[p].end());
            if (document_tokens.size() == 1) { empty_documents++; continue; }
            if (split_documents) {
                bool is_val = (long long)((document_index + 1) * ppm / 1000000) > (long long)(document_index * ppm / 1000000);
                (is_val ? val : train).add(document_tokens.data(), document_tokens.size());
                val_documents += is_val;
            } else {
                // The last F of the document's tokens (rounded up) go to validation.
                size_t n = document_tokens.size();
                size_t n_val = (size_t)((n * (unsigned long long)ppm + 999999) / 1000000);
                train.add(document_tokens.data(), n - n_val);
                val.add(document_tokens.data() + (n - n_val), n_val);
            }
        }
        batch.clear();
    };

    std::string text;
    unsigned long long batch_bytes = 0, batch_input_bytes = 0, input_bytes = 0;
    while (reader.next(&text, &input_bytes)) {
        batch_bytes += text.size();
        batch_input_bytes += input_bytes;
        batch.push_back(std::move(text));
        text = std::string();
        if (batch_bytes >= (32u << 20) || batch.size() >= 65536) {
            encode_batch(batch_input_bytes);
            batch_bytes = batch_input_bytes = 0;
        }
    }
    encode_batch(batch_input_bytes);
    progress.finish();

    if (train.total_tokens == 0 && val.total_tokens == 0)
        fail("the corpus is empty: " + options.input + " has no text (" + std::to_string(document_index) +
             " documents, all empty)");
    if (train.total_tokens == 0)
        fail("no training tokens: every document went to validation; lower --val-fraction");
    train.flush();
    val.flush();

    double elapsed = seconds_since(start);
    printf("prepare_data: %s: %s document%s (%s empty, skipped), %.1f MB of text in %.2f s (%.1f MB/s)\n",
           options.input.c_str(), with_commas(document_index).c_str(), document_index == 1 ? "" : "s",
           with_commas(empty_documents).c_str(),
           total_bytes / 1e6, elapsed, total_bytes / 1e6 / elapsed);
    if (reader.invalid_utf8_replaced)
        printf("  invalid UTF-8 replaced with U+FFFD in %llu documents\n", reader.invalid_utf8_replaced);
    if (split_documents)
        printf("  split: whole documents, %s of them for validation (one in every %g)\n",
               with_commas(val_documents).c_str(), 1 / options.val_fraction);
    else
        printf("  split: fewer than 1/%g documents, so the last %g%% of each document's tokens are validation\n",
               options.val_fraction, 100 * options.val_fraction);
    printf("  train: %s tokens in %d shard%s (%s%s)\n", with_commas(train.total_tokens).c_str(), train.shards_written,
           train.shards_written == 1 ? "" : "s", train.paths.front().c_str(), train.shards_written > 1 ? ", ..." : "");
    if (val.shards_written)
        printf("  val:   %s tokens in %d shard%s (%s%s)\n", with_commas(val.total_tokens).c_str(), val.shards_written,
               val.shards_written == 1 ? "" : "s", val.paths.front().c_str(), val.shards_written > 1 ? ", ..." : "");
    else
        printf("  val:   no tokens, no val shard written (--val-fraction %g)\n", options.val_fraction);
    return 0;
}
