# The dependency rule, enforced by include paths (docs/architecture.md,
# "Layers and the dependency rule").
#
# Internal headers are included by their path under src/, e.g.
# "backends/cpu_attn/cpu_attn_plan.h". A library target never gets src/ itself
# on its include path: it gets a folder of the build tree holding links to
# just the src/ folders it may include, so that including any other folder's
# header fails to compile. The tests, tools and fuzzers sit above every layer
# and include src/ directly.

# Gives `target` the src/ folders named after it (paths relative to src/).
function(pagedattn_internal_includes target)
  set(view ${PROJECT_BINARY_DIR}/internal-includes/${target})
  file(REMOVE_RECURSE ${view})
  foreach(folder IN LISTS ARGN)
    cmake_path(GET folder PARENT_PATH parent)
    file(MAKE_DIRECTORY ${view}/${parent})
    file(CREATE_LINK ${PROJECT_SOURCE_DIR}/src/${folder} ${view}/${folder} SYMBOLIC)
  endforeach()
  file(MAKE_DIRECTORY ${view})
  target_include_directories(${target} PRIVATE ${view})
endfunction()

# A CTest entry that preprocesses `header` with the include directories
# `target` compiles with: `allowed` must succeed, `forbidden` must fail
# because the header is not found (any other failure fails the test).
function(pagedattn_layering_test target verdict header)
  if(NOT PAGEDATTN_BUILD_TESTS)
    return()
  endif()
  string(REGEX REPLACE "^pagedattn_" "" layer ${target})
  string(MAKE_C_IDENTIFIER "${header}" id)
  set(name layering.${layer}.${verdict}.${id})
  add_test(NAME ${name}
    COMMAND ${CMAKE_CXX_COMPILER} -std=c++20 -E -o /dev/null
            "-I$<JOIN:$<TARGET_PROPERTY:${target},INCLUDE_DIRECTORIES>,;-I>"
            -include ${header} -x c++ /dev/null
    COMMAND_EXPAND_LISTS)
  if(verdict STREQUAL "forbidden")
    string(REPLACE "." "\\." header_re "${header}")
    set_tests_properties(${name} PROPERTIES
      PASS_REGULAR_EXPRESSION "${header_re}: No such file or directory|'${header_re}' file not found")
  elseif(NOT verdict STREQUAL "allowed")
    message(FATAL_ERROR "pagedattn_layering_test: verdict must be allowed or forbidden, got ${verdict}")
  endif()
endfunction()
