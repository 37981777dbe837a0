/* The serving scheduler's decisions, without threads, engine or model: KV estimates
 * and reserves, refusals at submit, admission by memory (start, evict a held prefix,
 * wait), the composition of a step (decode tokens first, then whole prefill chunks
 * within the step's room) and who gives way when memory runs out. Expected values
 * follow from the rules in sched_policy.h, worked out by hand. */
#include <string.h>

#include "check.h"
#include "server/sched_policy.h"

#define MAX_SEQS 4

static struct sched_policy policy(size_t budget) {
    struct sched_policy p;
    /* 4 sequences, chunks of 4, steps of 8 tokens, context 1024; 1000 bytes a token,
     * 500 of window; f16 rows of 10 bytes a token: margin 10 x (8 + 4) = 120 */
    sched_policy_init(&p, MAX_SEQS, 4, 8, 1024, budget, 1000, 500, 10);
    return p;
}

static void test_bytes_and_reserves(void) {
    struct sched_policy p = policy(1 << 30);
    CHECK(p.margin == 120, "margin %zu", p.margin);
    struct sched_policy q;
    sched_policy_init(&q, MAX_SEQS, 4, 8, 1024, 1 << 30, 1000, 500, 0);
    CHECK(q.margin == 0, "float cache: margin %zu", q.margin);
    CHECK(sched_policy_bytes(&p, 0) == 500, "0 tokens: %zu", sched_policy_bytes(&p, 0));
    CHECK(sched_policy_bytes(&p, 1) == 64500, "1 token: whole block of 64: %zu", sched_policy_bytes(&p, 1));
    CHECK(sched_policy_bytes(&p, 64) == 64500, "64 tokens: %zu", sched_policy_bytes(&p, 64));
    CHECK(sched_policy_bytes(&p, 65) == 128500, "65 tokens: %zu", sched_policy_bytes(&p, 65));
    /* 100 prompt + 50 answer = 150 tokens: 3 blocks */
    CHECK(sched_policy_reserve(&p, 100, 50, false) == 192500, "reserve %zu", sched_policy_reserve(&p, 100, 50, false));
    /* until the context ends: 1024 tokens, 16 blocks; an answer past the context too */
    CHECK(sched_policy_reserve(&p, 100, -1, false) == 1024500, "to the context: %zu",
          sched_policy_reserve(&p, 100, -1, false));
    CHECK(sched_policy_reserve(&p, 1000, 500, false) == 1024500, "past the context: %zu",
          sched_policy_reserve(&p, 1000, 500, false));
    /* a follower: its 50 tokens and the partly filled block it copies, 114 tokens */
    CHECK(sched_policy_reserve(&p, 100, 50, true) == 128500, "follower %zu", sched_policy_reserve(&p, 100, 50, true));
    /* never more than the budget less the margin */
    struct sched_policy small = policy(100000);
    CHECK(sched_policy_reserve(&small, 100, 50, false) == 100000 - 120, "clamped %zu",
          sched_policy_reserve(&small, 100, 50, false));
}

static void test_check(void) {
    struct sched_policy p = policy(200000);
    char msg[256] = "";
    CHECK(sched_policy_check(&p, 100, 1, msg, sizeof msg) == 0, "a fitting prompt: %s", msg);
    CHECK(sched_policy_check(&p, 100, 5, msg, sizeof msg) == 400 && strstr(msg, "at most 4"), "5 choices: %s", msg);
    CHECK(sched_policy_check(&p, 1024, 1, msg, sizeof msg) == 400 && strstr(msg, "context holds 1024"),
          "a prompt of the whole context: %s", msg);
    /* 200 tokens + 1: 4 blocks, 256500 + 120 bytes > 200000 */
    CHECK(sched_policy_check(&p, 200, 1, msg, sizeof msg) == 400 && strstr(msg, "256620 bytes"), "over budget: %s",
          msg);
}

