// hf_convert.cpp — GPT-2 weights between Hugging Face's layout and our model file, in C++.
//
//   ./hf_convert import model.safetensors gpt2.bin      a GPT-2 from the hub -> a model file to fine-tune
//   ./hf_convert export out/ckpt_00001000 hf_model/     a checkpoint -> model.safetensors + config.json
//
// So a user who downloaded GPT-2 fine-tunes it without Python (`./train_gpt --model gpt2.bin ...`),
// and what we train loads in `transformers` and the evaluation harnesses built on it. The mapping
// (names, Conv1D transposes, vocabulary padding, the tied head) is in llmc/io/hf_gpt2.h; the
// safetensors reader and its checks in llmc/safetensors.h. The conversion moves bytes and does no
// arithmetic, so export then import gives back the identical model file.
#include <cstdio>
#include <cstring>
#include <dirent.h>
#include <string>
#include <sys/stat.h>
#include <vector>
#include "llmc/run/cli.h"
#include "llmc/io/formats.h"
#include "llmc/io/hf_gpt2.h"
#include "llmc/io/json.h"
#include "llmc/model/model.h"
#include "llmc/io/safetensors.h"
#include "llmc/utils.h"

static const char* USAGE =
    "usage:\n"
    "  hf_convert import MODEL.safetensors OUT.bin [--config FILE] [--heads N] [--dtype f32|bf16]\n"
    "  hf_convert export CKPT_DIR|MODEL.bin OUT_DIR [--dtype f32|bf16] [--tokenizer DIR] [--force]\n"
    "\n"
    "import  reads a GPT-2 in Hugging Face's layout (GPT2LMHeadModel: F32, F16 or BF16 tensors, Conv1D\n"
    "        weights, with or without the 'transformer.' prefix) and writes our model file (fp32, or\n"
    "        bf16 with --dtype bf16). The number of heads comes from config.json beside the weights\n"
    "        (or --config FILE); without one, --heads N, else heads of 64 channels as in every GPT-2.\n"
    "export  writes OUT_DIR/model.safetensors (F32, or BF16 with --dtype bf16) and OUT_DIR/config.json,\n"
    "        loadable by transformers' GPT2LMHeadModel.from_pretrained(OUT_DIR); also vocab.json and\n"
    "        merges.txt from --tokenizer DIR (default data/gpt2) when the vocabulary is GPT-2's.\n"
    "        A checkpoint directory with fp32 master weights (GPU runs) exports those, exactly.\n"
    "        OUT_DIR must not exist yet (an empty folder is fine); --force writes into it anyway,\n"
    "        replacing the files of those names.\n";

static std::string dirname_of(const std::string& path) {
    size_t slash = path.rfind('/');
    return slash == std::string::npos ? "." : path.substr(0, slash == 0 ? 1 : slash);
}

static int run_import(const std::string& in, const std::string& out, std::string config_path, int heads, const std::string& dtype) {
    SafetensorsFile st = read_safetensors_header(in);
    if (config_path.empty() && file_exists(dirname_of(in) + "/config.json")) config_path = dirname_of(in) + "/config.json";
    JsonValue config;
    bool have_config = false;
    if (!config_path.empty()) {
        std::vector<char> text = read_whole_file(config_path, "config file");
        std::string error;
        if (!json_parse(std::string_view(text.data(), text.size()), &config, &error)) {
            fail("config file '%s' is not valid JSON: %s", config_path.c_str(), error.c_str());
        }
        if (!config.is_object()) fail("config file '%s' is not a JSON object", config_path.c_str());
        have_config = true;
    }
    std::string prefix;
    GPT2Config cfg = hf_infer_config(st, have_config ? &config : nullptr, config_path, heads, &prefix);
    std::vector<float> params = hf_import_params(st, cfg, prefix);
    write_model_file(out, cfg, params.data(), dtype == "bf16");
    printf("imported %s%s%s -> %s: %s, %zu parameters, %s\n", in.c_str(), have_config ? " + " : "",
           have_config ? config_path.c_str() : "", out.c_str(), describe_config(cfg).c_str(), params.size(),
           dtype == "bf16" ? "bf16 (version 5)" : "fp32 (version 3)");
    return 0;
}

// True for a folder with nothing in it: export may fill that without --force, there is nothing to lose.
static bool is_empty_dir(const std::string& path) {
    DIR* d = opendir(path.c_str());
    if (!d) return false;
    bool empty = true;
    for (dirent* e; empty && (e = readdir(d));) empty = !strcmp(e->d_name, ".") || !strcmp(e->d_name, "..");
    closedir(d);
    return empty;
}

