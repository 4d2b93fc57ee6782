# libmegamoe.so: the C API (src/capi, include/megamoe/megamoe.h) over the whole library, and the
# rules that install it with the headers and a CMake package (find_package(megamoe),
# megamoe::megamoe). Included from the top-level CMakeLists.txt after megamoe_core is complete.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# Through 0.x every minor version may change the C ABI, so it is part of the soname.
if(PROJECT_VERSION_MAJOR EQUAL 0)
  set(MEGAMOE_SOVERSION "0.${PROJECT_VERSION_MINOR}")
else()
  set(MEGAMOE_SOVERSION "${PROJECT_VERSION_MAJOR}")
endif()

set(_capi_sources src/capi/capi.cpp)
if(MEGAMOE_CUDA)
  list(APPEND _capi_sources src/capi/layer_cuda.cpp)
  set(_archives $<TARGET_FILE:megamoe_core> $<TARGET_FILE:megamoe_host>)
else()
  list(APPEND _capi_sources src/capi/layer_no_cuda.cpp)
  set(_archives $<TARGET_FILE:megamoe_host>)
endif()

# The exported symbols: the C API (megamoe_*) and the C++ API, i.e. what namespace megamoe defines
# under names the public headers declare, without the implementation's (cmake/megamoe_exports.cmake
# says exactly). The list is made from the archives at build time, so it follows the code; the map
# names each symbol exactly (a glob in a version script would win over any exclusion).
find_program(MEGAMOE_CXXFILT NAMES c++filt llvm-cxxfilt REQUIRED)
file(GLOB _public_headers CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/include/megamoe/*.h)
string(JOIN "|" _archives_arg ${_archives})
string(JOIN "|" _headers_arg ${_public_headers})
set(_exports_map "${CMAKE_CURRENT_BINARY_DIR}/megamoe_exports.map")
add_custom_command(
  OUTPUT "${_exports_map}"
  COMMAND "${CMAKE_COMMAND}" "-DNM=${CMAKE_NM}" "-DCXXFILT=${MEGAMOE_CXXFILT}"
          "-DARCHIVES=${_archives_arg}" "-DHEADERS=${_headers_arg}" "-DOUTPUT=${_exports_map}"
          -P "${CMAKE_CURRENT_SOURCE_DIR}/cmake/megamoe_exports.cmake"
  DEPENDS ${_archives} ${_public_headers} "${CMAKE_CURRENT_SOURCE_DIR}/cmake/megamoe_exports.cmake"
  COMMENT "Listing the symbols libmegamoe.so exports"
  VERBATIM)
add_custom_target(megamoe_exports DEPENDS "${_exports_map}")

# Installed, the library (and the tool) find libcudart and libnccl where they were linked against
# them (the CUDA toolkit, third_party/nccl: CMake would drop the latter, being inside the project),
# and anything installed beside the library.
set(MEGAMOE_INSTALL_RPATH "$ORIGIN")
if(MEGAMOE_CUDA)
  list(APPEND MEGAMOE_INSTALL_RPATH "${CUDAToolkit_LIBRARY_DIR}")
endif()
if(MEGAMOE_NCCL_LIBRARY AND MEGAMOE_EP AND MEGAMOE_CUDA)
  get_filename_component(_nccl_dir "${MEGAMOE_NCCL_LIBRARY}" DIRECTORY)
  list(APPEND MEGAMOE_INSTALL_RPATH "${_nccl_dir}")
endif()

add_library(megamoe_lib SHARED ${_capi_sources})
add_library(megamoe::megamoe ALIAS megamoe_lib)
add_dependencies(megamoe_lib megamoe_exports)
target_include_directories(megamoe_lib
  PUBLIC $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/include>
         $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>
  PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/src)
# The C++ API's headers are C++20; C users are unaffected.
target_compile_features(megamoe_lib INTERFACE cxx_std_20)
# Default visibility like the archives': the version script decides what is exported (a hidden copy
# of an inline symbol, e.g. megamoe::Error's typeinfo, would hide every copy).
target_compile_options(megamoe_lib PRIVATE -Wall -Wextra -Wno-unused-parameter)
target_compile_definitions(megamoe_lib PRIVATE MEGAMOE_CAPI_HAS_CUDA=$<BOOL:${MEGAMOE_CUDA}>)
# Every object of the archives goes in (the C++ API too, not only what the C API calls); the
# archives' own dependencies follow on the link line. With CUDA, the shared runtime comes first, so
# that the library and its caller share one runtime (its current device and error state) instead
# of a private static copy.
target_link_options(megamoe_lib PRIVATE "LINKER:--whole-archive" ${_archives} "LINKER:--no-whole-archive"
                    "LINKER:--version-script=${_exports_map}")
if(NOT MEGAMOE_SANITIZE)
  # The sanitizer runtimes are linked into executables only, so an instrumented library has
  # undefined symbols by design.
  target_link_options(megamoe_lib PRIVATE "LINKER:--no-undefined")
endif()
if(MEGAMOE_CUDA)
  target_link_libraries(megamoe_lib PRIVATE CUDA::cudart megamoe_core nlohmann_json::nlohmann_json)
else()
  target_link_libraries(megamoe_lib PRIVATE megamoe_host nlohmann_json::nlohmann_json)
endif()
set_target_properties(megamoe_lib PROPERTIES
  OUTPUT_NAME megamoe
  EXPORT_NAME megamoe
  VERSION ${PROJECT_VERSION}
  SOVERSION ${MEGAMOE_SOVERSION}
  LINK_DEPENDS "${_exports_map}"
  INSTALL_RPATH "${MEGAMOE_INSTALL_RPATH}")

install(TARGETS megamoe_lib EXPORT megamoeTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY include/megamoe DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} FILES_MATCHING PATTERN "*.h")
install(EXPORT megamoeTargets NAMESPACE megamoe:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/megamoe)
configure_package_config_file(cmake/megamoeConfig.cmake.in
  "${CMAKE_CURRENT_BINARY_DIR}/megamoeConfig.cmake"
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/megamoe)
# 0.x: a minor version may break the ABI, so only the same minor version is compatible.
if(PROJECT_VERSION_MAJOR EQUAL 0)
  set(_compat SameMinorVersion)
else()
  set(_compat SameMajorVersion)
endif()
write_basic_package_version_file("${CMAKE_CURRENT_BINARY_DIR}/megamoeConfigVersion.cmake"
  VERSION ${PROJECT_VERSION} COMPATIBILITY ${_compat})
install(FILES "${CMAKE_CURRENT_BINARY_DIR}/megamoeConfig.cmake"
              "${CMAKE_CURRENT_BINARY_DIR}/megamoeConfigVersion.cmake"
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/megamoe)
