/* The matcher keeps the set of parse stacks that can follow the text so far. A stack
 * is a node (the element to match next, and the node to go on with once its rule's
 * alternative ends); nodes are hash-consed, so equal stacks are one id, a set of them
 * is a small list of ids, and a rule that ends in a reference continues its caller's
 * stack instead of growing it (loops keep one id). Only stacks whose next element
 * matches a byte are kept in a set (references and ends are expanded at once).
 *
 * A token mask walks a byte trie of the vocabulary from the current set, advancing
 * the set one trie edge at a time and dropping branches that die. Inside a JSON
 * string that would visit nearly the whole trie, so a "star" element (any number of
 * bytes of a class) and a "run" (lo to hi of them) take a short cut: tokens made only
 * of the class are allowed from bitmaps computed once per class (by length, for runs),
 * and only the tokens holding another byte (their rest from that byte, in a trie of
 * their own) are walked. The mask of the last set is kept, so a string's steps after
 * the first cost a compare. */
#include "engine/grammar.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "tokenizer/tokenizer.h"

/* E_RUN: one of a run of elements matching lo to hi bytes of a class: `left` of the
 * run's elements from here on, `need` of which must match (the rest may be skipped). */
enum { E_END, E_CLASS, E_STAR, E_RUN, E_REF };

struct gelem {
    uint8_t type;
    int32_t arg; /* class or rule */
    int32_t left, need;
};

struct rule {
    int32_t *alts; /* start of each alternative in elems */
    int n, cap;
};

struct node {
    int32_t pos, parent; /* parent: -1 = the end of the text */
    int32_t next;        /* the node after this one's element matched (UNKNOWN: not made yet) */
    int32_t clos, n_clos; /* its expansion: clos[clos..clos+n_clos) (clos < 0: not made yet) */
    bool clos_acc;        /* ... and whether it may end the text */
};

#define ACCEPT (-1)
#define FAILED (-2)
/* Bounds on what one request's grammar may take (a schema's size is the client's choice):
 * elements and rules a few MB, stacks some tens. */
#define MAX_NODES (1 << 20)
#define MAX_ELEMS (1 << 18)

/* ---- the vocabulary ---- */

struct trie_node {
    int32_t child, sibling, last_child;
    int32_t tok_begin, tok_end; /* tokens ending here: toks[tok_begin..tok_end) */
    uint8_t byte;
};

struct trie {
    struct trie_node *v;
    int n, cap;
    int32_t *toks;
};

#define RUN_LEN 64 /* tokens of a run's class by length up to this; longer ones in a list */

/* A star or run class's short cut: tokens entirely of the class (by length, for
 * runs), and the others from their first byte outside it. */
struct vclass {
    struct gclass c;
    uint64_t *full;     /* [n_words] */
    uint64_t *upto;     /* [RUN_LEN + 1][n_words]: those of at most L bytes */
    int32_t *longer;    /* those of more than RUN_LEN bytes */
    int n_longer;
    uint8_t *first;     /* [n_vocab]: where a token's first byte outside the class is (255: later) */
    struct trie partial;
};

#define MAX_VCLASSES 32

struct grammar_vocab {
    int n_vocab, n_words;
    char *bytes;
    size_t *off; /* [n_vocab + 1] */
    struct trie trie;
    int32_t *eog;
    int n_eog;
    pthread_mutex_t mu;
    struct vclass *classes[MAX_VCLASSES];
    int n_classes;
};

struct grammar {
    struct gelem *elems;
    int n_elems, cap_elems;
    struct rule *rules;
    int n_rules, cap_rules;
    struct gclass *classes;
    int n_classes, cap_classes;
    /* stacks */
    struct node *nodes;
    uint32_t *mark, *mark2; /* visited in this epoch: sets built, expansions made */
    int n_nodes, cap_nodes;
    uint32_t epoch, epoch2;
    int32_t *table;
    uint32_t table_cap;
    int32_t *clos; /* the nodes' expansions */
    int n_clos, clos_cap;
    bool failed, acc, acc2; /* acc: the set being built can end here; acc2: the expansion */
    /* sets: the current one at arena[0..n_cur), those of a walk above it */
    int32_t *arena;
    int arena_top, arena_cap, n_cur;
    bool cur_acc;
    /* masks */
    struct grammar_vocab *vocab;
    const struct vclass **vclass; /* [n_classes]: the short cut of each star class */
    uint64_t *cache_mask;
    int32_t *cache_key;
    int cache_n, cache_count;
    bool cache_acc, cache_valid;
};