static int run_export(const std::string& in, const std::string& out_dir, const std::string& dtype, const std::string& tokenizer_dir,
                      bool force) {
    // an earlier export (or anything else) at OUT_DIR would be overwritten file by file, silently
    struct stat st;
    if (!force && stat(out_dir.c_str(), &st) == 0 && !is_empty_dir(out_dir)) {
        usage_fail("'%s' already exists: export writes a new folder; pass --force to write into it (replacing model.safetensors, "
                   "config.json, vocab.json, merges.txt)", out_dir.c_str());
    }
    std::string model_path = dir_exists(in) ? in + "/model.bin" : in;
    if (!file_exists(model_path)) {
        fail("'%s' is neither a model file nor a checkpoint directory with a model.bin", in.c_str());
    }
    GPT2Config cfg;
    std::vector<float> params;
    read_model_file(model_path, &cfg, &params);
    std::string source = model_path;
    // A GPU checkpoint's model.bin holds bf16 weights; its state.bin may hold the exact fp32 masters.
    std::string state = in + "/state.bin";
    if (dir_exists(in) && file_exists(state)) {
        FILE* f = open_for_reading(state, "training-state file");
        TrainStateHeader h = read_train_state_header(f, state);
        fclose(f);
        if (h.has_master_weights && h.shard_begin == 0 && h.shard_count == (int64_t)params.size()) {
            read_train_state_part(state, 0, params.size(), nullptr, nullptr, params.data());
            source = state + " (fp32 master weights)";
        }
    }
    hf_export(out_dir, cfg, params.data(), dtype == "bf16" ? "BF16" : "F32");
    printf("exported %s -> %s/model.safetensors (%s) and config.json: %s\n", source.c_str(), out_dir.c_str(),
           dtype == "bf16" ? "BF16" : "F32", describe_config(cfg).c_str());
    // transformers' GPT-2 tokenizer reads the same two files under other names
    std::string encoder = tokenizer_dir + "/encoder.json", merges = tokenizer_dir + "/vocab.bpe";
    if (cfg.vocab_size == 50257 && file_exists(encoder) && file_exists(merges)) {
        for (auto [from, to] : {std::pair<std::string, std::string>{encoder, "vocab.json"}, {merges, "merges.txt"}}) {
            std::vector<char> bytes = read_whole_file(from, "tokenizer file");
            AtomicFile f(out_dir + "/" + to, "tokenizer file");
            f.write(bytes.data(), bytes.size());
            f.commit();
        }
        printf("tokenizer: copied %s as vocab.json and merges.txt\n", tokenizer_dir.c_str());
    } else {
        printf("tokenizer: not copied (%s)\n", cfg.vocab_size != 50257 ? "the vocabulary is not GPT-2's"
                                                                     : ("no encoder.json and vocab.bpe in " + tokenizer_dir).c_str());
    }
    return 0;
}

int main(int argc, char** argv) {
    std::vector<std::string> positional;
    std::string config_path, dtype = "f32", tokenizer_dir = "data/gpt2";
    int heads = 0;
    bool force = false;
    for (int i = 1; i < argc; i++) {
        std::string arg = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) usage_fail("%s needs a value (see --help)", arg.c_str());
            return argv[++i];
        };
        if (arg == "--help" || arg == "-h") {
            printf("%s", USAGE);
            return 0;
        } else if (arg == "--version") {
            printf("hf_convert (llmc %s)\n", LLMC_VERSION);
            return 0;
        } else if (arg == "--config") {
            config_path = value();
        } else if (arg == "--heads") {
            std::string v = value();
            heads = atoi(v.c_str());
            if (heads <= 0 || v.find_first_not_of("0123456789") != std::string::npos) usage_fail("--heads expects a positive integer, got '%s'", v.c_str());
        } else if (arg == "--dtype") {
            dtype = value();
            if (dtype != "f32" && dtype != "bf16") usage_fail("--dtype must be f32 or bf16, got '%s'", dtype.c_str());
        } else if (arg == "--tokenizer") {
            tokenizer_dir = value();
        } else if (arg == "--force") {
            force = true;
        } else if (arg.rfind("--", 0) == 0) {
            usage_fail("unknown flag %s (see --help)", arg.c_str());
        } else {
            positional.push_back(arg);
        }
    }
    if (positional.size() != 3 || (positional[0] != "import" && positional[0] != "export")) {
        usage_fail("expected 'import MODEL.safetensors OUT.bin' or 'export CKPT_DIR|MODEL.bin OUT_DIR' (see --help)");
    }
    if (positional[0] == "import") return run_import(positional[1], positional[2], config_path, heads, dtype);
    return run_export(positional[1], positional[2], dtype, tokenizer_dir, force);
}
