// FLASH_CPU_CHECK: the kernel's invariants (tile ranges, buffer offsets), checked in the
// sanitizer build (build.py defines FLASH_CPU_CHECKS there): a broken one aborts with its file
// and line instead of reading on; elsewhere it compiles to nothing.
#ifndef JAX_FLASH_CPU_CHECK_H_
#define JAX_FLASH_CPU_CHECK_H_

#include <cstdio>
#include <cstdlib>

#ifdef FLASH_CPU_CHECKS
#define FLASH_CPU_CHECK(cond)                                                            \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);     \
      std::abort();                                                                      \
    }                                                                                    \
  } while (0)
#else
#define FLASH_CPU_CHECK(cond) \
  do {                        \
  } while (0)
#endif

#endif  // JAX_FLASH_CPU_CHECK_H_
