// Splitting work across threads. Work is cut into contiguous ranges whose boundaries depend only on
// the size and grain, so a kernel whose per-element result depends only on the element's index
// gives identical results for any thread count.
#pragma once

#include <cstddef>
#include <functional>

namespace mantissa {

// Threads the engine uses when not told otherwise: MANTISSA_NUM_THREADS if set, else the number of
// hardware threads.
int default_num_threads();
// Overrides default_num_threads() for the whole process (the --threads flag); 0 restores it.
void set_num_threads(int n);

// Calls fn(begin, end) over [0, n) in ranges of at least `grain` elements (range starts are
// multiples of grain), on up to `threads` threads of a persistent pool; the calling thread takes
// part. An exception in any range is rethrown on the calling thread after all ranges finish. A
// parallel_for inside another (or from a second thread while one runs) runs its ranges on the
// calling thread, in order.
void parallel_for(size_t n, size_t grain, int threads,
                  const std::function<void(size_t, size_t)>& fn);

// Calls fn(task) once for each task in [0, tasks), on up to `threads` threads of the same pool;
// each thread takes the next task as it finishes one, so a thread that is slowed (a busy or
// shared machine) leaves its remaining tasks to the others. For work whose result does not depend
// on which thread runs a task. Exceptions and nesting as parallel_for.
void parallel_tasks(size_t tasks, int threads, const std::function<void(size_t)>& fn);

}  // namespace mantissa
