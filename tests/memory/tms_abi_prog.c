/*
 * tms_abi_prog.c — torch_memory_saver's C functions as its own suite calls them (test/examples/cuda_vmm_granularity.py
 * reaches tms_pause / tms_resume through ctypes.CDLL(None), i.e. the process's global scope): linked against the
 * fake libcudart, run with LD_PRELOAD=libebbtide.so, the fake driver and TMS_INIT_ENABLE=1. Raw unaligned sizes
 * (6,912 bytes), content through pause/resume (with TMS_INIT_ENABLE_CPU_BACKUP=1: argv[1] == "cpu"), free while
 * paused, the per-thread configuration getters and setters. Prints "OK" and exits 0 on success.
 */
#include <dlfcn.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "test_prog.h"

int main(int argc, char** argv) {
  const bool cpu = argc > 1 && strcmp(argv[1], "cpu") == 0;
  int (*tms_pause)(const char*) = (int (*)(const char*))sym("tms_pause");
  int (*tms_resume)(const char*) = (int (*)(const char*))sym("tms_resume");
  bool (*get_interesting)(void) = (bool (*)(void))sym("tms_get_interesting_region");
  void (*set_interesting)(bool) = (void (*)(bool))sym("tms_set_interesting_region");
  const char* (*get_tag)(void) = (const char* (*)(void))sym("tms_get_current_tag");
  void (*set_tag)(const char*) = (void (*)(const char*))sym("tms_set_current_tag");
  bool (*get_cpu)(void) = (bool (*)(void))sym("tms_get_enable_cpu_backup");
  const char* (*get_backend)(void) = (const char* (*)(void))sym("tms_get_cpu_backup_backend");
  uint8_t* (*backup_ptr)(const uint8_t*, uint64_t) = (uint8_t * (*)(const uint8_t*, uint64_t)) sym("tms_get_cpu_backup_pointer");
  long m = 0, f = 0;

  /* TMS_INIT_ENABLE=1: this thread's allocations are captured, tag "default", the pinned backend. */
  CHECK(get_interesting());
  CHECK(strcmp(get_tag(), "default") == 0);
  CHECK(get_cpu() == cpu);
  CHECK(strcmp(get_backend(), "pinned") == 0);

  const size_t n = 6912; /* not a multiple of the 2 MiB granularity */
  unsigned char* p = NULL;
  CHECK(cudaMalloc((void**)&p, n) == 0 && p);
  fake_cudart_counts(&m, &f);
  CHECK(m == 0); /* the engine took it */
  memset(p, 0xA5, n);
  CHECK(tms_pause(NULL) == 0);
  if (cpu) {
    uint8_t* h = backup_ptr(p, n);
    CHECK(h && h[0] == 0xA5 && h[n - 1] == 0xA5);
    CHECK(backup_ptr(p, n + 1) == NULL); /* past the allocation's end */
  }
  CHECK(tms_resume(NULL) == 0);
  if (cpu) {
    for (size_t i = 0; i < n; ++i) CHECK(p[i] == 0xA5);
    CHECK(backup_ptr(p, n) == NULL); /* no retention: the host copy went at the resume */
  }
  memset(p, 0x5A, n); /* writable after resume */
  CHECK(cudaFree(p) == 0);

  unsigned char *gone = NULL, *keep = NULL;
  CHECK(cudaMalloc((void**)&gone, n) == 0 && cudaMalloc((void**)&keep, n) == 0);
  memset(keep, 0x11, n);
  CHECK(tms_pause(NULL) == 0);
  CHECK(cudaFree(gone) == 0); /* freed while paused */
  CHECK(tms_resume(NULL) == 0);
  memset(keep, 0x22, n);
  CHECK(tms_pause("never-named") == 0 && tms_resume("never-named") == 0); /* nothing to do */

  /* Per-thread configuration: off, then on again with another tag. */
  set_interesting(false);
  CHECK(!get_interesting());
  unsigned char* plain = NULL;
  CHECK(cudaMalloc((void**)&plain, 1000) == 0);
  fake_cudart_counts(&m, &f);
  CHECK(m == 1); /* forwarded */
  set_interesting(true);
  set_tag("kv");
  CHECK(get_interesting() && strcmp(get_tag(), "kv") == 0);
  unsigned char* kv = NULL;
  CHECK(cudaMalloc((void**)&kv, n) == 0);
  CHECK(tms_pause("kv") == 0);
  memset(keep, 0x33, n); /* the other tag stays mapped */
  CHECK(tms_resume("kv") == 0);
  CHECK(cudaFree(kv) == 0 && cudaFree(keep) == 0 && cudaFree(plain) == 0);
  printf("OK\n");
  return 0;
}
