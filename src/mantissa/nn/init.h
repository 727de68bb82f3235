// Seeded initialisation of parameters with PyTorch's default distributions. The random numbers
// come from Philox keyed by (seed, stream): every tensor of a model draws from its own stream, so
// a model's initial weights depend only on the seed and the tensor's position in the model.
#pragma once

#include <cstdint>

#include "mantissa/core/tensor.h"

namespace mantissa::nn::init {

// U(low, high), computed in FP64 and rounded to the tensor's dtype.
void uniform_(Tensor& t, double low, double high, uint64_t seed, uint64_t stream);
// N(mean, std) by Box-Muller.
void normal_(Tensor& t, double mean, double std, uint64_t seed, uint64_t stream);

// fan_in and fan_out as PyTorch counts them: (in, out) of a (out, in, k...) weight times the
// receptive field size.
int64_t fan_in(const Tensor& weight);
int64_t fan_out(const Tensor& weight);

// nn.Linear / nn.Conv2d defaults: kaiming_uniform(a=sqrt(5)), i.e. U(-1/sqrt(fan_in), ...), and
// the same bound for the bias.
void default_weight_(Tensor& weight, uint64_t seed, uint64_t stream);
void default_bias_(Tensor& bias, int64_t fan_in, uint64_t seed, uint64_t stream);
// kaiming_normal_(mode="fan_out", nonlinearity="relu"): N(0, sqrt(2 / fan_out)) (torchvision's
// ResNet convolutions).
void kaiming_normal_fan_out_(Tensor& weight, uint64_t seed, uint64_t stream);

}  // namespace mantissa::nn::init
