/* A fixed set of worker threads that run one parallel task at a time.
 * Workers spin briefly between tasks (a decode step issues dozens of small tasks
 * per layer, and waking a sleeping thread costs more than the task), then sleep. */
#ifndef KVQ_CORE_THREADPOOL_H
#define KVQ_CORE_THREADPOOL_H

/* Called on every thread with ith in [0, nth); the caller's thread is ith 0. */
typedef void (*kvq_task_fn)(void *arg, int ith, int nth);

struct kvq_pool;

/* n_threads <= 0 means one thread per online CPU. NULL on failure. */
struct kvq_pool *kvq_pool_new(int n_threads);
void kvq_pool_free(struct kvq_pool *p);
int kvq_pool_size(const struct kvq_pool *p);
/* Runs fn on all threads and returns when every call has returned. Not reentrant. */
void kvq_pool_run(struct kvq_pool *p, kvq_task_fn fn, void *arg);

/* Splits [0, n) into nth nearly equal parts; part ith is [*begin, *end). */
static inline void kvq_split(long n, int ith, int nth, long *begin, long *end) {
    long base = n / nth, extra = n % nth;
    *begin = ith * base + (ith < extra ? ith : extra);
    *end = *begin + base + (ith < extra ? 1 : 0);
}

#endif
