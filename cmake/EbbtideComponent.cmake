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
    set_target_properties(ebbtide_${name} PROPERTIES CUDA_RUNTIME_LIBRARY Static)
    target_compile_options(ebbtide_${name} PRIVATE
      $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -Xptxas=-warn-spills -lineinfo>)
  endif()
  set_property(GLOBAL APPEND PROPERTY EBBTIDE_PY_COMPONENTS ${name})
  set_property(GLOBAL APPEND PROPERTY EBBTIDE_PY_OBJECTS ebbtide_${name})
endfunction()

function(ebbtide_package_library target)
  set_property(GLOBAL APPEND PROPERTY EBBTIDE_PACKAGE_LIBRARIES ${target})
endfunction()
