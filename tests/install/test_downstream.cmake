# Installs Mantissa into a prefix inside the build tree, then configures, builds and runs
# examples/downstream against that copy, as a project of its own would. Invoked by CTest as:
#   cmake -DBUILD_DIR=<Mantissa's build> -DCONFIG=<its configuration> -DSOURCE=<downstream project>
#         -DWORK=<scratch dir> -DGENERATOR=<generator> -DCXX=<compiler> [-DLAUNCHER=<ccache>]
#         -P test_downstream.cmake
foreach(v BUILD_DIR CONFIG SOURCE WORK GENERATOR CXX)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "pass -D${v}=...")
  endif()
endforeach()

function(run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (exit ${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  set(out "${out}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE ${WORK})
set(prefix ${WORK}/prefix)
run("install" ${CMAKE_COMMAND} --install ${BUILD_DIR} --config ${CONFIG} --prefix ${prefix})

# Every header an installed header includes is installed too (internal headers are not).
file(GLOB_RECURSE headers ${prefix}/include/*.h)
list(LENGTH headers count)
if(count LESS 10 OR NOT EXISTS ${prefix}/include/mantissa/mantissa.h)
  message(FATAL_ERROR "only ${count} headers installed under ${prefix}/include")
endif()
foreach(h ${headers})
  # Libraries the package does not find (nlohmann_json is the library's private dependency)
  # must not be needed by an installed header.
  file(STRINGS ${h} private REGEX "^#include <nlohmann/")
  if(private)
    message(FATAL_ERROR "${h} includes nlohmann_json, which find_package(Mantissa) does not find")
  endif()
  file(STRINGS ${h} includes REGEX "^#include \"mantissa/")
  foreach(line ${includes})
    string(REGEX REPLACE "^#include \"([^\"]+)\".*" "\\1" included "${line}")
    if(NOT EXISTS ${prefix}/include/${included})
      message(FATAL_ERROR "${h} includes ${included}, which is not installed")
    endif()
  endforeach()
endforeach()

set(launcher)
if(LAUNCHER)
  set(launcher -DCMAKE_CXX_COMPILER_LAUNCHER=${LAUNCHER})
endif()
run("configure" ${CMAKE_COMMAND} -S ${SOURCE} -B ${WORK}/build -G ${GENERATOR}
    -DCMAKE_BUILD_TYPE=${CONFIG} -DCMAKE_CXX_COMPILER=${CXX} ${launcher}
    -DCMAKE_PREFIX_PATH=${prefix})
run("build" ${CMAKE_COMMAND} --build ${WORK}/build --config ${CONFIG})
run("the downstream program" ${WORK}/build/train_lenet)
message("${out}")
run("the installed program" ${prefix}/bin/mantissa formats)
message("${out}")
