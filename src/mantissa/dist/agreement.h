// What every rank of a data-parallel job must agree on, checked or made so with one collective
// each: the configuration at start, the loss scaler's overflow flag, the global gradient norm.
// Each function is a collective: every rank calls it, in the same order as its other collectives.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "mantissa/comm/communicator.h"

namespace mantissa::dist {

// A configuration as ordered (name, value) text fields ("model" -> "resnet18", "lr" -> "0.001").
using ConfigFields = std::vector<std::pair<std::string, std::string>>;

// Gathers every rank's fields and throws the same Error on every rank if they differ, naming the
// first field (in order) whose name or value differs and the ranks' values: "ranks disagree on
// the configuration: 'lr' is '0.001' on rank 0 but '0.01' on rank 2". `what` names the
// configuration in the message.
// `hint` replaces the default advice (the same program and flags on every rank).
void check_config_agreement(comm::Communicator& comm, const ConfigFields& fields,
                            const std::string& what = "configuration",
                            const std::string& hint = "");

// Whether any rank found an inf/NaN (a MAX all-reduce of the flag), so that every rank makes the
// same skip decision where the ranks' gradients can differ (sharded state, local checks).
bool found_inf_on_any_rank(comm::Communicator& comm, bool found_here);

// The 2-norm over every rank's share: sqrt of the sum over ranks of each rank's sum of squares
// (an FP64 all-reduce); inf or NaN if any rank's is.
double global_norm(comm::Communicator& comm, double sum_of_squares_here);

}  // namespace mantissa::dist
