/* Benchmark (not a test) of one draw of kvq_sampler_sample over a row of logits, per
 * sampler setting, on one thread: what the host pays a sequence and step where the
 * rows come to it (the CPU backend, or a GPU row that cannot be settled there).
 * Usage: bench_sampler [-n VOCAB] [-r ROWS] [--spread S]
 * Rows are VOCAB logits of S times a sum of four uniforms (default 128256, 2.0: a random
 * model's flat rows, where a top-p nucleus holds most of the vocabulary; lower
 * temperatures stand in for a trained model's peaked rows). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvq.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t state = 1;
static double uniform(void) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(state >> 11) * (1.0 / 9007199254740992.0);
}

int main(int argc, char **argv) {
    int n = 128256, rows = 20;
    double spread = 2.0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-n") && i + 1 < argc) n = atoi(argv[++i]);
        else if (!strcmp(argv[i], "-r") && i + 1 < argc) rows = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--spread") && i + 1 < argc) spread = atof(argv[++i]);
        else {
            fprintf(stderr, "usage: bench_sampler [-n VOCAB] [-r ROWS] [--spread S]\n");
            return 1;
        }
    }
    if (n < 2 || rows < 1) {
        fprintf(stderr, "bench_sampler: -n must be at least 2 and -r at least 1\n");
        return 1;
    }
    const struct {
        const char *name;
        float temp, top_p, min_p;
        int top_k;
    } cases[] = {
        {"greedy", 0, 1, 0, 0},
        {"temperature 1", 1, 1, 0, 0},
        {"top-k 40", 0.8f, 1, 0, 40},
        {"top-p 0.9, temperature 1", 1, 0.9f, 0, 0},
        {"top-p 0.9, temperature 0.25", 0.25f, 0.9f, 0, 0},
        {"top-p 0.9, temperature 0.1", 0.1f, 0.9f, 0, 0},
        {"min-p 0.05, temperature 1", 1, 1, 0.05f, 0},
    };
    float *x = malloc(sizeof *x * (size_t)n * (size_t)rows);
    if (!x) return 1;
    for (size_t i = 0; i < (size_t)n * (size_t)rows; i++)
        x[i] = (float)(spread * (uniform() + uniform() + uniform() + uniform() - 2));
    printf("%d rows of %d logits (spread %g), one thread\n", rows, n, spread);
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        struct kvq_sampler_params p;
        kvq_sampler_params_default(&p);
        p.temp = cases[c].temp, p.top_p = cases[c].top_p, p.min_p = cases[c].min_p, p.top_k = cases[c].top_k;
        struct kvq_sampler *s = kvq_sampler_new(&p, n);
        if (!s) return 1;
        long ids = 0; /* the draws, so that two builds can be seen to draw alike */
        const double t0 = now();
        for (int r = 0; r < rows; r++) ids += kvq_sampler_sample(s, x + (size_t)r * n);
        printf("%-30s %8.3f ms a draw (ids sum to %ld)\n", cases[c].name, 1e3 * (now() - t0) / rows, ids);
        kvq_sampler_free(s);
    }
    free(x);
    return 0;
}
