/*
 * fake_cudart.c — a stand-in libcudart for the interposition test (test-only): cudaMalloc/cudaFree over
 * malloc/free, with counters, so a test program linked against it shows which calls the LD_PRELOAD shim kept and
 * which it forwarded here.
 */
#include <stdlib.h>

static long g_mallocs, g_frees;

__attribute__((visibility("default"))) int cudaMalloc(void** ptr, size_t size) {
  if (!ptr) return 1;
  *ptr = malloc(size ? size : 1);
  if (!*ptr) return 2;
  ++g_mallocs;
  return 0;
}

__attribute__((visibility("default"))) int cudaFree(void* ptr) {
  if (ptr) {
    free(ptr);
    ++g_frees;
  }
  return 0;
}

/* Calls that reached this library (i.e. were forwarded by the shim). */
__attribute__((visibility("default"))) void fake_cudart_counts(long* mallocs, long* frees) {
  *mallocs = g_mallocs;
  *frees = g_frees;
}
