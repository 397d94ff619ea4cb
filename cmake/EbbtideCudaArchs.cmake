# The CUDA architectures of the build (one concept, one place):
#
#   EBBTIDE_DEFAULT_CUDA_ARCHS
#       what a build without EBBTIDE_CUDA_ARCHS / CMAKE_CUDA_ARCHITECTURES compiles: SASS for A100 (sm_80), A10 /
#       RTX 30xx / A40 (sm_86), L4 / L20 / L40 / RTX 40xx (sm_89) and H100 / H200 / H20 (sm_90), plus compute_90 PTX
#       that newer GPUs (Blackwell: sm_100, sm_120, ...) compile at load. compute_90 rather than compute_80 PTX:
#       PTX keeps the instructions of its architecture, so the newer GPUs run the sm90 variant's hardware FP8
#       conversion from it; compute_80 PTX would give them only the portable variant.
#   ebbtide_resolve_cuda_archs()       (after enable_language(CUDA))
#       checks CMAKE_CUDA_ARCHITECTURES (each entry NN, NN-real or NN-virtual, NN with an optional a/f suffix, NN >=
#       80; `native` is replaced by the GPUs CMake found) and sets EBBTIDE_CUDA_ARCHS_TEXT, the list in words.
#   ebbtide_cuda_archs_at_least(<out> <min>)
#       the entries whose architecture number is >= min (a variant that needs newer instructions builds for those).

set(EBBTIDE_DEFAULT_CUDA_ARCHS "80-real;86-real;89-real;90-real;90-virtual")
set(EBBTIDE_MIN_CUDA_ARCH 80)  # cvt.rn.bf16.f32, __reduce_max_sync: Ampere and later

macro(ebbtide_resolve_cuda_archs)
  if(CMAKE_CUDA_ARCHITECTURES STREQUAL "native")
    if(NOT CMAKE_CUDA_ARCHITECTURES_NATIVE)
      message(FATAL_ERROR "ebbtide: EBBTIDE_CUDA_ARCHS=native found no GPU on this machine: list the architectures "
                          "instead (the default is ${EBBTIDE_DEFAULT_CUDA_ARCHS})")
    endif()
    set(CMAKE_CUDA_ARCHITECTURES "${CMAKE_CUDA_ARCHITECTURES_NATIVE}")
  endif()
  set(_ebt_sass "")
  set(_ebt_ptx "")
  foreach(_ebt_arch IN LISTS CMAKE_CUDA_ARCHITECTURES)
    if(NOT _ebt_arch MATCHES "^([0-9]+)([af]?)(-real|-virtual)?$")
      message(FATAL_ERROR "ebbtide: CUDA architecture '${_ebt_arch}' (in '${CMAKE_CUDA_ARCHITECTURES}') is not "
                          "understood: use entries like 90, 90-real, 90-virtual (EBBTIDE_CUDA_ARCHS, default "
                          "${EBBTIDE_DEFAULT_CUDA_ARCHS}); all / all-major would include GPUs older than sm_80")
    endif()
    if(CMAKE_MATCH_1 LESS EBBTIDE_MIN_CUDA_ARCH)
      message(FATAL_ERROR "ebbtide: CUDA architecture '${_ebt_arch}' is older than sm_${EBBTIDE_MIN_CUDA_ARCH}, which "
                          "the kernels need (bf16 conversions): drop it from EBBTIDE_CUDA_ARCHS")
    endif()
    if(NOT CMAKE_MATCH_3 STREQUAL "-virtual")
      list(APPEND _ebt_sass "sm_${CMAKE_MATCH_1}${CMAKE_MATCH_2}")
    endif()
    if(NOT CMAKE_MATCH_3 STREQUAL "-real")
      list(APPEND _ebt_ptx "compute_${CMAKE_MATCH_1}${CMAKE_MATCH_2}")
    endif()
  endforeach()
  list(JOIN _ebt_sass " " _ebt_sass)
  list(JOIN _ebt_ptx " " _ebt_ptx)
  if(_ebt_sass AND _ebt_ptx)
    set(EBBTIDE_CUDA_ARCHS_TEXT "${_ebt_sass}, PTX ${_ebt_ptx} for newer GPUs")
  elseif(_ebt_sass)
    set(EBBTIDE_CUDA_ARCHS_TEXT "${_ebt_sass} only (no PTX: newer GPUs get no code)")
  else()
    set(EBBTIDE_CUDA_ARCHS_TEXT "PTX ${_ebt_ptx} only (compiled by the driver at first use)")
  endif()
endmacro()

function(ebbtide_cuda_archs_at_least out min)
  set(kept "")
  foreach(arch IN LISTS CMAKE_CUDA_ARCHITECTURES)
    string(REGEX MATCH "^[0-9]+" number "${arch}")
    if(number GREATER_EQUAL min)
      list(APPEND kept "${arch}")
    endif()
  endforeach()
  set(${out} "${kept}" PARENT_SCOPE)
endfunction()