void gclass_add_range(struct gclass *c, unsigned lo, unsigned hi) {
    for (unsigned b = lo; b <= hi && b < 256; b++) c->bits[b >> 6] |= 1ull << (b & 63);
}

static bool in_class(const struct gclass *c, unsigned b) { return c->bits[b >> 6] >> (b & 63) & 1; }

static int grow(void **p, int *cap, int need, size_t elem) {
    if (need <= *cap) return 0;
    int n = *cap ? *cap : 16;
    while (n < need) n *= 2;
    void *q = realloc(*p, (size_t)n * elem);
    if (!q) return -1;
    *p = q;
    *cap = n;
    return 0;
}

/* ---- building ---- */

static int class_id(struct grammar *g, const struct gclass *c) {
    for (int i = 0; i < g->n_classes; i++)
        if (!memcmp(&g->classes[i], c, sizeof *c)) return i;
    if (grow((void **)&g->classes, &g->cap_classes, g->n_classes + 1, sizeof *g->classes)) return -1;
    g->classes[g->n_classes] = *c;
    return g->n_classes++;
}

static void seq_push(struct gseq *s, uint8_t type, int32_t arg) {
    if (arg < 0 || grow((void **)&s->v, &s->cap, s->n + 1, sizeof *s->v)) {
        s->oom = true;
        return;
    }
    s->v[s->n++] = (struct gelem){type, arg, 0, 0};
}

void gseq_lit(struct gseq *s, struct grammar *g, const char *text, size_t len) {
    for (size_t i = 0; i < len; i++) {
        struct gclass c = {{0}};
        gclass_add_range(&c, (unsigned char)text[i], (unsigned char)text[i]);
        seq_push(s, E_CLASS, class_id(g, &c));
    }
}

void gseq_class(struct gseq *s, struct grammar *g, const struct gclass *c) { seq_push(s, E_CLASS, class_id(g, c)); }
void gseq_star(struct gseq *s, struct grammar *g, const struct gclass *c) { seq_push(s, E_STAR, class_id(g, c)); }
void gseq_ref(struct gseq *s, int rule) { seq_push(s, E_REF, rule); }

void gseq_run(struct gseq *s, struct grammar *g, const struct gclass *c, int lo, int hi) {
    const int k = class_id(g, c);
    for (int i = 0; i < hi; i++) {
        seq_push(s, E_RUN, k);
        if (!s->oom) s->v[s->n - 1].left = hi - i, s->v[s->n - 1].need = lo > i ? lo - i : 0;
    }
}

void gseq_free(struct gseq *s) {
    free(s->v);
    memset(s, 0, sizeof *s);
}

struct grammar *grammar_new(void) {
    struct grammar *g = calloc(1, sizeof *g);
    if (!g) kvq_error_code(KVQ_ERR_OOM, "out of memory");
    return g;
}

static void trie_free(struct trie *t) {
    free(t->v);
    free(t->toks);
}

void grammar_free(struct grammar *g) {
    if (!g) return;
    free(g->elems);
    for (int i = 0; i < g->n_rules; i++) free(g->rules[i].alts);
    free(g->rules);
    free(g->classes);
    free(g->nodes);
    free(g->mark);
    free(g->mark2);
    free(g->clos);
    free(g->table);
    free(g->arena);
    free(g->vclass);
    free(g->cache_mask);
    free(g->cache_key);
    free(g);
}

int grammar_rule(struct grammar *g) {
    if (g->n_rules >= MAX_ELEMS) return kvq_error("grammar: more than %d rules (the schema is too large)", MAX_ELEMS);
    if (grow((void **)&g->rules, &g->cap_rules, g->n_rules + 1, sizeof *g->rules))
        return kvq_error_code(KVQ_ERR_OOM, "out of memory");
    g->rules[g->n_rules] = (struct rule){0};
    return g->n_rules++;
}

