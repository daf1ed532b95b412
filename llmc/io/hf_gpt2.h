// hf_gpt2.h — GPT-2 weights in Hugging Face's layout, to and from our model file.
//
// The same 16 tensors, named and shaped differently. Hugging Face's GPT2LMHeadModel keeps one set of
// tensors per layer, named by module, and its linear layers are "Conv1D" modules (from the original
// TensorFlow code) whose weight is stored (in, out), y = x W + b: the TRANSPOSE of nn.Linear's
// (out, in) that our file uses (docs/formats.md). So:
//
//   Hugging Face name                            shape        ours (per layer l)      shape
//   transformer.wte.weight                       (V, C)       wte, rows 0..V-1        (Vp, C)
//   transformer.wpe.weight                       (maxT, C)    wpe                     (maxT, C)
//   transformer.h.l.ln_1.weight / .bias          (C)          ln1w[l] / ln1b[l]       (C)
//   transformer.h.l.attn.c_attn.weight           (C, 3C)      qkvw[l]    transposed   (3C, C)
//   transformer.h.l.attn.c_attn.bias             (3C)         qkvb[l]
//   transformer.h.l.attn.c_proj.weight           (C, C)       attprojw[l] transposed  (C, C)
//   transformer.h.l.attn.c_proj.bias             (C)          attprojb[l]
//   transformer.h.l.ln_2.weight / .bias          (C)          ln2w[l] / ln2b[l]
//   transformer.h.l.mlp.c_fc.weight              (C, 4C)      fcw[l]     transposed   (4C, C)
//   transformer.h.l.mlp.c_fc.bias                (4C)         fcb[l]
//   transformer.h.l.mlp.c_proj.weight            (4C, C)      fcprojw[l] transposed   (C, 4C)
//   transformer.h.l.mlp.c_proj.bias              (C)          fcprojb[l]
//   transformer.ln_f.weight / .bias              (C)          lnfw / lnfb
//   lm_head.weight (optional)                    (V, C)       tied: must equal wte
//
// Both use the same q|k|v order inside c_attn, and the same GELU (tanh approximation, "gelu_new")
// and LayerNorm (eps 1e-5), so the conversion is pure data movement: no arithmetic, hence export
// then import is bit-exact. Some files (the original GPT-2 upload among them) drop the
// "transformer." prefix; some carry "attn.bias" and "attn.masked_bias", the causal mask saved as a
// buffer, which are not weights and are skipped. The number of heads is not in the weights: it
// comes from config.json ("n_head").
//
// Import pads the vocabulary to Vp (a multiple of 128) with zero rows; export drops them again and
// writes config.json, so `transformers`' GPT2LMHeadModel.from_pretrained(dir) loads the result.
#pragma once

#include <string>
#include <vector>
#include "llmc/io/json.h"
#include "llmc/model/model.h"
#include "llmc/io/safetensors.h"
#include "llmc/utils.h"

// One Hugging Face tensor and where it lives in our flat parameter array.
struct HFTensor {
    std::string name;            // without the "transformer." prefix for the model's own tensors
    int tensor;                  // which of our 16 tensors (ParamTensor)
    int layer;                   // its layer, or -1 for a tensor that is not per layer
    std::vector<int64_t> shape;  // Hugging Face's shape
    bool transposed;             // Conv1D weight: (in, out) there, (out, in) here
};

inline std::vector<HFTensor> hf_gpt2_tensors(const GPT2Config& cfg) {
    int64_t C = cfg.channels;
    std::vector<HFTensor> t = {
        {"wte.weight", WTE, -1, {cfg.vocab_size, C}, false},
        {"wpe.weight", WPE, -1, {cfg.max_seq_len, C}, false},
    };
    for (int l = 0; l < cfg.num_layers; l++) {
        std::string h = "h." + std::to_string(l) + ".";
        t.push_back({h + "ln_1.weight", LN1W, l, {C}, false});
        t.push_back({h + "ln_1.bias", LN1B, l, {C}, false});
        t.push_back({h + "attn.c_attn.weight", QKVW, l, {C, 3 * C}, true});
        t.push_back({h + "attn.c_attn.bias", QKVB, l, {3 * C}, false});
        t.push_back({h + "attn.c_proj.weight", ATTPROJW, l, {C, C}, true});
        t.push_back({h + "attn.c_proj.bias", ATTPROJB, l, {C}, false});
        t.push_back({h + "ln_2.weight", LN2W, l, {C}, false});
        t.push_back({h + "ln_2.bias", LN2B, l, {C}, false});
        t.push_back({h + "mlp.c_fc.weight", FCW, l, {C, 4 * C}, true});
        t.push_back({h + "mlp.c_fc.bias", FCB, l, {4 * C}, false});
        t.push_back({h + "mlp.c_proj.weight", FCPROJW, l, {4 * C, C}, true});
        t.push_back({h + "mlp.c_proj.bias", FCPROJB, l, {C}, false});
    }
    t.push_back({"ln_f.weight", LNFW, -1, {C}, false});
    t.push_back({"ln_f.bias", LNFB, -1, {C}, false});
    return t;
}