static void test_admit(void) {
    struct sched_policy p = policy(1000000);
    struct sched_seq a = {.n_prompt = 100, .slot = 0, .len = 100, .reserve = 300000, .order = 1};
    struct sched_seq *slots[MAX_SEQS] = {NULL};
    size_t want[2] = {200000, 200000};
    /* nothing running: used 0 + margin 120 + 200000 fits */
    CHECK(sched_policy_admit(&p, 0, slots, want, 1, false) == SCHED_ADMIT_START, "empty server");
    /* nothing running and nothing fits: the head starts anyway, after what can be evicted */
    size_t huge = 2000000;
    CHECK(sched_policy_admit(&p, 0, slots, &huge, 1, true) == SCHED_ADMIT_EVICT, "evict first");
    CHECK(sched_policy_admit(&p, 0, slots, &huge, 1, false) == SCHED_ADMIT_START, "alone, it starts");
    /* a running sequence of 100 tokens (128500 bytes) that may grow to 300000 adds
     * 171500: in use 500000 + 120 + 171500 + 200000 = 871620 fits, two of them not */
    slots[0] = &a;
    CHECK(sched_policy_admit(&p, 500000, slots, want, 1, false) == SCHED_ADMIT_START, "fits beside one");
    CHECK(sched_policy_admit(&p, 500000, slots, want, 2, false) == SCHED_ADMIT_WAIT_MEMORY, "a group of two waits");
    CHECK(sched_policy_admit(&p, 500000, slots, want, 2, true) == SCHED_ADMIT_EVICT, "or evicts a held prefix");
    /* the running one has grown past its reserve: nothing more to count for it */
    a.len = 300;
    CHECK(sched_policy_admit(&p, 500000, slots, want, 2, false) == SCHED_ADMIT_START, "grown: fits (%d)", a.len);
    /* a follower that has not forked yet counts its whole reserve; once forked, only
     * what it holds beyond the shared prompt is subtracted */
    struct sched_seq f = {.n_prompt = 100, .follower = true, .slot = 1, .len = 100, .reserve = 400000, .order = 2};
    slots[1] = &f;
    CHECK(sched_policy_admit(&p, 500000, slots, want, 1, false) == SCHED_ADMIT_WAIT_MEMORY,
          "unforked follower: 500120 + 400000 + 200000 > 1e6");
    f.forked = true;
    f.len = 230; /* 130 of its own: 3 blocks, 192500 */
    CHECK(sched_policy_admit(&p, 500000, slots, want, 1, false) == SCHED_ADMIT_START,
          "forked follower: 500120 + 207500 + 200000 fits");
    /* sequences just started hold nothing, not even their windows: their whole
     * reserves count. Three of 266500: 120 + 799500 + 200000 fits, 200500 not */
    struct sched_seq fresh[3];
    struct sched_seq *fs[MAX_SEQS] = {NULL};
    for (int i = 0; i < 3; i++) fresh[i] = (struct sched_seq){.n_prompt = 100, .slot = i, .reserve = 266500}, fs[i] = &fresh[i];
    size_t w2 = 200000, w3 = 200500;
    CHECK(sched_policy_admit(&p, 0, fs, &w2, 1, false) == SCHED_ADMIT_START, "beside three new ones: fits");
    CHECK(sched_policy_admit(&p, 0, fs, &w3, 1, false) == SCHED_ADMIT_WAIT_MEMORY,
          "beside three new ones: 1000120 > 1e6 (their windows are not held yet)");
    /* no free slot for a group */
    struct sched_seq c = a, d = a;
    slots[2] = &c;
    CHECK(sched_policy_admit(&p, 0, slots, want, 2, false) == SCHED_ADMIT_WAIT, "one slot for two");
    slots[3] = &d;
    CHECK(sched_policy_admit(&p, 0, slots, want, 1, true) == SCHED_ADMIT_WAIT, "no slot: no eviction either");
}

