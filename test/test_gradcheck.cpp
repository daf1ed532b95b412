// test_gradcheck.cpp — the CPU trainer's hand-written backward pass against finite differences.
//
// The gradient g of the loss must satisfy, for any direction d,
//     g . d  ~=  (loss(p + eps d) - loss(p - eps d)) / (2 eps)       (central difference, error O(eps^2))
// Checking single elements in fp32 drowns in rounding (a loss near 6 has ~5e-7 absolute precision,
// divided by a small eps). A random direction spread over a whole tensor sums thousands of
// gradient entries, so g . d is large compared to that rounding: one check per parameter tensor
// (a wrong gradient in any tensor shows up in its own check) plus one over all parameters.
//
// The model is tiny (2 layers, 32 channels, vocab 96, padded to 128) with weights 8x GPT-2's init
// and random biases and LayerNorm parameters, so the network is clearly nonlinear and no term is
// trivially zero. The difference uses eps = 4e-3 and 2e-3 combined by Richardson extrapolation,
// which cancels the O(eps^2) truncation error; what remains is fp32 rounding in the two losses.
// Tolerance: 5e-3 relative; the largest error seen on this model is 1.7e-3 (lnfb).
// The trainer itself, so that the model checked is the one that trains; its main renamed out of
// the way of this one.
#define main train_gpt_cpu_main
#include "train_gpt_cpu.cpp"
#undef main

static double directional_derivative(GPT2* model, const std::vector<int>& x, const std::vector<int>& y, int B, int T,
                                     const std::vector<float>& dir, float eps) {
    std::vector<float> saved = model->params;
    for (size_t i = 0; i < dir.size(); i++) model->params[i] = saved[i] + eps * dir[i];
    gpt2_forward(model, x.data(), B, T);
    double plus = gpt2_loss(model, y.data(), B, T);
    for (size_t i = 0; i < dir.size(); i++) model->params[i] = saved[i] - eps * dir[i];
    gpt2_forward(model, x.data(), B, T);
    double minus = gpt2_loss(model, y.data(), B, T);
    model->params = saved;
    return (plus - minus) / (2.0 * eps);
}

int main() {
    GPT2Config cfg;
    parse_model_descriptor("L=2,C=32,H=4,T=16,V=96", &cfg);
    cfg.padded_vocab_size = 128;  // exercise padding: 32 padded logits must stay out of the loss
    ParamLayout layout = param_layout(cfg);
    std::vector<float> params(layout.total);
    init_gpt2_params(cfg, 3, params.data(), 0, params.size());
    // GPT-2's init (std 0.02) leaves a tiny model almost linear, with gradients for some tensors too
    // small to see through fp32 rounding; scale the weights up 8x and make biases and LayerNorm
    // parameters non-trivial, with the same counter-based generator
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        bool gain = t == LN1W || t == LN2W || t == LNFW;
        for (size_t i = 0; i < layout.count[t]; i++) {
            float& w = params[layout.offset[t] + i];
            if (param_tensor_decays(t)) w *= 8.0f;
            else w = (gain ? 1.0f : 0.0f) + 0.3f * normal_from_counter(99, layout.offset[t] + i);
        }
    }
    // padded wte rows stay zero: they never receive a gradient from the loss
    GPT2 model;
    gpt2_build(&model, cfg, params);
    int B = 2, T = 16;
    CPURunShape shape;
    shape.cfg = cfg, shape.B = B, shape.T = T;
    gpt2_allocate(&model, shape);
    std::vector<int> x(B * T), y(B * T);
    for (int i = 0; i < B * T; i++) {
        x[i] = (int)(splitmix64(i) % 96);
        y[i] = (int)(splitmix64(1000 + i) % 96);
    }
    gpt2_forward(&model, x.data(), B, T);
    float loss = gpt2_loss(&model, y.data(), B, T);
    std::fill(model.grads.begin(), model.grads.end(), 0.0f);
    gpt2_backward(&model, x.data(), y.data(), B, T, 1.0f / (B * T));

    int failures = 0;
    // Training passes dloss to the loss, which then writes the logits' gradient in the same pass
    // (crossentropy_forward_backward): the same loss and gradients, bit for bit, as the two passes
    // (so the finite differences below check both).
    std::vector<float> two_passes = model.grads;
    gpt2_forward(&model, x.data(), B, T);
    float fused_loss = gpt2_loss(&model, y.data(), B, T, 0, 1.0f / (B * T));
    std::fill(model.grads.begin(), model.grads.end(), 0.0f);
    gpt2_backward(&model, x.data(), y.data(), B, T, 1.0f / (B * T));
    bool same = fused_loss == loss && model.grads == two_passes;
    printf("%s: the loss with the logits' gradient in one pass == loss, then backward (bit for bit)\n", same ? "PASS" : "FAIL");
    failures += !same;
    auto check_direction = [&](const std::string& name, const std::vector<float>& dir) {
        double analytic = 0.0;
        for (size_t i = 0; i < dir.size(); i++) analytic += (double)model.grads[i] * dir[i];
        // Richardson extrapolation: (4 D(h/2) - D(h)) / 3 cancels the h^2 term of the central difference
        double coarse = directional_derivative(&model, x, y, B, T, dir, 4e-3f);
        double fine = directional_derivative(&model, x, y, B, T, dir, 2e-3f);
        double numeric = (4.0 * fine - coarse) / 3.0;
        double rel = std::fabs(analytic - numeric) / std::max(std::fabs(numeric), 1e-6);
        bool ok = rel < 5e-3 && std::isfinite(analytic);
        printf("%s: gradient %s: analytic %.6e, finite difference %.6e, relative error %.1e\n", ok ? "PASS" : "FAIL",
               name.c_str(), analytic, numeric, rel);
        failures += !ok;
    };
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        std::vector<float> dir(layout.total, 0.0f);
        size_t n = t == WTE ? (size_t)cfg.vocab_size * cfg.channels : layout.count[t];
        for (size_t i = 0; i < n; i++) dir[layout.offset[t] + i] = normal_from_counter(7 + t, i);
        check_direction(param_tensor_name(t), dir);
    }
    std::vector<float> all(layout.total);
    for (size_t i = 0; i < all.size(); i++) all[i] = normal_from_counter(1234, i);
    for (size_t i = (size_t)cfg.vocab_size * cfg.channels; i < (size_t)cfg.padded_vocab_size * cfg.channels; i++) all[i] = 0;
    check_direction("all parameters", all);

    bool padding_clean = true;
    for (size_t i = (size_t)cfg.vocab_size * cfg.channels; i < (size_t)cfg.padded_vocab_size * cfg.channels; i++)
        padding_clean &= model.grads[i] == 0.0f;
    printf("%s: padded vocabulary rows receive no gradient\n", padding_clean ? "PASS" : "FAIL");
    failures += !padding_clean;
    return failures ? 1 : 0;
}
