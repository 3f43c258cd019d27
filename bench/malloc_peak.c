/* The allocated-bytes high-water mark of a CPU process: what torch.cuda.max_memory_allocated
 * is for a GPU. Loaded with LD_PRELOAD by the memory benches (bench/procmem.py), it wraps
 * glibc's allocation functions and keeps the bytes held now and the most held since the last
 * reset, over every thread (tensors, Gloo's buffers, Python objects), in malloc_usable_size
 * units. It does not see memory mapped without malloc (shared-memory segments) and, unlike
 * the resident high-water mark (VmHWM), not the heap's free holes either: what a layout
 * holds, apart from how glibc lays it out.
 *
 * glibc exports its own implementations as __libc_malloc and friends, so no dlsym is needed
 * (dlsym itself allocates). */
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <stdatomic.h>
#include <stddef.h>

extern void *__libc_malloc(size_t);
extern void __libc_free(void *);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);

static _Atomic long held;
static _Atomic long peak;

static void count(long bytes) {
  long now = atomic_fetch_add(&held, bytes) + bytes;
  long high = atomic_load(&peak);
  while (now > high && !atomic_compare_exchange_weak(&peak, &high, now)) {
  }
}

static void *counted(void *p) {
  if (p) count((long)malloc_usable_size(p));
  return p;
}

void *malloc(size_t n) { return counted(__libc_malloc(n)); }
void *calloc(size_t n, size_t size) { return counted(__libc_calloc(n, size)); }
void *memalign(size_t alignment, size_t n) { return counted(__libc_memalign(alignment, n)); }
void *aligned_alloc(size_t alignment, size_t n) { return memalign(alignment, n); }
void *valloc(size_t n) { return memalign(4096, n); }

void free(void *p) {
  if (!p) return;
  count(-(long)malloc_usable_size(p));
  __libc_free(p);
}

void *realloc(void *p, size_t n) {
  long before = p ? (long)malloc_usable_size(p) : 0;
  void *q = __libc_realloc(p, n);
  if (q || n == 0) {  /* moved, grown or freed; on failure p is untouched */
    count(-before);
    if (q) count((long)malloc_usable_size(q));
  }
  return q;
}

int posix_memalign(void **out, size_t alignment, size_t n) {
  if (alignment % sizeof(void *) != 0 || (alignment & (alignment - 1)) != 0) return EINVAL;
  void *p = memalign(alignment, n);
  if (!p) return ENOMEM;
  *out = p;
  return 0;
}

/* The interface the benches call through ctypes. */
long malloc_peak_held(void) { return atomic_load(&held); }
long malloc_peak_bytes(void) { return atomic_load(&peak); }
void malloc_peak_reset(void) { atomic_store(&peak, atomic_load(&held)); }
