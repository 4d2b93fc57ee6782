# The test capi.install_and_consume (cmake -P; arguments in tests/capi/CMakeLists.txt):
#   1. cmake --install BUILD_DIR --prefix PREFIX;
#   2. the installed libmegamoe: its soname, and `nm -D --defined-only` lists only the C API
#      (megamoe_*) and C++ symbols of namespace megamoe, nothing named *detail*;
#   3. consumer/ (find_package(megamoe) + megamoe::megamoe, C and C++) configured, built and run.
cmake_minimum_required(VERSION 3.25)

function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${out}\n${err}")
  endif()
  set(step_output "${out}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE "${PREFIX}" "${CONSUMER_BUILD}")
run_step("cmake --install" "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${PREFIX}")

set(lib "${PREFIX}/${LIBDIR}/libmegamoe.so")
foreach(f "${lib}" "${lib}.${SONAME_VERSION}" "${lib}.${VERSION}" "${PREFIX}/include/megamoe/megamoe.h"
          "${PREFIX}/include/megamoe/runtime.h" "${PREFIX}/${LIBDIR}/cmake/megamoe/megamoeConfig.cmake"
          "${PREFIX}/${LIBDIR}/cmake/megamoe/megamoeConfigVersion.cmake")
  if(NOT EXISTS "${f}")
    message(FATAL_ERROR "the install has no ${f}")
  endif()
endforeach()

run_step("nm -D --defined-only" "${NM}" -D --defined-only -C "${lib}")
string(REPLACE "\n" ";" lines "${step_output}")
set(c_api 0)
set(cxx_api 0)
set(bad "")
foreach(line IN LISTS lines)
  # "ADDRESS TYPE NAME"
  if(NOT line MATCHES "^[0-9a-f]+ [A-Za-z] (.+)$")
    continue()
  endif()
  set(name "${CMAKE_MATCH_1}")
  if(name MATCHES "detail")
    string(APPEND bad "  ${name}\n")
  elseif(name MATCHES "^megamoe_[a-z_]+$")
    math(EXPR c_api "${c_api} + 1")
  elseif(name MATCHES "^(typeinfo for |typeinfo name for |vtable for )?megamoe::")
    math(EXPR cxx_api "${cxx_api} + 1")
  else()
    string(APPEND bad "  ${name}\n")
  endif()
endforeach()
if(NOT bad STREQUAL "")
  message(FATAL_ERROR "libmegamoe.so exports symbols outside the C and C++ APIs:\n${bad}")
endif()
if(c_api LESS 20 OR cxx_api LESS 50)
  message(FATAL_ERROR "libmegamoe.so exports ${c_api} C and ${cxx_api} C++ symbols; expected the whole API")
endif()
message(STATUS "libmegamoe.so exports ${c_api} C API and ${cxx_api} C++ API symbols")

run_step("configuring consumer/" "${CMAKE_COMMAND}" -S "${CONSUMER_SOURCE}" -B "${CONSUMER_BUILD}" -G "${GENERATOR}"
         "-DCMAKE_PREFIX_PATH=${PREFIX}" "-DCMAKE_C_COMPILER=${C_COMPILER}" "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}"
         "-DCMAKE_EXE_LINKER_FLAGS=${LINK_FLAGS}" "-DEXPECTED_VERSION=${VERSION}")
run_step("building consumer/" "${CMAKE_COMMAND}" --build "${CONSUMER_BUILD}")
run_step("running consumer/" "${CONSUMER_BUILD}/megamoe_consumer")
message(STATUS "${step_output}")
