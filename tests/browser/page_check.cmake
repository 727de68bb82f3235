# Writes an HTML page with the mantissa program, then checks it in headless Chromium (page_check).
# Invoked by CTest as:
#   cmake -DMANTISSA=<program> -DPAGE_CHECK=<page_check> -DWORK=<dir> -DPAGE=<file written>
#         -DCHARTS=<at least this many> -DEXIT=<the program's expected exit status>
#         -DRUN=<its arguments, ;-separated> -P page_check.cmake
# Chromium is looked up when the test runs, so installing it needs no reconfiguration;
# MANTISSA_CHROMIUM in the environment names another binary.
foreach(v MANTISSA PAGE_CHECK WORK PAGE CHARTS EXIT RUN)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "pass -D${v}=...")
  endif()
endforeach()

if(DEFINED ENV{MANTISSA_CHROMIUM})
  set(chromium $ENV{MANTISSA_CHROMIUM})
else()
  find_program(chromium NAMES chromium chromium-browser NO_CACHE)
endif()
if(NOT chromium)
  message("SKIPPED: chromium is not installed; `bash scripts/setup.sh --browser` installs "
          "Debian's (CI does)")
  return()
endif()

file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
execute_process(COMMAND ${MANTISSA} ${RUN} WORKING_DIRECTORY ${WORK} RESULT_VARIABLE rc
                OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL EXIT OR NOT EXISTS ${WORK}/${PAGE})
  message(FATAL_ERROR "mantissa ${RUN}: exit ${rc} (want ${EXIT}); it should have written "
                      "${WORK}/${PAGE}\n${out}\n${err}")
endif()
execute_process(COMMAND ${PAGE_CHECK} --chromium ${chromium} --page ${WORK}/${PAGE}
                        --charts ${CHARTS} --work ${WORK}/browser
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the page check failed (exit ${rc}); the page, its screenshot and the "
                      "browser's logs are in ${WORK}")
endif()