// Where the tensor's values start in our flat array (per-layer tensors are stacked over layers).
inline size_t hf_tensor_offset(const HFTensor& t, const GPT2Config& cfg, const ParamLayout& layout) {
    size_t per_layer = t.layer < 0 ? 0 : layout.count[t.tensor] / cfg.num_layers;
    return layout.offset[t.tensor] + (t.layer < 0 ? 0 : (size_t)t.layer * per_layer);
}

// ----------------------------------------------------------------------------------------------
// Import: model.safetensors (+ config.json) -> our parameters

// config.json says what the weights cannot: the number of heads (unless `heads` > 0 gave it), and
// variants we do not compute, each refused with what it asks for. `path`: the weights' file.
inline void hf_apply_config_json(const JsonValue& config_json, const std::string& config_path, const char* path, int heads,
                                 GPT2Config* cfg) {
    auto number = [&](const char* key, int64_t fallback) {
        const JsonValue* v = config_json.find(key);
        if (!v || v->is_null()) return fallback;
        if (!v->is_integer) fail("'%s': \"%s\" must be an integer", config_path.c_str(), key);
        return v->integer;
    };
    auto string = [&](const char* key, const char* fallback) {
        const JsonValue* v = config_json.find(key);
        return v && v->is_string() ? v->string : std::string(fallback);
    };
    auto boolean = [&](const char* key, bool fallback) {
        const JsonValue* v = config_json.find(key);
        return v && v->is_bool() ? v->boolean : fallback;
    };
    if (heads <= 0) cfg->num_heads = (int)number("n_head", 0);
    struct { const char* key; int64_t weights; } agree[] = {{"n_embd", cfg->channels}, {"n_layer", cfg->num_layers},
                                                             {"n_positions", cfg->max_seq_len}, {"vocab_size", cfg->vocab_size}};
    for (auto& a : agree) {
        int64_t said = number(a.key, a.weights);
        if (said != a.weights) {
            fail("'%s' says %s = %lld, but the weights in '%s' have %lld: the two files are not from the same model",
                 config_path.c_str(), a.key, (long long)said, path, (long long)a.weights);
        }
    }
    std::string act = string("activation_function", "gelu_new");
    if (act != "gelu_new" && act != "gelu_pytorch_tanh" && act != "gelu_fast") {
        fail("'%s': activation_function '%s'; this model computes GPT-2's tanh GELU (gelu_new) only", config_path.c_str(), act.c_str());
    }
    const JsonValue* eps = config_json.find("layer_norm_epsilon");
    if (eps && eps->is_number() && std::fabs(eps->number - 1e-5) > 1e-12) {
        fail("'%s': layer_norm_epsilon %g; this model's LayerNorm uses 1e-5", config_path.c_str(), eps->number);
    }
    int64_t inner = number("n_inner", 4 * (int64_t)cfg->channels);
    if (inner != 4 * (int64_t)cfg->channels) fail("'%s': n_inner %lld; this model's MLP is 4 x n_embd wide", config_path.c_str(), (long long)inner);
    if (!boolean("scale_attn_weights", true) || boolean("scale_attn_by_inverse_layer_idx", false)) {
        fail("'%s' asks for a different attention scaling than 1/sqrt(head size), which this model computes", config_path.c_str());
    }
    if (!boolean("tie_word_embeddings", true)) {
        fail("'%s': tie_word_embeddings is false; this model's output layer is the token embedding", config_path.c_str());
    }
}

