/*
 * test_prog.h — what the interposition test programs share (shim_prog.c, process_wide_prog.c, tms_abi_prog.c): the
 * fake libcudart they link against, CHECK (a failed check prints it and exits 1) and sym (a function of the
 * process's global scope, where a preloaded libebbtide.so puts its exports).
 */
#ifndef EBBTIDE_TESTS_MEMORY_TEST_PROG_H_
#define EBBTIDE_TESTS_MEMORY_TEST_PROG_H_

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

int cudaMalloc(void** ptr, size_t size);
int cudaFree(void* ptr);
void fake_cudart_counts(long* mallocs, long* frees);

#define CHECK(cond)                                                      \
  do {                                                                   \
    if (!(cond)) {                                                       \
      fprintf(stderr, "check failed at line %d: %s\n", __LINE__, #cond); \
      exit(1);                                                           \
    }                                                                    \
  } while (0)

static inline void* sym(const char* name) {
  void* p = dlsym(RTLD_DEFAULT, name);
  if (!p) {
    fprintf(stderr, "%s not found: is libebbtide.so preloaded?\n", name);
    exit(1);
  }
  return p;
}

#endif /* EBBTIDE_TESTS_MEMORY_TEST_PROG_H_ */
