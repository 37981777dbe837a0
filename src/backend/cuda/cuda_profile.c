/* The CUDA backend's profiles (cuda_tuning: KVQ_CUDA_PROFILE): time per operation, and
 * how recorded steps' wall time splits between the host and the GPU. */
#include "backend/cuda/cuda_private.h"

static const char *const prof_names[P_N] = {"matvec", "wide products (packed)", "gemm (dequantize + f16/TF32)", "norms", "glu", "embed",
                                            "kv_append: plan, RoPE + device encode",
                                            "sync: host copy of new KV rows",
                                            "attention: host plan + uploads", "attention: kernels",
                                            "issuing recorded work (graphs)"};

double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

double prof_begin(struct cuda_backend *cb) {
    if (cb->tune.prof) cudaStreamSynchronize(cb->stream);
    return cb->tune.prof || cb->steps ? now_s() : 0;
}

void prof_end(struct cuda_backend *cb, enum prof_op op, double t0) {
    if (!cb->tune.prof && !cb->steps) return;
    if (cb->tune.prof) cudaStreamSynchronize(cb->stream);
    cb->prof_s[op] += now_s() - t0;
    cb->prof_n[op]++;
}


/* KVQ_CUDA_PROFILE=steps: where the time of steps goes (recorded ones, and those
 * launched as queued), as medians over the steps of each size: the wall time from one
 * wait's end to the next; the GPU's, from the first issued segment (or launch) to the
 * end of the step's work; the host's from the last wait's end to the step's first
 * operation (the engine's work and its caller's), then to that first issue, then to
 * the last (the wait's start); the results' copy; the host's work after the wait. The
 * GPU idles for the difference of the first two. Events time the GPU, so nothing
 * waits that would not. */
enum step_stat { S_WALL, S_GPU, S_HOST_PRE, S_HOST_FIRST, S_HOST_ISSUED, S_RESULTS, S_HOST_AFTER, S_N };

#define STEP_SAMPLES 8192

struct step_prof {
    cudaEvent_t first, end, results;
    bool armed;            /* this step's first segment was issued: its events are set */
    double begin, waited;  /* host times: the step's first operation, the last wait's end */
    int n_tokens;          /* this step's */
    float v[STEP_SAMPLES][S_N];
    int tokens[STEP_SAMPLES];
    long n;
};


void steps_free(struct step_prof *sp) {
    if (!sp) return;
    cudaEvent_t *ev[] = {&sp->first, &sp->end, &sp->results};
    for (int i = 0; i < 3; i++)
        if (*ev[i]) cudaEventDestroy(*ev[i]);
    free(sp);
}


/* NULL when memory or an event is short (the profile is then off). */
struct step_prof *steps_new(void) {
    struct step_prof *sp = calloc(1, sizeof *sp);
    if (sp && (cudaEventCreate(&sp->first) != cudaSuccess || cudaEventCreate(&sp->end) != cudaSuccess ||
               cudaEventCreate(&sp->results) != cudaSuccess)) {
        steps_free(sp);
        return NULL;
    }
    return sp;
}


static float elapsed_us(cudaEvent_t a, cudaEvent_t b) {
    float ms = 0;
    return cudaEventElapsedTime(&ms, a, b) == cudaSuccess ? 1e3f * ms : 0;
}


/* A step begins (its host time counts from here). */
void steps_begin(struct step_prof *sp, int n_tokens) {
    if (!sp) return;
    sp->begin = now_s();
    sp->n_tokens = n_tokens;
}

/* At a recorded step's first segment, or a step's first launch. */
void steps_first_issue(struct step_prof *sp, cudaStream_t s) {
    if (!sp || sp->armed) return;
    cudaEventRecord(sp->first, s);
    sp->armed = true;
    if (sp->n < STEP_SAMPLES) {
        sp->v[sp->n][S_HOST_PRE] = sp->waited > 0 ? (float)(1e6 * (sp->begin - sp->waited)) : 0;
        sp->v[sp->n][S_HOST_FIRST] = (float)(1e6 * (now_s() - sp->begin));
    }
}


/* At sync: after the step's work (results: false: the host has issued it all), then
 * after the results' copies. */
void steps_mark(struct step_prof *sp, cudaStream_t s, bool results) {
    if (!sp || !sp->armed) return;
    cudaEventRecord(results ? sp->results : sp->end, s);
    if (!results && sp->n < STEP_SAMPLES) sp->v[sp->n][S_HOST_ISSUED] = (float)(1e6 * (now_s() - sp->begin));
}


/* When the wait at sync ends. */
void steps_waited(struct step_prof *sp) {
    if (!sp) return;
    const double t = now_s();
    if (sp->armed && sp->n < STEP_SAMPLES && sp->waited > 0) {
        float *v = sp->v[sp->n];
        v[S_WALL] = (float)(1e6 * (t - sp->waited));
        v[S_GPU] = elapsed_us(sp->first, sp->end);
        v[S_RESULTS] = elapsed_us(sp->end, sp->results);
    } else {
        sp->armed = false; /* no sample of this step */
    }
    sp->waited = t;
}


