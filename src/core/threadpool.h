/* A fixed set of worker threads that run one parallel task at a time.
 * Workers spin briefly between tasks (a decode step issues dozens of small tasks
 * per layer, and waking a sleeping thread costs more than the task), then sleep. */
#ifndef KVQ_CORE_THREADPOOL_H
#define KVQ_CORE_THREADPOOL_H

/* Called on every thread with ith in [0, nth); the caller's thread is ith 0. */
typedef void (*kvq_task_fn)(void *arg, int ith, int nth);

struct kvq_threads;

/* The CPUs online now (at least 1). */
int kvq_online_cpus(void);
/* n_threads <= 0 means one thread per online CPU. NULL on failure. */
struct kvq_threads *kvq_threads_new(int n_threads);
void kvq_threads_free(struct kvq_threads *p);
int kvq_threads_size(const struct kvq_threads *p);
/* Runs fn on all threads and returns when every call has returned. Not reentrant. */
void kvq_threads_run(struct kvq_threads *p, kvq_task_fn fn, void *arg);

/* Work items of one task shared by nth threads: thread i first takes the slots of
 * its own part i in order (no contention), then helps with what is left of the other
 * parts, so a thread that is slower or descheduled for a while does not hold the
 * others at the end of the task. The caller maps (part, slot) to its items. */
struct kvq_work;
/* For tasks of up to nth threads. NULL when out of memory. */
struct kvq_work *kvq_work_new(int nth);
void kvq_work_free(struct kvq_work *w);
/* nth counts, all 0 after kvq_work_new and each kvq_work_start: the caller sets
 * counts[i] to the slots of part i, then calls kvq_work_start before kvq_threads_run. */
int *kvq_work_counts(struct kvq_work *w);
void kvq_work_start(struct kvq_work *w);
/* The next slot for thread ith (its part is *part); -1 when no slot is left. */
int kvq_work_next(struct kvq_work *w, int ith, int *part);

/* Splits [0, n) into nth nearly equal parts; part ith is [*begin, *end). */
static inline void kvq_split(long n, int ith, int nth, long *begin, long *end) {
    long base = n / nth, extra = n % nth;
    *begin = ith * base + (ith < extra ? ith : extra);
    *end = *begin + base + (ith < extra ? 1 : 0);
}

#endif