int grammar_add_alt(struct grammar *g, int rule, struct gseq *s) {
    int rc = 0;
    struct rule *r = &g->rules[rule];
    if (s->oom) rc = kvq_error("grammar: out of memory");
    else if (g->n_elems + s->n + 1 > MAX_ELEMS)
        rc = kvq_error("grammar: more than %d elements (the schema is too large)", MAX_ELEMS);
    else if (grow((void **)&g->elems, &g->cap_elems, g->n_elems + s->n + 1, sizeof *g->elems) ||
             grow((void **)&r->alts, &r->cap, r->n + 1, sizeof *r->alts))
        rc = kvq_error("grammar: out of memory");
    if (rc == 0) {
        r->alts[r->n++] = g->n_elems;
        if (s->n) memcpy(g->elems + g->n_elems, s->v, sizeof *s->v * (size_t)s->n);
        g->n_elems += s->n;
        g->elems[g->n_elems++] = (struct gelem){E_END, 0, 0, 0};
    }
    gseq_free(s);
    return rc;
}

/* ---- stacks ---- */

#define UNKNOWN INT32_MIN
/* A mask's walk makes nodes for stacks it only tries; past this many the grammar
 * keeps those its current set needs and forgets the rest (and what it remembered). */
#ifndef GC_NODES /* (tests build with small ones, to compact often) */
#define GC_NODES (1 << 16)
#define GC_CLOSURES (1 << 18)
#endif

static uint32_t node_hash(int32_t pos, int32_t parent) {
    uint64_t h = (uint64_t)(uint32_t)pos * 0x9E3779B97F4A7C15ull ^ (uint64_t)(uint32_t)parent * 0xC2B2AE3D27D4EB4Full;
    return (uint32_t)(h ^ (h >> 29));
}

static void table_insert(struct grammar *g, int32_t id) {
    uint32_t mask = g->table_cap - 1, i = node_hash(g->nodes[id].pos, g->nodes[id].parent) & mask;
    while (g->table[i] >= 0) i = (i + 1) & mask;
    g->table[i] = id;
}

static int rehash(struct grammar *g, uint32_t cap) {
    int32_t *t = malloc(sizeof *t * cap);
    if (!t) return -1;
    free(g->table);
    g->table = t;
    g->table_cap = cap;
    memset(t, 0xff, sizeof *t * cap);
    for (int i = 0; i < g->n_nodes; i++) table_insert(g, i);
    return 0;
}

/* The node (pos, parent), made if new; FAILED when there are too many. */
static int32_t intern(struct grammar *g, int32_t pos, int32_t parent) {
    if (g->table_cap) {
        uint32_t mask = g->table_cap - 1;
        for (uint32_t i = node_hash(pos, parent) & mask; g->table[i] >= 0; i = (i + 1) & mask) {
            const struct node *n = &g->nodes[g->table[i]];
            if (n->pos == pos && n->parent == parent) return g->table[i];
        }
    }
    if (g->n_nodes >= MAX_NODES) {
        g->failed = true;
        return FAILED;
    }
    if (g->n_nodes == g->cap_nodes) {
        const int cap = g->cap_nodes ? 2 * g->cap_nodes : 1024;
        struct node *nn = realloc(g->nodes, sizeof *nn * (size_t)cap);
        if (nn) g->nodes = nn;
        uint32_t *m = nn ? realloc(g->mark, sizeof *m * (size_t)cap) : NULL;
        if (m) g->mark = m;
        uint32_t *m2 = m ? realloc(g->mark2, sizeof *m2 * (size_t)cap) : NULL;
        if (!m2) {
            g->failed = true;
            return FAILED;
        }
        g->mark2 = m2;
        g->cap_nodes = cap;
    }
    const int32_t id = g->n_nodes++;
    g->nodes[id] = (struct node){pos, parent, UNKNOWN, -1, 0, false};
    g->mark[id] = g->mark2[id] = 0;
    if ((uint32_t)g->n_nodes * 2 > g->table_cap) {
        if (rehash(g, g->table_cap ? g->table_cap * 2 : 1024)) {
            g->n_nodes--;
            g->failed = true;
            return FAILED;
        }
    } else {
        table_insert(g, id);
    }
    return id;
}

