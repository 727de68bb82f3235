// Mantissa's public C++ API: include this one header.
#pragma once

#include "mantissa/autograd/autograd.h"
#include "mantissa/core/convert.h"
#include "mantissa/core/cpu_features.h"
#include "mantissa/core/dtype.h"
#include "mantissa/core/error.h"
#include "mantissa/core/float_formats.h"
#include "mantissa/core/memory.h"
#include "mantissa/core/parallel.h"
#include "mantissa/core/philox.h"
#include "mantissa/core/tensor.h"
#include "mantissa/io/safetensors.h"
#include "mantissa/ops/ops.h"
