/*
 * shim_prog.c — the interposition test program: linked against a fake libcudart, run with
 * LD_PRELOAD=libebbtide.so and EBBTIDE_LIBCUDA=<fake driver>. Checks that cudaMalloc/cudaFree outside a region
 * reach the fake runtime, that inside a region they reach the engine (pausable, content kept), and that a forked
 * child forwards everything. Prints "OK" and exits 0 on success; any failed check prints it and exits 1.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test_prog.h"

typedef int (*push_fn)(const char*, int, int*);
typedef int (*pop_fn)(int);
typedef int (*tag_fn)(const char*, void*);
typedef int (*active_fn)(int*);
typedef int (*lookup_fn)(const void*, void**, size_t*, char*, int*);

int main(void) {
  push_fn push = (push_fn)sym("ebt_mem_region_push");
  pop_fn pop = (pop_fn)sym("ebt_mem_region_pop");
  tag_fn pause = (tag_fn)sym("ebt_mem_pause");
  tag_fn resume = (tag_fn)sym("ebt_mem_resume");
  active_fn shim_active = (active_fn)sym("ebt_mem_shim_active");
  lookup_fn lookup = (lookup_fn)sym("ebt_mem_lookup");
  long m = 0, f = 0;
  int active = 0;
  CHECK(shim_active(&active) == 0 && active == 1);

  void* plain = NULL;
  CHECK(cudaMalloc(&plain, 1000) == 0 && plain);  /* outside a region: forwarded */
  fake_cudart_counts(&m, &f);
  CHECK(m == 1);

  int token = -1;
  CHECK(push("weights", 1, &token) == 0);
  void* p = NULL;
  const size_t n = (size_t)6 << 20;
  CHECK(cudaMalloc(&p, n) == 0 && p);             /* inside: the engine */
  fake_cudart_counts(&m, &f);
  CHECK(m == 1);
  void* base = NULL;
  size_t size = 0;
  char tag[64];
  int paused = -1;
  CHECK(lookup(p, &base, &size, tag, &paused) == 0 && base == p && size == n && strcmp(tag, "weights") == 0 && !paused);
  memset(p, 0x5a, n);
  CHECK(pause("weights", NULL) == 0);
  CHECK(lookup(p, &base, &size, tag, &paused) == 0 && paused == 1);
  CHECK(resume("weights", NULL) == 0);
  for (size_t i = 0; i < n; i += 4099) CHECK(((unsigned char*)p)[i] == 0x5a);
  CHECK(pop(token) == 0);

  pid_t pid = fork();
  if (pid == 0) {  /* a forked child forwards even inside a region, and never touches the engine */
    void* q = NULL;
    long cm = 0, cf = 0;
    if (cudaMalloc(&q, 64) != 0) _exit(2);
    fake_cudart_counts(&cm, &cf);
    _exit(cm == 2 ? 0 : 3);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);

  CHECK(cudaFree(p) == 0);                        /* engine pointer: freed by the engine */
  CHECK(cudaFree(plain) == 0);                    /* forwarded */
  fake_cudart_counts(&m, &f);
  CHECK(m == 1 && f == 1);
  printf("OK\n");
  return 0;
}
