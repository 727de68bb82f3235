// Neural-network kernels over tensors of any float storage dtype, computing in FP32: one header
// per concern, all included here (what src/mantissa/ops includes). Layouts follow PyTorch:
// activations (N, C, H, W), convolution weights (O, C/groups, KH, KW), linear weights (out, in).
// Raw kernels: they record nothing (src/mantissa/ops adds autograd).
#pragma once

#include "mantissa/kernels/conv.h"     // conv2d and its two backward functions
#include "mantissa/kernels/dropout.h"  // dropout
#include "mantissa/kernels/linear.h"   // linear, its weight gradient in parts, matmul
#include "mantissa/kernels/loss.h"     // nll_loss, cross_entropy
#include "mantissa/kernels/norm.h"     // batch_norm, group_norm, layer_norm
#include "mantissa/kernels/pool.h"     // max, average and adaptive-average pooling