// The shape of the model in a Hugging Face file: V and C from wte, maxT from wpe, L from the
// highest h.N, the number of heads from config.json (or `heads`, when there is no config.json).
// `prefix` receives "transformer." or "".
inline GPT2Config hf_infer_config(const SafetensorsFile& st, const JsonValue* config_json, const std::string& config_path,
                                  int heads, std::string* prefix) {
    const char* path = st.path.c_str();
    *prefix = st.find("transformer.wte.weight") ? "transformer." : "";
    const SafetensorsEntry* wte = st.find(*prefix + "wte.weight");
    const SafetensorsEntry* wpe = st.find(*prefix + "wpe.weight");
    if (!wte) {
        fail("'%s' has no tensor 'transformer.wte.weight' (nor 'wte.weight'): it is not a GPT-2 model in Hugging Face's "
             "layout (GPT2LMHeadModel)", path);
    }
    if (!wpe) fail("'%s' is missing tensor '%swpe.weight' (the position embedding)", path, prefix->c_str());
    if (wte->shape.size() != 2) fail("'%s': tensor '%s' has shape %s, expected (vocab, channels)", path, wte->name.c_str(), shape_string(wte->shape).c_str());
    if (wpe->shape.size() != 2 || wpe->shape[1] != wte->shape[1]) {
        fail("'%s': tensor '%s' has shape %s, expected (positions, %lld) to match the token embedding", path,
             wpe->name.c_str(), shape_string(wpe->shape).c_str(), (long long)wte->shape[1]);
    }
    GPT2Config cfg;
    cfg.vocab_size = (int)wte->shape[0];
    cfg.channels = (int)wte->shape[1];
    cfg.max_seq_len = (int)wpe->shape[0];
    cfg.padded_vocab_size = pad_vocab(cfg.vocab_size);
    int layers = 0;
    std::string h = *prefix + "h.";
    for (const SafetensorsEntry& t : st.tensors) {
        if (t.name.compare(0, h.size(), h) != 0) continue;
        int l = atoi(t.name.c_str() + h.size());
        layers = std::max(layers, l + 1);
    }
    if (layers == 0) fail("'%s' has no layers (no tensor named '%sh.0.*')", path, prefix->c_str());
    cfg.num_layers = layers;
    cfg.num_heads = heads;
    if (config_json) hf_apply_config_json(*config_json, config_path, path, heads, &cfg);
    if (cfg.num_heads <= 0) {
        cfg.num_heads = cfg.channels / 64;  // every GPT-2 size has heads of 64 channels
        printf("note: no config.json and no --heads: assuming heads of 64 channels, %d heads\n", cfg.num_heads);
    }
    std::string why;
    if (!config_is_valid(cfg, &why)) fail("'%s': the model's shape (%s) is impossible: %s", path, describe_config(cfg).c_str(), why.c_str());
    return cfg;
}

// Reads every tensor into our flat layout (fp32, the vocabulary padded with zero rows). Each
// tensor must be present with exactly its shape; an unknown tensor is an error (it would mean a
// different architecture), except the attention-mask buffers, which are not weights.
inline std::vector<float> hf_import_params(const SafetensorsFile& st, const GPT2Config& cfg, const std::string& prefix) {
    ParamLayout layout = param_layout(cfg);
    std::vector<float> params(layout.total, 0.0f);
    std::vector<HFTensor> expected = hf_gpt2_tensors(cfg);
    for (const SafetensorsEntry& t : st.tensors) {
        bool known = t.name == "lm_head.weight";
        for (const HFTensor& e : expected) known = known || t.name == prefix + e.name;
        auto ends_with = [&](const std::string& suffix) {
            return t.name.size() >= suffix.size() && t.name.compare(t.name.size() - suffix.size(), suffix.size(), suffix) == 0;
        };
        bool mask_buffer = ends_with(".attn.bias") || ends_with(".attn.masked_bias");
        if (!known && !mask_buffer) {
            fail("'%s' has a tensor this GPT-2 layout does not know: '%s' %s. Is it a GPT-2 (GPT2LMHeadModel) checkpoint?",
                 st.path.c_str(), t.name.c_str(), shape_string(t.shape).c_str());
        }
    }
    for (const HFTensor& e : expected) {
        std::string name = prefix + e.name;
        const SafetensorsEntry* t = st.find(name);
        if (!t) fail("'%s' is missing tensor '%s' (a model of %s needs it)", st.path.c_str(), name.c_str(), describe_config(cfg).c_str());
        if (t->shape != e.shape) {
            fail("'%s': tensor '%s' has shape %s, expected %s for %s%s", st.path.c_str(), name.c_str(),
                 shape_string(t->shape).c_str(), shape_string(e.shape).c_str(), describe_config(cfg).c_str(),
                 e.transposed ? " (Conv1D weights are stored (in, out))" : "");
        }
        std::vector<float> values = safetensors_read_floats(st, *t);
        float* dst = params.data() + hf_tensor_offset(e, cfg, layout);
        if (!e.transposed) {
            std::copy(values.begin(), values.end(), dst);
        } else {  // (in, out) there -> (out, in) here
            int64_t in = e.shape[0], out = e.shape[1];
            for (int64_t i = 0; i < in; i++)
                for (int64_t o = 0; o < out; o++) dst[o * in + i] = values[i * out + o];
        }
    }
    if (const SafetensorsEntry* head = st.find("lm_head.weight")) {  // tied: it must be the embedding itself
        std::vector<float> values = safetensors_read_floats(st, *head);
        size_t n = (size_t)cfg.vocab_size * cfg.channels;
        if (values.size() != n || memcmp(values.data(), params.data() + layout.offset[WTE], n * 4) != 0) {
            fail("'%s': lm_head.weight differs from the token embedding wte: an untied output layer, which this model "
                 "(GPT-2, tied) cannot hold", st.path.c_str());
        }
    }
    return params;
}