/* The stack going on at pos: its parent when pos ends an alternative. */
static int32_t cont(struct grammar *g, int32_t pos, int32_t parent) {
    return g->elems[pos].type == E_END ? parent : intern(g, pos, parent);
}

/* The stack after node id's element has matched a byte (remembered). */
static int32_t next(struct grammar *g, int32_t id) {
    if (g->nodes[id].next == UNKNOWN) {
        const int32_t k = cont(g, g->nodes[id].pos + 1, g->nodes[id].parent);
        if (k == FAILED) return FAILED;
        g->nodes[id].next = k;
    }
    return g->nodes[id].next;
}

static void clos_push(struct grammar *g, int32_t id) {
    if (grow((void **)&g->clos, &g->clos_cap, g->n_clos + 1, sizeof *g->clos)) {
        g->failed = true;
        return;
    }
    g->clos[g->n_clos++] = id;
}

/* Adds to g->clos the stacks node id stands for, each with a byte-matching element
 * next (g->acc2: one of them is the end of the text). */
static void expand(struct grammar *g, int32_t id) {
    if (id == ACCEPT) {
        g->acc2 = true;
        return;
    }
    if (id < 0 || g->mark2[id] == g->epoch2) return;
    g->mark2[id] = g->epoch2;
    const struct node n = g->nodes[id];
    const struct gelem e = g->elems[n.pos];
    switch (e.type) {
    case E_CLASS: clos_push(g, id); break;
    case E_STAR:
        clos_push(g, id);
        expand(g, cont(g, n.pos + 1, n.parent));
        break;
    case E_RUN:
        clos_push(g, id);
        if (e.need == 0) expand(g, cont(g, n.pos + e.left, n.parent));
        break;
    case E_REF: {
        const int32_t k = cont(g, n.pos + 1, n.parent);
        if (k == FAILED) return;
        const struct rule *r = &g->rules[e.arg];
        for (int i = 0; i < r->n; i++) expand(g, intern(g, r->alts[i], k));
        break;
    }
    default: expand(g, n.parent); break;
    }
}

static void set_push(struct grammar *g, int32_t id) {
    if (grow((void **)&g->arena, &g->arena_cap, g->arena_top + 1, sizeof *g->arena)) {
        g->failed = true;
        return;
    }
    g->arena[g->arena_top++] = id;
}

static void new_epoch(uint32_t *epoch, uint32_t *mark, int n) {
    if (++*epoch == 0) {
        memset(mark, 0, sizeof *mark * (size_t)n);
        *epoch = 1;
    }
}

/* Adds the stacks node id stands for to the set being built (its expansion is
 * worked out once and remembered). */
static void closure(struct grammar *g, int32_t id) {
    if (id == ACCEPT) {
        g->acc = true;
        return;
    }
    if (id < 0) return;
    if (g->nodes[id].clos < 0) {
        const int start = g->n_clos;
        new_epoch(&g->epoch2, g->mark2, g->n_nodes);
        g->acc2 = false;
        expand(g, id);
        g->nodes[id].clos = start;
        g->nodes[id].n_clos = g->n_clos - start;
        g->nodes[id].clos_acc = g->acc2;
    }
    const struct node *n = &g->nodes[id];
    g->acc |= n->clos_acc;
    for (int i = 0; i < n->n_clos; i++) {
        const int32_t t = g->clos[n->clos + i];
        if (g->mark[t] == g->epoch) continue;
        g->mark[t] = g->epoch;
        set_push(g, t);
    }
}

/* The set after byte b from the set at arena[from..from+n), built on top of the
 * arena; returns where it starts (its size: arena_top - start; g->acc: it may end). */
static int advance(struct grammar *g, int from, int n, unsigned b) {
    new_epoch(&g->epoch, g->mark, g->n_nodes);
    g->acc = false;
    const int start = g->arena_top;
    for (int i = 0; i < n; i++) {
        const int32_t id = g->arena[from + i];
        const struct gelem e = g->elems[g->nodes[id].pos];
        if (!in_class(&g->classes[e.arg], b)) continue;
        closure(g, e.type == E_STAR ? id : next(g, id));
    }
    return start;
}