static void test_step(void) {
    struct sched_policy p = policy(1 << 30);
    kvq_token prompt_b[10] = {10, 11, 12, 13, 14, 15, 16, 17, 18, 19}, prompt_c[3] = {20, 21, 22};
    kvq_token prompt_d[6] = {30, 31, 32, 33, 34, 35};
    struct sched_seq a = {.slot = 0, .n_prompt = 2, .prefilled = 2, .has_pending = true, .pending = 7};
    struct sched_seq b = {.slot = 1, .prompt = prompt_b, .n_prompt = 10, .prefilled = 8};
    struct sched_seq c = {.slot = 2, .prompt = prompt_c, .n_prompt = 3};
    struct sched_seq d = {.slot = 3, .prompt = prompt_d, .n_prompt = 6, .follower = true};
    struct sched_seq *slots[MAX_SEQS] = {&a, &b, &c, &d};
    kvq_token tok[8 + MAX_SEQS + 4];
    int32_t seq[8 + MAX_SEQS + 4];
    bool logits[8 + MAX_SEQS + 4];
    /* a's decode token; b's last 2 prompt tokens (logits at the end); c's 3 tokens fit
     * the 8 of the step too (1 + 2 + 3); d waits for its leader */
    int n = sched_policy_step(&p, slots, tok, seq, logits);
    CHECK(n == 6, "%d tokens", n);
    const kvq_token want_tok[6] = {7, 18, 19, 20, 21, 22};
    const int32_t want_seq[6] = {0, 1, 1, 2, 2, 2};
    const bool want_logits[6] = {true, false, true, false, false, true};
    for (int i = 0; i < 6 && n == 6; i++)
        CHECK(tok[i] == want_tok[i] && seq[i] == want_seq[i] && logits[i] == want_logits[i],
              "row %d: token %d seq %d logits %d", i, tok[i], seq[i], logits[i]);
    CHECK(a.batch_pos == 0 && a.chunk == 0, "a: pos %d chunk %d", a.batch_pos, a.chunk);
    CHECK(b.batch_pos == 2 && b.chunk == 2, "b: pos %d chunk %d", b.batch_pos, b.chunk);
    CHECK(c.batch_pos == 5 && c.chunk == 3, "c: pos %d chunk %d", c.batch_pos, c.chunk);
    CHECK(d.batch_pos == -1 && d.chunk == 0, "d: pos %d chunk %d", d.batch_pos, d.chunk);

    /* forked, d takes part: a chunk of 4 (prefill_chunk), no logits yet, after the
     * others; but 6 + 4 > 8: it waits for the next step. b's prompt was read. */
    d.forked = true;
    b.prefilled = 10;
    b.has_pending = true;
    b.pending = 9;
    c.prefilled = 0;
    n = sched_policy_step(&p, slots, tok, seq, logits);
    /* a, b decode; c's 3 (5 so far); d's 4 would make 9 > 8 */
    CHECK(n == 5 && d.chunk == 0 && c.chunk == 3, "%d tokens, d chunk %d", n, d.chunk);
    /* alone, a prompt's chunk goes in even past the step's room (at least one chunk a step) */
    struct sched_policy tight = p;
    tight.step_tokens = 2;
    struct sched_seq *only[MAX_SEQS] = {NULL, NULL, NULL, &d};
    n = sched_policy_step(&tight, only, tok, seq, logits);
    CHECK(n == 4 && d.chunk == 4 && d.batch_pos == -1 && tok[0] == 30 && tok[3] == 33 && !logits[3],
          "first chunk past the room: %d tokens, chunk %d, pos %d", n, d.chunk, d.batch_pos);
    d.prefilled = 4;
    n = sched_policy_step(&tight, only, tok, seq, logits);
    CHECK(n == 2 && d.chunk == 2 && d.batch_pos == 1 && tok[0] == 34 && logits[1], "the rest: %d tokens, pos %d", n,
          d.batch_pos);
}

static void test_youngest(void) {
    struct sched_policy p = policy(1 << 30);
    struct sched_seq a = {.order = 3}, b = {.order = 7}, c = {.order = 5};
    struct sched_seq *slots[MAX_SEQS] = {&a, NULL, &b, &c};
    CHECK(sched_policy_youngest(&p, slots) == &b, "the last admitted gives way");
    struct sched_seq *none[MAX_SEQS] = {NULL};
    CHECK(sched_policy_youngest(&p, none) == NULL, "none running");
}

/* Prompt chunks end at the offsets' point: a prompt of 10 from 0 with the point at 6
 * goes in chunks of 4, 2 (to the point), then 4; one already past it, as before. */
static void test_step_offsets(void) {
    struct sched_policy p = policy(1 << 30);
    p.offsets_at = 6;
    kvq_token prompt[10] = {0}, tok[32];
    int32_t seq[32];
    bool logits[32];
    struct sched_seq a = {.prompt = prompt, .n_prompt = 10, .slot = 0}, b = {.prompt = prompt, .n_prompt = 10, .slot = 1, .prefilled = 7};
    struct sched_seq *slots[MAX_SEQS] = {&a, NULL, NULL, NULL};
    const int want[] = {4, 2, 4};
    for (int k = 0; k < 3; k++) {
        int n = sched_policy_step(&p, slots, tok, seq, logits);
        CHECK(n == want[k] && a.chunk == want[k], "chunk %d: %d tokens (want %d)", k, n, want[k]);
        a.prefilled += a.chunk;
    }
    slots[0] = &b;
    int n = sched_policy_step(&p, slots, tok, seq, logits);
    CHECK(n == 3 && b.chunk == 3 && b.batch_pos == 2, "past the point: %d tokens", n);
}

int main(void) {
    test_bytes_and_reserves();
    test_check();
    test_admit();
    test_step();
    test_step_offsets();
    test_youngest();
    return check_finish();
}
