// cpu_reference.h — the CPU trainer's layer functions, the reference every kernel is checked against.
//
// They are train_gpt_cpu.cpp's own functions (fp32, OpenMP, checked against PyTorch by the tests),
// compiled once into cpu_reference.o (see cpu_reference.cpp) and declared here. A declaration that
// does not match its definition fails to link. They are also named in namespace cpu, so that a
// file reads cpu::gelu_forward(...) next to llmc/gelu.cuh's gelu_forward(...) and a reader always
// sees which one runs (the two are overloads: different argument types).
#pragma once

#include <cstddef>

void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int N, int IC, int OC);
// (the vocabulary range is for tensor parallelism: a rank holding rows [vocab_begin, +vocab_rows))
void encoder_forward(float* out, const int* tokens, const float* wte, const float* wpe, int B, int T, int C,
                     int vocab_begin = 0, int vocab_rows = 0x7fffffff);
void encoder_backward(float* dwte, float* dwpe, const float* dout, const int* tokens, int B, int T, int C,
                      int vocab_begin = 0, int vocab_rows = 0x7fffffff);
void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                       int N, int C);
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int N, int C);
void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH);
void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att, int B, int T, int C, int NH);
void gelu_forward(float* out, const float* inp, size_t n);
void gelu_backward(float* dinp, const float* inp, const float* dout, size_t n);
void residual_forward(float* out, const float* a, const float* b, size_t n);
void crossentropy_forward(float* losses, float* logsumexp, const float* logits, const int* targets, int N, int V, int Vp);
void crossentropy_softmax_backward(float* logits, const float* logsumexp, const int* targets, int N, int V, int Vp,
                                   float dloss, int vocab_begin = 0);
float global_grad_norm(const float* grads, size_t n);
float clip_coefficient(float norm, float max_norm);
void adamw_update(float* params, const float* grads, float* m, float* v, size_t n, float lr, float beta1, float beta2,
                  float eps, float weight_decay, int t, float grad_scale);

namespace cpu {
using ::matmul_forward;
using ::encoder_forward;
using ::encoder_backward;
using ::layernorm_forward;
using ::layernorm_backward;
using ::attention_forward;
using ::attention_backward;
using ::gelu_forward;
using ::gelu_backward;
using ::residual_forward;
using ::crossentropy_forward;
using ::crossentropy_softmax_backward;
using ::global_grad_norm;
using ::clip_coefficient;
using ::adamw_update;
}  // namespace cpu
