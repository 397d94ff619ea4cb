# How a component joins the build (one concept, one place):
#
#   ebbtide_runtime_sources(<name> SOURCES ...)
#       native code that must live in libebbtide.so (the memory engine, the shim's interposers): an OBJECT
#       library ebbtide_<name>_runtime whose objects go into the runtime library.
#   ebbtide_component(<name> SOURCES ... [CUDA_SOURCES ...])
#       the component's part of the Python extension: an OBJECT library ebbtide_<name> linked into _C; its
#       bindings.cc must define `void ebbtide::<name>::register_bindings(pybind11::module_&)`, called by the
#       module entry with the submodule ebbtide._C.<name>. CUDA_SOURCES are compiled only when nvcc was found
#       (EBBTIDE_WITH_CUDA), with static cudart and no fast-math.
#   ebbtide_cuda_variant(<name> <variant> MIN_ARCH <nn> SOURCES ... [DEFINITIONS ...] BUILT <var>)
#       the same CUDA sources compiled once more as another variant of component <name> (quant: the sm90 variant),
#       for the build's architectures numbered >= nn only, into an OBJECT library ebbtide_<name>_<variant> linked
#       into _C. <var> is set TRUE when it was built, FALSE when the build has no CUDA or no such architecture.
#   ebbtide_package_library(<target>)
#       another shared library (e.g. a test fake) that setup.py must place inside the package.
# Every target gets the repo root on its include path (#include "csrc/ebbtide.h") and EBBTIDE_WITH_CUDA=0/1.

function(_ebbtide_common target)
  target_include_directories(${target} PRIVATE ${PROJECT_SOURCE_DIR} ${PROJECT_BINARY_DIR}/generated)
  if(EBBTIDE_WITH_CUDA)
    target_compile_definitions(${target} PRIVATE EBBTIDE_WITH_CUDA=1)
  else()
    target_compile_definitions(${target} PRIVATE EBBTIDE_WITH_CUDA=0)
  endif()
endfunction()

function(ebbtide_runtime_sources name)
  cmake_parse_arguments(ARG "" "" "SOURCES" ${ARGN})
  add_library(ebbtide_${name}_runtime OBJECT ${ARG_SOURCES})
  _ebbtide_common(ebbtide_${name}_runtime)
  set_property(GLOBAL APPEND PROPERTY EBBTIDE_RUNTIME_OBJECTS $<TARGET_OBJECTS:ebbtide_${name}_runtime>)
endfunction()

function(ebbtide_component name)
  cmake_parse_arguments(ARG "" "" "SOURCES;CUDA_SOURCES" ${ARGN})
  set(srcs ${ARG_SOURCES})
  if(EBBTIDE_WITH_CUDA)
    list(APPEND srcs ${ARG_CUDA_SOURCES})
  endif()
  add_library(ebbtide_${name} OBJECT ${srcs})
  _ebbtide_common(ebbtide_${name})
  target_link_libraries(ebbtide_${name} PRIVATE pybind11::headers Python::Module)
  if(EBBTIDE_WITH_CUDA AND ARG_CUDA_SOURCES)
    _ebbtide_cuda_options(ebbtide_${name})
  endif()
  set_property(GLOBAL APPEND PROPERTY EBBTIDE_PY_COMPONENTS ${name})
  set_property(GLOBAL APPEND PROPERTY EBBTIDE_PY_OBJECTS ebbtide_${name})
endfunction()

function(_ebbtide_cuda_options target)
  set_target_properties(${target} PROPERTIES CUDA_RUNTIME_LIBRARY Static)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -Xptxas=-warn-spills -lineinfo>)
endfunction()

function(ebbtide_cuda_variant name variant)
  cmake_parse_arguments(ARG "" "MIN_ARCH;BUILT" "SOURCES;DEFINITIONS" ${ARGN})
  set(${ARG_BUILT} FALSE PARENT_SCOPE)
  if(NOT EBBTIDE_WITH_CUDA)
    return()
  endif()
  ebbtide_cuda_archs_at_least(archs ${ARG_MIN_ARCH})
  if(NOT archs)
    message(STATUS "ebbtide: the ${variant} variant of ${name} needs an architecture >= ${ARG_MIN_ARCH}; "
                   "this build has none (${CMAKE_CUDA_ARCHITECTURES}): not built")
    return()
  endif()
  set(target ebbtide_${name}_${variant})
  add_library(${target} OBJECT ${ARG_SOURCES})
  _ebbtide_common(${target})
  _ebbtide_cuda_options(${target})
  set_target_properties(${target} PROPERTIES CUDA_ARCHITECTURES "${archs}")
  target_compile_definitions(${target} PRIVATE ${ARG_DEFINITIONS})
  set_property(GLOBAL APPEND PROPERTY EBBTIDE_PY_OBJECTS ${target})
  set(${ARG_BUILT} TRUE PARENT_SCOPE)
endfunction()

function(ebbtide_package_library target)
  set_property(GLOBAL APPEND PROPERTY EBBTIDE_PACKAGE_LIBRARIES ${target})
endfunction()