// ----------------------------------------------------------------------------------------------
// Export: our parameters -> model.safetensors + config.json

// Writes DIR/model.safetensors (dtype "F32" or "BF16", the padded vocabulary rows dropped, no
// lm_head: transformers ties it to wte, and safetensors cannot store one tensor twice) and
// DIR/config.json for GPT2LMHeadModel.
inline void hf_export(const std::string& dir, const GPT2Config& cfg, const float* params, const std::string& dtype) {
    ParamLayout layout = param_layout(cfg);
    std::vector<HFTensor> tensors = hf_gpt2_tensors(cfg);
    bool bf16 = dtype == "BF16";
    std::vector<std::vector<char>> storage(tensors.size());
    std::vector<SafetensorsTensor> out;
    for (size_t k = 0; k < tensors.size(); k++) {
        const HFTensor& e = tensors[k];
        const float* src = params + hf_tensor_offset(e, cfg, layout);
        size_t n = 1;
        for (int64_t d : e.shape) n *= (size_t)d;
        std::vector<float> values(n);
        if (!e.transposed) {
            std::copy(src, src + n, values.begin());
        } else {  // (out, in) here -> (in, out) there
            int64_t in = e.shape[0], o_dim = e.shape[1];
            for (int64_t i = 0; i < in; i++)
                for (int64_t o = 0; o < o_dim; o++) values[i * o_dim + o] = src[o * in + i];
        }
        std::vector<char>& bytes = storage[k];
        if (bf16) {
            bytes.resize(n * 2);
            uint16_t* h = (uint16_t*)bytes.data();
            for (size_t i = 0; i < n; i++) h[i] = float_to_bf16_round_nearest(values[i]);
        } else {
            bytes.resize(n * 4);
            memcpy(bytes.data(), values.data(), n * 4);
        }
        out.push_back({"transformer." + e.name, bf16 ? "BF16" : "F32", e.shape, bytes.data(), bytes.size()});
    }
    make_dirs(dir);
    // "format": "pt" tells transformers the tensors follow PyTorch's conventions (it refuses files without it)
    write_safetensors(dir + "/model.safetensors", out, {{"format", "pt"}});

    std::string config = "{\n";
    config += "  \"architectures\": [\"GPT2LMHeadModel\"],\n  \"model_type\": \"gpt2\",\n";
    config += strprintf("  \"vocab_size\": %d,\n  \"n_positions\": %d,\n  \"n_ctx\": %d,\n  \"n_embd\": %d,\n", cfg.vocab_size,
                        cfg.max_seq_len, cfg.max_seq_len, cfg.channels);
    config += strprintf("  \"n_layer\": %d,\n  \"n_head\": %d,\n  \"n_inner\": null,\n", cfg.num_layers, cfg.num_heads);
    config += "  \"activation_function\": \"gelu_new\",\n  \"layer_norm_epsilon\": 1e-05,\n";
    config += "  \"resid_pdrop\": 0.0,\n  \"embd_pdrop\": 0.0,\n  \"attn_pdrop\": 0.0,\n  \"initializer_range\": 0.02,\n";
    config += "  \"scale_attn_weights\": true,\n  \"scale_attn_by_inverse_layer_idx\": false,\n  \"tie_word_embeddings\": true,\n";
    int eot = cfg.vocab_size > 50256 ? 50256 : cfg.vocab_size - 1;
    config += strprintf("  \"bos_token_id\": %d,\n  \"eos_token_id\": %d,\n", eot, eot);
    config += strprintf("  \"torch_dtype\": \"%s\"\n}\n", bf16 ? "bfloat16" : "float32");
    AtomicFile f(dir + "/config.json", "config file");
    f.write(config.data(), config.size());
    f.commit();
}
