// adam_avx512_bf16.cc — AVX-512 kernel with the AVX512_BF16 conversion instruction for the copy-out.
#if defined(__x86_64__)  // other architectures build the portable kernel only
#define EBT_AVX512_BF16 1
#define EBT_AVX512_KERNEL_NAME "avx512_bf16"
#define EBT_AVX512_TABLE_FN kernels_avx512_bf16
#include "optim/adam_avx512_impl.h"
#endif  // __x86_64__
