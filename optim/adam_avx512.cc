// adam_avx512.cc — AVX-512 F/BW/VL/DQ kernel (integer RNE copy-out). Flags in optim/CMakeLists.txt.
#if defined(__x86_64__)  // other architectures build the portable kernel only
#define EBT_AVX512_BF16 0
#define EBT_AVX512_KERNEL_NAME "avx512"
#define EBT_AVX512_TABLE_FN kernels_avx512
#include "optim/adam_avx512_impl.h"
#endif  // __x86_64__
