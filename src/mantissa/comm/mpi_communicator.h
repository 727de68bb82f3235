// The Open MPI backend of comm::Communicator (built with MANTISSA_MPI=ON). comm::world() makes it
// when an MPI launcher started the process; this header names no MPI type.
//
// One communication thread makes every MPI call (Horovod's design; Open MPI 4.1 progresses
// non-blocking collectives only inside MPI calls, and a thread that polls them lets the caller
// compute meanwhile). It initialises MPI (MPI_THREAD_FUNNELED: only this thread calls MPI, and
// it is the thread that initialised it), duplicates MPI_COMM_WORLD for Mantissa's own traffic,
// and then takes collectives from a first-in, first-out queue: it starts each with MPI's
// non-blocking call (MPI_Iallreduce, ...) in the order they were queued, and polls the running
// ones with MPI_Testsome until they finish, yielding the processor between polls; with nothing
// running it sleeps until work arrives. f16 and bf16 travel as 2-byte elements
// (MPI_Type_contiguous(2, MPI_BYTE)) reduced by comm/half_reduce.h's operations, registered with
// MPI_Op_create as commutative. MPI errors are returned, not fatal (MPI_ERRORS_RETURN), and reach
// the caller's wait() as mantissa::Error.
//
// abort() hands MPI_Abort to the thread, which polls for it even while collectives are running;
// if the thread has not ended the job within 10 seconds, the process exits with _Exit and Open
// MPI's runtime ends the others (a rank gone without MPI_Finalize ends the job).
//
// At exit the thread finishes what is queued, frees its datatypes, operations and communicator,
// and calls MPI_Finalize.
#pragma once

#include <memory>

#include "mantissa/comm/communicator.h"

namespace mantissa::comm {

// Initialises MPI (on the new communication thread) and returns the world communicator. Throws
// Error if MPI cannot give the thread level it needs. Call once per process: comm::world() does.
std::unique_ptr<Communicator> make_mpi_communicator();

}  // namespace mantissa::comm