/* Keeps only the nodes the current set stands on (renumbered), forgetting what was
 * remembered. */
static void compact(struct grammar *g) {
    int32_t *map = malloc(sizeof *map * (size_t)g->n_nodes);
    if (!map) return;
    memset(map, 0xff, sizeof *map * (size_t)g->n_nodes);
    for (int i = 0; i < g->n_cur; i++)
        for (int32_t x = g->arena[i]; x >= 0 && map[x] < 0; x = g->nodes[x].parent) map[x] = 0;
    int n = 0;
    for (int i = 0; i < g->n_nodes; i++)
        if (map[i] == 0) {
            map[i] = n;
            const int32_t parent = g->nodes[i].parent;
            g->nodes[n++] = (struct node){g->nodes[i].pos, parent >= 0 ? map[parent] : parent, UNKNOWN, -1, 0, false};
        }
    for (int i = 0; i < g->n_cur; i++) g->arena[i] = map[g->arena[i]];
    free(map);
    g->n_nodes = n;
    g->n_clos = 0;
    memset(g->mark, 0, sizeof *g->mark * (size_t)n);
    memset(g->mark2, 0, sizeof *g->mark2 * (size_t)n);
    rehash(g, g->table_cap);
    g->cache_valid = false;
}

int grammar_start(struct grammar *g, int root) {
    for (int i = 0; i < g->n_rules; i++)
        if (g->rules[i].n == 0) return kvq_error("grammar: rule %d has no alternative", i);
    g->arena_top = 0;
    new_epoch(&g->epoch, g->mark, g->n_nodes);
    g->acc = false;
    const struct rule *r = &g->rules[root];
    for (int i = 0; i < r->n; i++) closure(g, intern(g, r->alts[i], ACCEPT));
    g->n_cur = g->arena_top;
    g->cur_acc = g->acc;
    g->cache_valid = false;
    return g->failed ? kvq_error("grammar: too large") : 0;
}

int grammar_accept_bytes(struct grammar *g, const char *b, size_t n) {
    int from = 0, cnt = g->n_cur;
    bool acc = g->cur_acc;
    for (size_t i = 0; i < n; i++) {
        from = advance(g, from, cnt, (unsigned char)b[i]);
        cnt = g->arena_top - from;
        acc = g->acc;
        if (cnt == 0 && !(acc && i + 1 == n)) {
            g->arena_top = g->n_cur;
            return -1;
        }
    }
    memmove(g->arena, g->arena + from, sizeof *g->arena * (size_t)cnt);
    g->arena_top = g->n_cur = cnt;
    g->cur_acc = acc;
    return 0;
}

bool grammar_accepting(const struct grammar *g) { return g->cur_acc; }
bool grammar_can_continue(const struct grammar *g) { return g->n_cur > 0; }

/* ---- tries ---- */

struct key {
    const unsigned char *p;
    int32_t len, id;
};

static int key_cmp(const void *a, const void *b) {
    const struct key *x = a, *y = b;
    int32_t n = x->len < y->len ? x->len : y->len;
    int c = memcmp(x->p, y->p, (size_t)n);
    if (c) return c;
    return x->len != y->len ? (x->len < y->len ? -1 : 1) : (x->id > y->id) - (x->id < y->id);
}

static int32_t trie_add_node(struct trie *t, uint8_t byte) {
    if (grow((void **)&t->v, &t->cap, t->n + 1, sizeof *t->v)) return -1;
    t->v[t->n] = (struct trie_node){-1, -1, -1, 0, 0, byte};
    return t->n++;
}

