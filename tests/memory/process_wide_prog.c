/*
 * process_wide_prog.c — a program with no PyTorch (think: a CuPy trainer) run entirely under the shim in
 * process-wide mode: LD_PRELOAD=libebbtide.so, EBBTIDE_MEM_DEFAULT_TAG=<tag> with CPU backup (or torch_memory_saver's
 * TMS_INIT_ENABLE=1 + TMS_INIT_ENABLE_CPU_BACKUP=1, tag "default"), the fake driver. Every cudaMalloc lands in the
 * tag; the program pauses and resumes itself through ebbtide's C API and checks that its data survived, that an
 * unaligned 6912-byte allocation can be freed while paused, and that nothing reached the real (fake) runtime.
 * Usage: process_wide_prog <tag>. Prints "OK" and exits 0 on success; a failed check prints it and exits 1.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_prog.h"

typedef int (*op_fn)(const char*, void*);
typedef int (*lookup_fn)(const void*, void**, size_t*, char*, int*);
typedef int (*state_fn)(const char*, int*, unsigned long long*);

int main(int argc, char** argv) {
  CHECK(argc == 2);
  const char* tag = argv[1];
  op_fn pause = (op_fn)sym("ebt_mem_pause");
  op_fn resume = (op_fn)sym("ebt_mem_resume");
  lookup_fn lookup = (lookup_fn)sym("ebt_mem_lookup");
  state_fn state = (state_fn)sym("ebt_mem_tag_state");

  enum { N = 3 };
  const size_t sizes[N] = {(size_t)5 << 20, 6912, 4096 + 3};
  unsigned char* bufs[N];
  for (int i = 0; i < N; ++i) {
    CHECK(cudaMalloc((void**)&bufs[i], sizes[i]) == 0);
    void* base;
    size_t size;
    char t[64];
    int paused = 1;
    CHECK(lookup(bufs[i], &base, &size, t, &paused) == 0);  /* an engine allocation, in the default tag */
    CHECK(strcmp(t, tag) == 0 && size == sizes[i] && paused == 0);
    for (size_t k = 0; k < sizes[i]; ++k) bufs[i][k] = (unsigned char)(k * 31 + i);  /* fake device memory is host */
  }
  CHECK(pause(tag, NULL) == 0);
  int st = -1;
  unsigned long long pauses = 0;
  CHECK(state(tag, &st, &pauses) == 0 && st == 1 && pauses == 1);
  CHECK(cudaFree(bufs[1]) == 0);  /* the unaligned 6912-byte allocation, freed while paused */
  CHECK(resume(tag, NULL) == 0);
  for (int i = 0; i < N; ++i) {
    if (i == 1) continue;
    for (size_t k = 0; k < sizes[i]; ++k) CHECK(bufs[i][k] == (unsigned char)(k * 31 + i));
  }
  CHECK(cudaFree(bufs[0]) == 0 && cudaFree(bufs[2]) == 0);
  long m = -1, f = -1;
  fake_cudart_counts(&m, &f);
  CHECK(m == 0 && f == 0);  /* nothing bypassed the engine */
  printf("OK\n");
  return 0;
}