/* When sync returns (failed: the step's numbers are dropped). */
void steps_done(struct step_prof *sp, bool failed) {
    if (!sp) return;
    if (!failed && sp->armed) {
        sp->v[sp->n][S_HOST_AFTER] = (float)(1e6 * (now_s() - sp->waited));
        sp->tokens[sp->n++] = sp->n_tokens;
    }
    sp->armed = false;
}


static int cmp_float(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}


/* The steps of n_tokens tokens: medians, and what the slow ones add. */
static void steps_print_kind(const struct step_prof *sp, int n_tokens, float *col) {
    static const char *const names[S_N] = {"wall", "GPU", "host before the step's first operation",
                                           "host before the first issue", "host until all is issued",
                                           "results' copy", "host after the wait"};
    long n = 0;
    for (long i = 0; i < sp->n; i++) n += sp->tokens[i] == n_tokens;
    fprintf(stderr, "kvq cuda steps of %d tokens, medians of %ld (us):", n_tokens, n);
    float med[S_N];
    for (int k = 0; k < S_N; k++) {
        long m = 0;
        for (long i = 0; i < sp->n; i++)
            if (sp->tokens[i] == n_tokens) col[m++] = sp->v[i][k];
        qsort(col, (size_t)m, sizeof(float), cmp_float);
        med[k] = col[m / 2];
        fprintf(stderr, "%s %s %.1f", k ? "," : "", names[k], med[k]);
    }
    /* the mean wall time is what a run's tokens/s sees: slow steps (a context's first,
     * which record its graphs; those that make a new kind of step) lift it. The part of
     * their excess within the GPU's span is not the host's before the first issue or
     * after the wait (the span includes the GPU's waits for later segments, though) */
    const double median = med[S_WALL];
    double sum = 0, excess = 0, gpu_excess = 0;
    int slow = 0;
    for (long i = 0; i < sp->n; i++) {
        const double w = sp->v[i][S_WALL];
        if (sp->tokens[i] != n_tokens) continue;
        sum += w;
        if (w > 1.2 * median) slow++, excess += w - median, gpu_excess += sp->v[i][S_GPU] - med[S_GPU];
    }
    fprintf(stderr,
            "; mean wall %.1f; %d steps over 1.2x the median, %.0f us beyond it, %.0f of them in the GPU's span "
            "(steps",
            sum / (double)n, slow, excess, gpu_excess);
    for (long i = 0, k = 0; i < sp->n && k < 8; i++)
        if (sp->tokens[i] == n_tokens && sp->v[i][S_WALL] > 1.2 * median) fprintf(stderr, " %ld", i), k++;
    fprintf(stderr, ")\n");
}


/* The three most frequent kinds of step (by their tokens; of the first KINDS seen). */
#define KINDS 32

static void steps_print(const struct step_prof *sp) {
    int kind[KINDS];
    long count[KINDS] = {0};
    int n_kind = 0;
    for (long i = 0; i < sp->n; i++) {
        int k = 0;
        while (k < n_kind && kind[k] != sp->tokens[i]) k++;
        if (k == n_kind && n_kind < KINDS) kind[n_kind++] = sp->tokens[i];
        if (k < n_kind) count[k]++;
    }
    float *col = sp->n > 0 ? malloc(sizeof(float) * (size_t)sp->n) : NULL;
    for (int g = 0; g < 3 && col; g++) {
        int best = -1;
        for (int k = 0; k < n_kind; k++)
            if (count[k] > 0 && (best < 0 || count[k] > count[best])) best = k;
        if (best < 0) break;
        steps_print_kind(sp, kind[best], col);
        count[best] = 0;
    }
    free(col);
}


/* The profiles asked for (tune.prof, steps), on stderr. */
void prof_print(const struct cuda_backend *cb) {
    if (cb->tune.prof || cb->steps) {
        double total = 0;
        for (int i = 0; i < P_N; i++) total += cb->prof_s[i];
        fprintf(stderr, "kvq cuda profile (%.3f s %s):\n", total,
                cb->tune.prof ? "in operations" : "of host time in operations");
        for (int i = 0; i < P_N; i++)
            if (cb->prof_n[i])
                fprintf(stderr, "  %-40s %9.3f ms %5.1f%% %8ld calls %8.1f us/call\n", prof_names[i], 1e3 * cb->prof_s[i],
                        100 * cb->prof_s[i] / total, cb->prof_n[i], 1e6 * cb->prof_s[i] / (double)cb->prof_n[i]);
    }
    if (cb->steps) {
        fprintf(stderr, "kvq cuda: recorded steps: %ld as graphs, %ld captured, %ld launch by launch\n", cb->q.n_replays,
                cb->q.n_captures, cb->q.n_eager);
        steps_print(cb->steps);
    }
}
