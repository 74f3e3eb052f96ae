/* pdchat CPU kernels: a small spinning worker pool (included by cpu_kernels.c, one translation unit). */
#ifndef PDCHAT_CPU_POOL_H
#define PDCHAT_CPU_POOL_H

#include <pthread.h>
#include <stdint.h>

/* OpenMP's workers fall asleep between the ~120 products of a decode step and take tens of
 * microseconds to wake. These workers spin for a while after each job (the next product comes
 * within microseconds), then sleep. The caller works too, claiming chunks of rows from the same
 * counter, so a worker that is not scheduled costs nothing but the chunk it already holds. One
 * job at a time; a concurrent caller runs its rows itself.
 *
 * Protocol: `gen` is even while a job is open. To replace the job the caller makes `gen` odd,
 * waits until no worker is `busy`, writes the job and makes `gen` even again. A worker counts
 * itself `busy` and then re-reads `gen`: if unchanged, the job cannot change under it. */
typedef void (*rows_fn)(const void *args, int lo, int hi);

#define POOL_SPINS 20000        /* ~100-300 us of pause instructions before a worker sleeps */
#define LOAD(x) __atomic_load_n(&(x), __ATOMIC_SEQ_CST)
#define STORE(x, v) __atomic_store_n(&(x), (v), __ATOMIC_SEQ_CST)
#define ADD(x, v) __atomic_fetch_add(&(x), (v), __ATOMIC_SEQ_CST)

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static struct {
    pthread_mutex_t call, sleep_lock;
    pthread_cond_t wake;
    int workers;
    rows_fn fn;
    const void *args;
    int n, chunk;
    long gen;
    int next, done, busy, sleepers;
    int spins;     /* how long an idle worker spins before it sleeps (pd_pool_spin) */
} pool = {.call = PTHREAD_MUTEX_INITIALIZER, .sleep_lock = PTHREAD_MUTEX_INITIALIZER,
          .wake = PTHREAD_COND_INITIALIZER, .spins = POOL_SPINS};

static void run_rows(void) {
    int lo;
    while ((lo = ADD(pool.next, pool.chunk)) < pool.n) {
        int hi = lo + pool.chunk < pool.n ? lo + pool.chunk : pool.n;
        pool.fn(pool.args, lo, hi);
        ADD(pool.done, hi - lo);
    }
}

static int job_waiting(long seen, long *g) {
    *g = LOAD(pool.gen);
    return *g != seen && !(*g & 1);
}

static void *pool_worker(void *unused) {
    (void)unused;
    long seen = 0, g;
    for (;;) {
        for (int spins = 0; !job_waiting(seen, &g); spins++) {
            if (spins < LOAD(pool.spins)) {
                cpu_relax();
                continue;
            }
            pthread_mutex_lock(&pool.sleep_lock);
            ADD(pool.sleepers, 1);
            while (!job_waiting(seen, &g)) pthread_cond_wait(&pool.wake, &pool.sleep_lock);
            ADD(pool.sleepers, -1);
            pthread_mutex_unlock(&pool.sleep_lock);
        }
        ADD(pool.busy, 1);
        if (LOAD(pool.gen) == g) run_rows();
        ADD(pool.busy, -1);
        seen = g;
    }
    return NULL;
}

static void pool_after_fork(void) {   /* the child has none of the workers */
    pthread_mutex_init(&pool.call, NULL);
    pthread_mutex_init(&pool.sleep_lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pool.workers = pool.busy = pool.sleepers = 0;
}

static void pool_start(int workers) {
    pthread_atfork(NULL, NULL, pool_after_fork);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    for (int i = 0; i < workers; i++) {
        pthread_t t;
        if (pthread_create(&t, &attr, pool_worker, NULL) != 0) break;
        pool.workers++;
    }
    pthread_attr_destroy(&attr);
}

/* fn(args, lo, hi) over rows [0, n) in chunks of `chunk`, on up to `threads` threads. */
static void parallel_rows(rows_fn fn, const void *args, int n, int chunk, int threads) {
    if (threads <= 1 || n <= chunk || pthread_mutex_trylock(&pool.call) != 0) {
        fn(args, 0, n);
        return;
    }
    if (pool.workers == 0) pool_start(threads - 1);
    long g = LOAD(pool.gen);
    STORE(pool.gen, g + 1);
    while (LOAD(pool.busy) != 0) cpu_relax();
    pool.fn = fn;
    pool.args = args;
    pool.n = n;
    pool.chunk = chunk;
    STORE(pool.next, 0);
    STORE(pool.done, 0);
    STORE(pool.gen, g + 2);
    if (LOAD(pool.sleepers) > 0) {
        pthread_mutex_lock(&pool.sleep_lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.sleep_lock);
    }
    run_rows();
    while (LOAD(pool.done) < n) cpu_relax();
    pthread_mutex_unlock(&pool.call);
}

/* Rows per claim: a few per thread, a multiple of 4 (the integer kernels' tiles of weight rows). */
static inline int row_chunk(int n, int threads) {
    int c = (n / (4 * threads) + 3) & ~3;
    return c < 16 ? 16 : c;
}

#endif
