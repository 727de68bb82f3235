# Runs an MPI job and checks how it ended: that it ended within LIMIT seconds (a hang fails), with
# exit status STATUS (a number, or "nonzero"), and with output matching PATTERN (the program's own
# lines: Open MPI's banners are not always printed when a job is ended).
#   cmake -DMPIEXEC=... -DNP_FLAG=-n -DNP=2 "-DFLAGS=--oversubscribe ..." -DPROGRAM=... -DMODE=...
#         -DSTATUS=3 -DLIMIT=60 -DPATTERN=regex -P expect_job_end.cmake
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
if(STATUS STREQUAL "nonzero")
  if(status EQUAL 0)
    message(FATAL_ERROR "the job ended with status 0; a failure was expected")
  endif()
elseif(NOT status EQUAL STATUS)
  message(FATAL_ERROR "the job ended with status ${status}; expected ${STATUS}")
endif()
if(DEFINED PATTERN AND NOT "${out}${err}" MATCHES "${PATTERN}")
  message(FATAL_ERROR "the output does not match '${PATTERN}'")
endif()
message("mode ${MODE}: exit status ${status} after ${elapsed} s")
