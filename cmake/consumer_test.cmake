# CTest driver for examples/consumer (cmake -P; the consumer.* tests in
# CMakeLists.txt). Builds the consumer in a fresh WORK_DIR as an embedding
# project would, with the compiler and generator of this build:
#   MODE=find_package      installs BUILD_DIR to WORK_DIR/prefix, then configures,
#                          builds and runs the consumer with find_package(pagedattn)
#   MODE=pkg_config        compiles and links the consumer with the flags of the
#                          installed pagedattn.pc (after find_package), then runs it
#   MODE=add_subdirectory  configures the consumer with the source tree as a
#                          subproject (CUDA off) and compiles main.cpp against it;
#                          it links nothing: linking the umbrella in-tree is what
#                          the CLI and the tests of this build already do
foreach(var MODE SOURCE_DIR BUILD_DIR WORK_DIR CXX_COMPILER GENERATOR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "consumer_test.cmake: -D${var}=... is required")
  endif()
endforeach()

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    list(JOIN ARGN " " cmd)
    message(FATAL_ERROR "consumer: failed (${rc}): ${cmd}")
  endif()
endfunction()

set(consumer_src ${SOURCE_DIR}/examples/consumer)
set(prefix ${WORK_DIR}/prefix)
set(configure ${CMAKE_COMMAND} -G ${GENERATOR} -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_BUILD_TYPE=Release)
if(LAUNCHER)
  list(APPEND configure -DCMAKE_CXX_COMPILER_LAUNCHER=${LAUNCHER})
endif()

if(MODE STREQUAL "find_package")
  file(REMOVE_RECURSE ${WORK_DIR})
  run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
  run(${configure} -S ${consumer_src} -B ${WORK_DIR}/build -DCMAKE_PREFIX_PATH=${prefix})
  run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
  run(${WORK_DIR}/build/consumer)
elseif(MODE STREQUAL "pkg_config")
  find_program(PKG_CONFIG pkg-config REQUIRED)
  set(ENV{PKG_CONFIG_PATH} "${PC_DIR}")
  execute_process(COMMAND ${PKG_CONFIG} --cflags --libs pagedattn
                  OUTPUT_VARIABLE flags OUTPUT_STRIP_TRAILING_WHITESPACE COMMAND_ERROR_IS_FATAL ANY)
  separate_arguments(flags UNIX_COMMAND "${flags}")
  run(${CXX_COMPILER} -O2 ${consumer_src}/main.cpp -o ${WORK_DIR}/consumer_pkg_config ${flags})
  run(${WORK_DIR}/consumer_pkg_config)
elseif(MODE STREQUAL "add_subdirectory")
  file(REMOVE_RECURSE ${WORK_DIR})
  run(${configure} -S ${consumer_src} -B ${WORK_DIR} -DPAGEDATTN_SOURCE_DIR=${SOURCE_DIR}
      -DPAGEDATTN_ENABLE_CUDA=OFF)
  run(${CMAKE_COMMAND} --build ${WORK_DIR} --target CMakeFiles/consumer.dir/main.cpp.o)
else()
  message(FATAL_ERROR "consumer_test.cmake: unknown MODE ${MODE}")
endif()
