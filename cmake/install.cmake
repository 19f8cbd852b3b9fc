# Installs the library for find_package(pagedattn) and pkg-config
# (docs/embedding.md): static libraries, both tiers of public headers and the
# conformance header, the exported targets pagedattn::<name>, a config and a
# version file, pagedattn.pc, and the CLI.
include(CMakePackageConfigHelpers)

set(PAGEDATTN_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/pagedattn)
# Every static library the umbrella reaches: a static archive's dependencies
# must be installed with it.
set(pagedattn_exported pagedattn pagedattn_core pagedattn_parallel pagedattn_conformance
    pagedattn_builtin pagedattn_reference pagedattn_cpu_attn)
if(PAGEDATTN_HAVE_CUDA)
  list(APPEND pagedattn_exported pagedattn_cuda_flash pagedattn_cuda_runtime)
endif()
set_target_properties(pagedattn PROPERTIES EXPORT_NAME pagedattn)
install(TARGETS ${pagedattn_exported}
  EXPORT pagedattnTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  FILE_SET HEADERS DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT pagedattnTargets
  NAMESPACE pagedattn::
  DESTINATION ${PAGEDATTN_INSTALL_CMAKEDIR})
install(TARGETS pagedattn_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/pagedattnConfig.cmake.in
  ${PROJECT_BINARY_DIR}/pagedattnConfig.cmake
  INSTALL_DESTINATION ${PAGEDATTN_INSTALL_CMAKEDIR})
# 0.x: a minor version may break the API.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/pagedattnConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/pagedattnConfig.cmake ${PROJECT_BINARY_DIR}/pagedattnConfigVersion.cmake
  DESTINATION ${PAGEDATTN_INSTALL_CMAKEDIR})

# pkg-config: static libraries only, so every dependency is on Libs (not
# Libs.private), the built-in backends' archive between --whole-archive flags
# (see the umbrella in CMakeLists.txt), each archive before those it needs.
set(PAGEDATTN_PC_LIBS "-Wl,--whole-archive -lpagedattn_builtin -Wl,--no-whole-archive")
if(PAGEDATTN_HAVE_CUDA)
  string(APPEND PAGEDATTN_PC_LIBS " -lpagedattn_cuda_flash")
endif()
string(APPEND PAGEDATTN_PC_LIBS " -lpagedattn_cpu_attn -lpagedattn_reference -lpagedattn_conformance -lpagedattn_parallel")
if(PAGEDATTN_HAVE_CUDA)
  string(APPEND PAGEDATTN_PC_LIBS " -lpagedattn_cuda_runtime")
endif()
string(APPEND PAGEDATTN_PC_LIBS " -lpagedattn_core")
set(PAGEDATTN_PC_LIBS_DEPS "")
if(PAGEDATTN_HAVE_NCCL)
  string(APPEND PAGEDATTN_PC_LIBS_DEPS " ${PAGEDATTN_NCCL_LIBRARY}")
endif()
if(PAGEDATTN_HAVE_CUDA)
  get_target_property(cudart_static CUDA::cudart_static IMPORTED_LOCATION)
  string(APPEND PAGEDATTN_PC_LIBS_DEPS " ${cudart_static} -ldl -lrt")
endif()
# The prefix relative to the .pc file, so that `cmake --install --prefix` anywhere gives a working file.
file(RELATIVE_PATH PAGEDATTN_PC_PREFIX_FROM_PCFILEDIR /prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig /prefix)
string(REGEX REPLACE "/$" "" PAGEDATTN_PC_PREFIX_FROM_PCFILEDIR "${PAGEDATTN_PC_PREFIX_FROM_PCFILEDIR}")
configure_file(${PROJECT_SOURCE_DIR}/cmake/pagedattn.pc.in ${PROJECT_BINARY_DIR}/pagedattn.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/pagedattn.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