/* A trie of the keys (sorted here). */
static int trie_build(struct trie *t, struct key *k, int n) {
    qsort(k, (size_t)n, sizeof *k, key_cmp);
    memset(t, 0, sizeof *t);
    if (!(t->toks = malloc(sizeof *t->toks * (size_t)(n ? n : 1))) || trie_add_node(t, 0) < 0) return -1;
    for (int i = 0; i < n; i++) {
        int32_t at = 0;
        for (int32_t j = 0; j < k[i].len; j++) {
            /* sorted keys: a child for this byte, if any, is the last one added */
            int32_t c = t->v[at].last_child;
            if (c < 0 || t->v[c].byte != k[i].p[j]) {
                if ((c = trie_add_node(t, k[i].p[j])) < 0) return -1;
                if (t->v[at].last_child >= 0) t->v[t->v[at].last_child].sibling = c;
                else t->v[at].child = c;
                t->v[at].last_child = c;
            }
            at = c;
        }
        if (t->v[at].tok_end == 0) t->v[at].tok_begin = t->v[at].tok_end = i;
        t->toks[t->v[at].tok_end++] = k[i].id;
    }
    return 0;
}

static const unsigned char *tok_bytes(const struct grammar_vocab *v, int32_t id, int32_t *len) {
    *len = (int32_t)(v->off[id + 1] - v->off[id]);
    return (const unsigned char *)v->bytes + v->off[id];
}

int grammar_vocab_token(const struct grammar_vocab *v, int id, const char **bytes) {
    int32_t len = 0;
    *bytes = "";
    if (id >= 0 && id < v->n_vocab) *bytes = (const char *)tok_bytes(v, id, &len);
    return len;
}

struct grammar_vocab *grammar_vocab_new(const struct tokenizer *t, int n_vocab) {
    struct grammar_vocab *v = calloc(1, sizeof *v);
    struct key *keys = NULL;
    if (!v) goto oom;
    pthread_mutex_init(&v->mu, NULL);
    v->n_vocab = n_vocab;
    v->n_words = (n_vocab + 63) / 64;
    const int n_tok = tokenizer_n_vocab(t) < n_vocab ? tokenizer_n_vocab(t) : n_vocab;
    size_t total = 0, cap = 1 << 16;
    v->off = malloc(sizeof *v->off * ((size_t)n_vocab + 1));
    v->bytes = malloc(cap);
    v->eog = malloc(sizeof *v->eog * 64);
    keys = malloc(sizeof *keys * (size_t)n_vocab);
    if (!v->off || !v->bytes || !v->eog || !keys) goto oom;
    int n_keys = 0;
    for (int id = 0; id < n_vocab; id++) {
        v->off[id] = total;
        if (id >= n_tok) continue;
        if (tokenizer_is_eog(t, id) && v->n_eog < 64) v->eog[v->n_eog++] = id;
        int len = tokenizer_token_bytes(t, id, false, NULL, 0);
        if (len <= 0) continue;
        if (total + (size_t)len > cap) {
            while (total + (size_t)len > cap) cap *= 2;
            char *b = realloc(v->bytes, cap);
            if (!b) goto oom;
            v->bytes = b;
        }
        tokenizer_token_bytes(t, id, false, v->bytes + total, len);
        total += (size_t)len;
    }
    v->off[n_vocab] = total;
    for (int id = 0; id < n_vocab; id++) {
        int32_t len;
        const unsigned char *p = tok_bytes(v, id, &len);
        if (len > 0) keys[n_keys++] = (struct key){p, len, id};
    }
    if (trie_build(&v->trie, keys, n_keys)) goto oom;
    free(keys);
    return v;
oom:
    free(keys);
    grammar_vocab_free(v);
    kvq_error_code(KVQ_ERR_OOM, "out of memory");
    return NULL;
}

void grammar_vocab_free(struct grammar_vocab *v) {
    if (!v) return;
    for (int i = 0; i < v->n_classes; i++) {
        free(v->classes[i]->full);
        free(v->classes[i]->upto);
        free(v->classes[i]->longer);
        free(v->classes[i]->first);
        trie_free(&v->classes[i]->partial);
        free(v->classes[i]);
    }
    trie_free(&v->trie);
    free(v->bytes);
    free(v->off);
    free(v->eog);
    pthread_mutex_destroy(&v->mu);
    free(v);
}

