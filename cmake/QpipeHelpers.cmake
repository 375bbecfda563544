# Helpers shared by every component: precompiled LibTorch header, plugins, tests.

# Precompiles the LibTorch headers that qpipe code includes, so a one-file change does not
# re-parse them. Each target builds its own PCH (flags differ between shared and executable).
function(qpipe_use_torch_pch target)
  target_precompile_headers(${target} PRIVATE <ATen/core/Tensor.h> <ATen/Functions.h>)
endfunction()

# qpipe_add_plugin(<name> SOURCES <src>... [OUTPUT_DIR <dir>] [LINK_LIBRARIES <lib>...] [NO_STATIC])
#
# Builds <name> as a loadable MODULE library lib<name>.so in OUTPUT_DIR (the built-in plugin
# folder by default) against the SDK (qpipe::plugin_sdk: the headers of core's base, io, model and
# sdk layers and dist's, not the host's): hidden visibility, every symbol resolved at link time
# (-z defs). When
# tests are built it also makes <name>_static, the same sources as a static library whose
# descriptor is exported as qpipe_plugin_descriptor_<name>() so tests can link it in directly
# (NO_STATIC skips it: fault fixtures only ever load as libraries).
function(qpipe_add_plugin name)
  cmake_parse_arguments(ARG "NO_STATIC" "OUTPUT_DIR" "SOURCES;LINK_LIBRARIES" ${ARGN})
  if(NOT ARG_SOURCES)
    message(FATAL_ERROR "qpipe_add_plugin(${name}): SOURCES is required")
  endif()
  if(NOT ARG_OUTPUT_DIR)
    set(ARG_OUTPUT_DIR "${QPIPE_PLUGIN_OUTPUT_DIR}")
    set_property(GLOBAL APPEND PROPERTY QPIPE_BUILTIN_PLUGINS ${name})
  endif()

  add_library(${name} MODULE ${ARG_SOURCES})
  # The SDK's include path only: a plugin cannot include the host's headers.
  target_link_libraries(${name} PRIVATE qpipe::plugin_sdk ${ARG_LINK_LIBRARIES})
  target_link_options(${name} PRIVATE -Wl,-z,defs)
  set_target_properties(${name} PROPERTIES
    PREFIX "lib"
    LIBRARY_OUTPUT_DIRECTORY "${ARG_OUTPUT_DIR}"
    CXX_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON)

  if(QPIPE_BUILD_TESTS AND NOT ARG_NO_STATIC)
    add_library(${name}_static STATIC ${ARG_SOURCES})
    target_link_libraries(${name}_static PUBLIC qpipe::plugin_sdk ${ARG_LINK_LIBRARIES})
    target_compile_definitions(${name}_static PRIVATE QPIPE_PLUGIN_STATIC_NAME=${name})
    set_target_properties(${name}_static PROPERTIES POSITION_INDEPENDENT_CODE ON)
    if(NOT QPIPE_TEST_DEBUG_INFO)
      target_compile_options(${name}_static PRIVATE -g0)
    endif()
  endif()
endfunction()

# qpipe_add_gtest(<name> SOURCES <src>... LABELS <label>... [LINK_LIBRARIES <lib>...])
function(qpipe_add_gtest name)
  cmake_parse_arguments(ARG "" "" "SOURCES;LABELS;LINK_LIBRARIES" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE qpipe::core GTest::gtest GTest::gtest_main ${ARG_LINK_LIBRARIES})
  gtest_discover_tests(${name}
    PROPERTIES LABELS "${ARG_LABELS}"
    WORKING_DIRECTORY "${PROJECT_SOURCE_DIR}"
    DISCOVERY_TIMEOUT 60)
endfunction()
