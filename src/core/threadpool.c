#include "core/threadpool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

/* Spins before a worker sleeps: long enough to span the gap between the tasks of
 * one decode step, short enough not to burn a core while the engine is idle. */
#define SPIN_ROUNDS 200000

struct worker {
    struct kvq_threads *pool;
    int ith;
    pthread_t thread;
};

struct kvq_threads {
    int n;
    struct worker *workers; /* n - 1 of them: thread 0 is the caller */
    kvq_task_fn fn;
    void *arg;
    atomic_uint generation; /* bumped for each task */
    atomic_int n_done;
    atomic_int n_sleeping;
    atomic_bool stop;
    pthread_mutex_t mutex;
    pthread_cond_t wake;
};

static void *worker_main(void *p) {
    struct worker *w = p;
    struct kvq_threads *pool = w->pool;
    unsigned seen = 0;
    for (;;) {
        unsigned gen;
        int spins = 0;
        while ((gen = atomic_load_explicit(&pool->generation, memory_order_acquire)) == seen &&
               !atomic_load_explicit(&pool->stop, memory_order_acquire)) {
            if (++spins < SPIN_ROUNDS) {
                /* Yield now and then: with more threads than free cores, a spinning
                 * thread would otherwise hold the core the others need. */
                if (spins % 1024 == 0) sched_yield();
                else cpu_relax();
                continue;
            }
            pthread_mutex_lock(&pool->mutex);
            atomic_fetch_add(&pool->n_sleeping, 1);
            while (atomic_load(&pool->generation) == seen && !atomic_load(&pool->stop))
                pthread_cond_wait(&pool->wake, &pool->mutex);
            atomic_fetch_sub(&pool->n_sleeping, 1);
            pthread_mutex_unlock(&pool->mutex);
            spins = 0;
        }
        if (atomic_load_explicit(&pool->stop, memory_order_acquire)) return NULL;
        seen = gen;
        pool->fn(pool->arg, w->ith, pool->n);
        atomic_fetch_add_explicit(&pool->n_done, 1, memory_order_release);
    }
}

int kvq_online_cpus(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

struct kvq_threads *kvq_threads_new(int n_threads) {
    struct kvq_threads *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->n = n_threads > 0 ? n_threads : kvq_online_cpus();
    pthread_mutex_init(&p->mutex, NULL);
    pthread_cond_init(&p->wake, NULL);
    p->workers = calloc((size_t)p->n, sizeof *p->workers);
    if (!p->workers) {
        free(p);
        return NULL;
    }
    for (int i = 1; i < p->n; i++) {
        p->workers[i].pool = p;
        p->workers[i].ith = i;
        if (pthread_create(&p->workers[i].thread, NULL, worker_main, &p->workers[i]) != 0) {
            p->n = i; /* run with the threads we got */
            break;
        }
    }
    return p;
}

void kvq_threads_free(struct kvq_threads *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mutex);
    atomic_store(&p->stop, true);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mutex);
    for (int i = 1; i < p->n; i++) pthread_join(p->workers[i].thread, NULL);
    pthread_mutex_destroy(&p->mutex);
    pthread_cond_destroy(&p->wake);
    free(p->workers);
    free(p);
}

int kvq_threads_size(const struct kvq_threads *p) { return p->n; }

void kvq_threads_run(struct kvq_threads *p, kvq_task_fn fn, void *arg) {
    if (p->n == 1) {
        fn(arg, 0, 1);
        return;
    }
    p->fn = fn;
    p->arg = arg;
    atomic_store_explicit(&p->n_done, 0, memory_order_relaxed);
    atomic_fetch_add(&p->generation, 1); /* seq_cst: pairs with n_sleeping below */
    if (atomic_load(&p->n_sleeping) > 0) {
        pthread_mutex_lock(&p->mutex);
        pthread_cond_broadcast(&p->wake);
        pthread_mutex_unlock(&p->mutex);
    }
    fn(arg, 0, p->n);
    for (unsigned spins = 1; atomic_load_explicit(&p->n_done, memory_order_acquire) < p->n - 1; spins++) {
        if (spins % 1024 == 0) sched_yield();
        else cpu_relax();
    }
}

/* ---- shared work items ---- */

struct kvq_work_part {
    _Alignas(64) atomic_int next; /* a line per part: its owner claims without contention */
    int count;
};

struct kvq_work {
    int nth;
    struct kvq_work_part *parts;
    int *counts;
};

struct kvq_work *kvq_work_new(int nth) {
    struct kvq_work *w = calloc(1, sizeof *w);
    if (!w) return NULL;
    w->nth = nth > 0 ? nth : 1;
    w->parts = aligned_alloc(64, sizeof *w->parts * (size_t)w->nth);
    w->counts = calloc((size_t)w->nth, sizeof *w->counts);
    if (!w->parts || !w->counts) {
        kvq_work_free(w);
        return NULL;
    }
    for (int i = 0; i < w->nth; i++) {
        atomic_init(&w->parts[i].next, 0);
        w->parts[i].count = 0;
    }
    return w;
}

void kvq_work_free(struct kvq_work *w) {
    if (!w) return;
    free(w->parts);
    free(w->counts);
    free(w);
}

int *kvq_work_counts(struct kvq_work *w) { return w->counts; }

void kvq_work_start(struct kvq_work *w) {
    for (int i = 0; i < w->nth; i++) {
        w->parts[i].count = w->counts[i];
        w->counts[i] = 0;
        atomic_store_explicit(&w->parts[i].next, 0, memory_order_relaxed);
    }
}

int kvq_work_next(struct kvq_work *w, int ith, int *part) {
    for (int k = 0; k < w->nth; k++) {
        const int p = (ith + k) % w->nth;
        struct kvq_work_part *wp = &w->parts[p];
        if (atomic_load_explicit(&wp->next, memory_order_relaxed) >= wp->count) continue;
        const int s = atomic_fetch_add_explicit(&wp->next, 1, memory_order_relaxed);
        if (s < wp->count) {
            *part = p;
            return s;
        }
    }
    return -1;
}