static struct vclass *vclass_build(const struct grammar_vocab *v, const struct gclass *c) {
    struct vclass *vc = calloc(1, sizeof *vc);
    struct key *keys = malloc(sizeof *keys * (size_t)(v->n_vocab ? v->n_vocab : 1));
    const size_t nw = (size_t)v->n_words;
    if (!vc || !keys || !(vc->full = calloc(nw, sizeof *vc->full)) ||
        !(vc->upto = calloc(nw * (RUN_LEN + 1), sizeof *vc->upto)) || !(vc->first = calloc((size_t)v->n_vocab + 1, 1)))
        goto fail;
    vc->c = *c;
    int n = 0;
    for (int id = 0; id < v->n_vocab; id++) {
        int32_t len, j = 0;
        const unsigned char *p = tok_bytes(v, id, &len);
        if (len == 0) continue;
        while (j < len && in_class(c, p[j])) j++;
        vc->first[id] = (uint8_t)(j < 255 ? j : 255);
        if (j == len) {
            vc->full[id >> 6] |= 1ull << (id & 63);
            for (int l = len; l <= RUN_LEN; l++) vc->upto[(size_t)l * nw + (size_t)(id >> 6)] |= 1ull << (id & 63);
            int32_t *lg = len > RUN_LEN ? realloc(vc->longer, sizeof *lg * (size_t)(vc->n_longer + 1)) : NULL;
            if (lg) (vc->longer = lg)[vc->n_longer++] = id;
        } else {
            keys[n++] = (struct key){p + j, len - j, id};
        }
    }
    if (trie_build(&vc->partial, keys, n)) goto fail;
    free(keys);
    return vc;
fail:
    free(keys);
    if (vc) {
        free(vc->full);
        free(vc->upto);
        free(vc->longer);
        free(vc->first);
        trie_free(&vc->partial);
    }
    free(vc);
    return NULL;
}

/* The vocabulary's short cut for star class c, made the first time it is asked for. */
static const struct vclass *vclass_get(struct grammar_vocab *v, const struct gclass *c) {
    pthread_mutex_lock(&v->mu);
    struct vclass *vc = NULL;
    for (int i = 0; i < v->n_classes && !vc; i++)
        if (!memcmp(&v->classes[i]->c, c, sizeof *c)) vc = v->classes[i];
    if (!vc && v->n_classes < MAX_VCLASSES && (vc = vclass_build(v, c))) v->classes[v->n_classes++] = vc;
    pthread_mutex_unlock(&v->mu);
    return vc;
}

int grammar_bind_vocab(struct grammar *g, struct grammar_vocab *v) {
    g->vocab = v;
    free(g->vclass);
    free(g->cache_mask);
    g->cache_valid = false;
    g->vclass = calloc((size_t)g->n_classes + 1, sizeof *g->vclass);
    g->cache_mask = malloc(sizeof *g->cache_mask * (size_t)v->n_words);
    if (!g->vclass || !g->cache_mask) return kvq_error_code(KVQ_ERR_OOM, "out of memory");
    for (int i = 0; i < g->n_elems; i++) {
        const struct gelem *e = &g->elems[i];
        /* a star class without a short cut (the cache full) is walked like any other */
        if ((e->type == E_STAR || e->type == E_RUN) && !g->vclass[e->arg])
            g->vclass[e->arg] = vclass_get(v, &g->classes[e->arg]);
    }
    return 0;
}

/* The token filter of a run's partial tokens: their first byte outside the class at
 * lo..hi (first NULL: none). */
struct only {
    const uint8_t *first;
    int lo, hi;
};

/* Allows the tokens of trie t below node at that the set at arena[from..from+n) can
 * take whole. */
static void walk(struct grammar *g, const struct trie *t, int32_t at, int from, int n, uint64_t *allowed,
                 const struct only *f) {
    struct gclass any = {{0}}; /* the bytes some stack of the set takes: others need no look */
    for (int i = 0; i < n; i++) {
        const struct gclass *k = &g->classes[g->elems[g->nodes[g->arena[from + i]].pos].arg];
        for (int w = 0; w < 4; w++) any.bits[w] |= k->bits[w];
    }
    for (int32_t c = t->v[at].child; c >= 0; c = t->v[c].sibling) {
        const struct trie_node *tn = &t->v[c];
        if (!in_class(&any, tn->byte)) continue;
        const int top = g->arena_top;
        const int s = advance(g, from, n, tn->byte);
        const int cnt = g->arena_top - s;
        if (cnt > 0 || g->acc)
            for (int32_t i = tn->tok_begin; i < tn->tok_end; i++) {
                const int32_t id = t->toks[i];
                if (!f->first || (f->first[id] >= f->lo && f->first[id] <= f->hi)) allowed[id >> 6] |= 1ull << (id & 63);
            }
        if (cnt > 0 && tn->child >= 0) walk(g, t, c, s, cnt, allowed, f);
        g->arena_top = top;
    }
}

