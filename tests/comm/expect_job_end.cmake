# Runs an MPI job and checks how it ended: its exit status (zero or not, as EXPECT says), that it
# ended within LIMIT seconds (a hang fails), and that its output matches PATTERN.
#   cmake -DMPIEXEC=... -DNP_FLAG=-n -DNP=2 "-DFLAGS=--oversubscribe ..." -DPROGRAM=... -DMODE=...
#         -DEXPECT=success|failure -DLIMIT=60 -DPATTERN=regex -P expect_job_end.cmake
separate_arguments(flags UNIX_COMMAND "${FLAGS}")
string(TIMESTAMP start "%s")
execute_process(COMMAND ${MPIEXEC} ${NP_FLAG} ${NP} ${flags} ${PROGRAM} ${MODE}
                RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT ${LIMIT})
string(TIMESTAMP end "%s")
math(EXPR elapsed "${end} - ${start}")
message("${out}${err}")
if(NOT status MATCHES "^-?[0-9]+$")
  message(FATAL_ERROR "the job did not end by itself: ${status} (after ${elapsed} s, limit ${LIMIT} s)")
endif()
if(EXPECT STREQUAL "success" AND NOT status EQUAL 0)
  message(FATAL_ERROR "the job failed with status ${status}")
endif()
if(EXPECT STREQUAL "failure" AND status EQUAL 0)
  message(FATAL_ERROR "the job ended with status 0; a failure was expected")
endif()
if(DEFINED PATTERN AND NOT "${out}${err}" MATCHES "${PATTERN}")
  message(FATAL_ERROR "the output does not match '${PATTERN}'")
endif()
message("mode ${MODE}: exit status ${status} after ${elapsed} s")