int grammar_mask(struct grammar *g, uint64_t *allowed) {
    const struct grammar_vocab *v = g->vocab;
    const int nw = v->n_words;
    if (g->cache_valid && g->cache_n == g->n_cur && g->cache_acc == g->cur_acc &&
        !memcmp(g->cache_key, g->arena, sizeof *g->arena * (size_t)g->n_cur)) {
        memcpy(allowed, g->cache_mask, sizeof *allowed * (size_t)nw);
        return g->cache_count;
    }
    memset(allowed, 0, sizeof *allowed * (size_t)nw);
    if (g->n_nodes > GC_NODES || g->n_clos > GC_CLOSURES) compact(g);
    /* the stacks without a short cut, walked together over the whole trie */
    const int gen = g->arena_top;
    for (int i = 0; i < g->n_cur; i++) {
        const int32_t id = g->arena[i];
        const struct gelem e = g->elems[g->nodes[id].pos];
        const struct vclass *vc = e.type == E_STAR || e.type == E_RUN ? g->vclass[e.arg] : NULL;
        if (!vc) {
            set_push(g, id);
            continue;
        }
        /* tokens of the class alone; then the others: the star or run takes their bytes up
         * to the first outside it, then what follows it */
        struct only f = {NULL, 0, 0};
        int32_t after;
        if (e.type == E_STAR) {
            for (int w = 0; w < nw; w++) allowed[w] |= vc->full[w];
            after = next(g, id);
        } else {
            /* a token of the class that fits what is left of the run stays in it */
            const uint64_t *fit = vc->upto + (size_t)(e.left < RUN_LEN ? e.left : RUN_LEN) * (size_t)nw;
            for (int w = 0; w < nw; w++) allowed[w] |= fit[w];
            for (int k = 0; k < vc->n_longer; k++)
                if ((int)(v->off[vc->longer[k] + 1] - v->off[vc->longer[k]]) <= e.left)
                    allowed[vc->longer[k] >> 6] |= 1ull << (vc->longer[k] & 63);
            f = (struct only){vc->first, e.need, e.left};
            after = cont(g, g->nodes[id].pos + e.left, g->nodes[id].parent);
        }
        const int top = g->arena_top;
        new_epoch(&g->epoch, g->mark, g->n_nodes);
        closure(g, after);
        if (g->arena_top > top) walk(g, &vc->partial, 0, top, g->arena_top - top, allowed, &f);
        g->arena_top = top;
    }
    const struct only all = {NULL, 0, 0};
    if (g->arena_top > gen) walk(g, &v->trie, 0, gen, g->arena_top - gen, allowed, &all);
    g->arena_top = g->n_cur;
    /* a dead end (only a grammar too large to follow reaches one) ends the text */
    if (g->cur_acc || g->failed)
        for (int i = 0; i < v->n_eog; i++) allowed[v->eog[i] >> 6] |= 1ull << (v->eog[i] & 63);
    int count = 0;
    for (int w = 0; w < nw; w++) count += __builtin_popcountll(allowed[w]);
    int32_t *key = realloc(g->cache_key, sizeof *key * (size_t)(g->n_cur ? g->n_cur : 1));
    if (key) {
        g->cache_key = key;
        memcpy(key, g->arena, sizeof *key * (size_t)g->n_cur);
        memcpy(g->cache_mask, allowed, sizeof *allowed * (size_t)nw);
        g->cache_n = g->n_cur;
        g->cache_acc = g->cur_acc;
        g->cache_count = count;
        g->cache_valid = true;
    }
    return count;
}
