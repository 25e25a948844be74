/*
 * Fault injection around any transport (FERRY_FAULT_*, see core/config.c):
 * an ops table whose instance wraps another transport's instance. By
 * default arrivals (the inner poll's FR_CQE_RX) are held back and handed
 * out by a later poll once due: after FERRY_FAULT_DELAY_US plus a random
 * 0..FERRY_FAULT_JITTER_US, oldest first or (FERRY_FAULT_REORDER) in random
 * order among those due, as EFA's unordered transport may deliver them.
 * With FERRY_FAULT_POSTS this rank's own writes are held instead, one per
 * destination, and posted to the inner transport once due, so a write may
 * leave, and land, before an older one.
 *
 * Held posts are checked against the registered lengths when the call is
 * made (what the inner transport would refuse, the wrapper refuses with
 * the same message, posting nothing), count as pending, complete through
 * the inner transport's TX completions once posted, and are discarded,
 * never posted, at close. To check and to post later, the wrapper keeps
 * its own handles around the inner regions (their lengths) and groups
 * (ranks and remote lengths); a group destroyed while posts of it are held
 * lives on, inside, until they are posted.
 *
 * Threading: as the inner transport (one thread at a time per instance).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/config.h"
#include "core/log.h"
#include "runtime/rt.h"
#include "transport/fault.h"

#define FR_FAULT_GOLDEN 0x9e3779b97f4a7c15ull

typedef struct fr_fault_mr {
    struct fr_fault_mr *prev, *next; /* live list, freed at close */
    fr_mr_t *in;
    uint64_t len;
} fr_fault_mr_t;

typedef struct fr_fault_group {
    struct fr_fault_group *prev, *next; /* live list, freed at close */
    fr_group_t *in;
    int npeers;
    uint64_t slen;   /* the source region's registered length */
    int *rank;       /* [npeers] */
    uint64_t *rlen;  /* [npeers]: the peers' registered lengths */
    int nheld;       /* held posts that will use it */
    int dead;        /* destroyed by the caller while posts were held */
} fr_fault_group_t;

/* Held until `at`: an arrival's immediate (g NULL) or one post. */
typedef struct fr_fault_held {
    uint64_t at;
    fr_fault_group_t *g;
    fr_slice_t slice; /* arrivals: only imm */
    uint64_t ctx;
    int index;
    int fence;
} fr_fault_held_t;

typedef struct fr_fault_hq {
    fr_fault_held_t *v;
    int n, cap;
    long total, reordered; /* held; released ahead of an older one */
} fr_fault_hq_t;

typedef struct fr_fault {
    const fr_transport_ops_t *ops; /* the inner transport */
    fr_transport_t *in;
    int flags; /* FR_TP_OPEN_* it was opened with */
    long delay_ns, jitter_ns;
    int reorder;
    int posts;         /* FERRY_FAULT_POSTS: hold posts, not arrivals */
    int hold_arrivals;
    uint64_t rng;
    fr_fault_hq_t arrivals, held;
    fr_cqe_t *failed; /* released posts the inner transport refused */
    int nfailed, capfailed;
    fr_fault_mr_t *mrs;
    fr_fault_group_t *groups;
} fr_fault_t;

static fr_fault_t *fault_of(fr_transport_t *t) { return (fr_fault_t *)(void *)t; }

/* splitmix64 */
static uint64_t fault_rand(fr_fault_t *f)
{
    uint64_t x = f->rng += FR_FAULT_GOLDEN;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

int fr_fault_on(void)
{
    return fr_cfg_int(FR_CFG_FAULT_DELAY_US) != 0 ||
           fr_cfg_int(FR_CFG_FAULT_JITTER_US) != 0 ||
           fr_cfg_int(FR_CFG_FAULT_REORDER) != 0 ||
           fr_cfg_int(FR_CFG_FAULT_POSTS) != 0;
}

/* ------------------------------------------------------------------ */
/* held queues                                                         */
/* ------------------------------------------------------------------ */

/* Room for n more items, so that a call holds all of its posts or none. */
static int fault_hq_reserve(fr_fault_hq_t *q, int n)
{
    if (q->n + n <= q->cap)
        return 1;
    int cap = q->cap ? 2 * q->cap : 64;
    while (cap < q->n + n)
        cap *= 2;
    void *p = realloc(q->v, sizeof(*q->v) * (size_t)cap);
    if (!p)
        return 0;
    q->v = p;
    q->cap = cap;
    return 1;
}

/* Hold h back until now + delay + jitter; 0 when it cannot be held. */
static int fault_hq_push(fr_fault_t *f, fr_fault_hq_t *q, fr_fault_held_t h)
{
    if (!fault_hq_reserve(q, 1))
        return 0;
    h.at = fr_now_ns() + (uint64_t)f->delay_ns;
    if (f->jitter_ns > 0)
        h.at += fault_rand(f) % (uint64_t)(f->jitter_ns + 1);
    q->v[q->n++] = h;
    q->total++;
    return 1;
}

/* Take an item due by `now`: the oldest, or (reorder) a random one of
 * those due. 0: none is due. */
static int fault_hq_pop(fr_fault_t *f, fr_fault_hq_t *q, uint64_t now,
                        fr_fault_held_t *out)
{
    int pick = -1, seen = 0;
    for (int i = 0; i < q->n; i++) {
        if (q->v[i].at > now)
            continue;
        seen++;
        if (pick < 0 || (f->reorder && fault_rand(f) % (uint64_t)seen == 0))
            pick = i;
        if (!f->reorder)
            break;
    }
    if (pick < 0)
        return 0;
    q->reordered += pick > 0; /* an older one is still held */
    *out = q->v[pick];
    memmove(&q->v[pick], &q->v[pick + 1],
            sizeof(*q->v) * (size_t)(q->n - pick - 1));
    q->n--;
    return 1;
}

/* ------------------------------------------------------------------ */
/* open, close                                                         */
/* ------------------------------------------------------------------ */

static void fault_config(fr_fault_t *f, int rank)
{
    f->delay_ns = fr_cfg_int(FR_CFG_FAULT_DELAY_US) * 1000;
    f->jitter_ns = fr_cfg_int(FR_CFG_FAULT_JITTER_US) * 1000;
    f->reorder = fr_cfg_int(FR_CFG_FAULT_REORDER) != 0;
    f->posts = fr_cfg_int(FR_CFG_FAULT_POSTS) != 0;
    f->rng = (uint64_t)fr_cfg_int(FR_CFG_FAULT_SEED) * 1000003u +
             (uint64_t)rank;
    if (f->reorder && !f->delay_ns && !f->jitter_ns)
        f->jitter_ns = 20000; /* something to reorder within */
    f->hold_arrivals = (f->delay_ns || f->jitter_ns || f->reorder) &&
                       !f->posts;
    if (f->delay_ns || f->jitter_ns || f->reorder)
        FR_LOG_WARN(FR_SUB_NET,
                    "fault injection on: delay %ld us, jitter %ld us, %s%s",
                    f->delay_ns / 1000, f->jitter_ns / 1000,
                    f->reorder ? "reordered " : "in order",
                    f->reorder ? (f->posts ? "posts" : "arrivals") : "");
}

/* The statistics lines an instance leaves at close. */
static void fault_stats(const fr_fault_t *f)
{
    if (f->hold_arrivals)
        FR_LOG_WARN(FR_SUB_NET,
                    "fault injection: held %ld arrivals, delivered %ld ahead "
                    "of an older one", f->arrivals.total,
                    f->arrivals.reordered);
    if (f->posts)
        FR_LOG_WARN(FR_SUB_NET,
                    "fault injection: held %ld posts, posted %ld ahead of an "
                    "older one", f->held.total, f->held.reordered);
}

int fr_fault_open(const fr_transport_ops_t *inner, fr_boot_t *boot, int nic,
                  int flags, fr_transport_t **t, fr_err_t *err)
{
    *t = NULL;
    fr_fault_t *f = calloc(1, sizeof(*f));
    if (!f)
        return FR_ERR(err, FERRY_ERR_NOMEM, "%s: out of memory", inner->name);
    f->ops = inner;
    f->flags = flags;
    fault_config(f, fr_boot_rank(boot));
    int rc = inner->open(boot, nic, flags, &f->in, err);
    if (rc != FERRY_OK) {
        fault_stats(f); /* as a close of the failed instance would */
        free(f);
        return rc;
    }
    *t = (fr_transport_t *)(void *)f;
    return FERRY_OK;
}

static int fault_open(fr_boot_t *boot, int nic, int flags, fr_transport_t **t,
                      fr_err_t *err)
{
    *t = NULL;
    return FR_ERR(err, FERRY_ERR_INVALID,
                  "fault injection wraps another transport: open through "
                  "fr_transport_open");
}

static int fault_fence_probe(char *why, size_t len)
{
    snprintf(why, len, "fault injection wraps another transport: probe that "
             "one (fr_transport_find)");
    return 0;
}

static void fault_hmem_probe(int device, void *ptr, size_t len,
                             fr_tp_hmem_t *out)
{
    (void)device;
    (void)ptr;
    (void)len;
    memset(out, 0, sizeof(*out));
    snprintf(out->why, sizeof(out->why), "fault injection wraps another "
             "transport: probe that one (fr_transport_find)");
}

static void fault_group_free(fr_fault_t *f, fr_fault_group_t *g)
{
    if (g->prev)
        g->prev->next = g->next;
    else
        f->groups = g->next;
    if (g->next)
        g->next->prev = g->prev;
    free(g->rank);
    free(g->rlen);
    free(g);
}

/* A held post of g is gone (posted or discarded). */
static void fault_group_unhold(fr_fault_t *f, fr_fault_group_t *g)
{
    if (--g->nheld == 0 && g->dead) {
        f->ops->group_destroy(f->in, g->in);
        fault_group_free(f, g);
    }
}

static void fault_close(fr_transport_t *t)
{
    if (!t)
        return;
    fr_fault_t *f = fault_of(t);
    /* held posts were never posted: they go, without completions */
    for (int i = 0; i < f->held.n; i++)
        fault_group_unhold(f, f->held.v[i].g);
    f->held.n = 0;
    f->ops->close(f->in); /* frees its own regions and groups */
    fault_stats(f);
    while (f->groups)
        fault_group_free(f, f->groups);
    while (f->mrs) {
        fr_fault_mr_t *m = f->mrs;
        f->mrs = m->next;
        free(m);
    }
    free(f->held.v);
    free(f->arrivals.v);
    free(f->failed);
    free(f);
}

/* ------------------------------------------------------------------ */
/* regions and groups                                                  */
/* ------------------------------------------------------------------ */

static int fault_reg_dev(fr_transport_t *t, void *ptr, size_t len,
                         int remote_write, int device, fr_mr_t **mrp,
                         fr_mr_desc_t *desc, fr_err_t *err)
{
    fr_fault_t *f = fault_of(t);
    *mrp = NULL;
    fr_fault_mr_t *m = calloc(1, sizeof(*m));
    if (!m)
        return FR_ERR(err, FERRY_ERR_NOMEM, "%s: out of memory",
                      f->ops->name);
    int rc = f->ops->reg_dev(f->in, ptr, len, remote_write, device, &m->in,
                             desc, err);
    if (rc != FERRY_OK) {
        free(m);
        return rc;
    }
    m->len = len;
    m->next = f->mrs;
    if (f->mrs)
        f->mrs->prev = m;
    f->mrs = m;
    *mrp = (fr_mr_t *)(void *)m;
    return FERRY_OK;
}

static int fault_reg(fr_transport_t *t, void *ptr, size_t len,
                     int remote_write, fr_mr_t **mrp, fr_mr_desc_t *desc,
                     fr_err_t *err)
{
    return fault_reg_dev(t, ptr, len, remote_write, -1, mrp, desc, err);
}

static void fault_dereg(fr_transport_t *t, fr_mr_t *mr)
{
    fr_fault_t *f = fault_of(t);
    fr_fault_mr_t *m = (fr_fault_mr_t *)(void *)mr;
    if (!m)
        return;
    if (m->prev)
        m->prev->next = m->next;
    else
        f->mrs = m->next;
    if (m->next)
        m->next->prev = m->prev;
    f->ops->dereg(f->in, m->in);
    free(m);
}

static int fault_group_create(fr_transport_t *t, const int *peers,
                              int npeers, fr_mr_t *src,
                              const fr_mr_desc_t *remote, fr_group_t **gp,
                              fr_err_t *err)
{
    fr_fault_t *f = fault_of(t);
    fr_fault_mr_t *s = (fr_fault_mr_t *)(void *)src;
    fr_group_t *in = NULL;
    *gp = NULL;
    /* the inner transport checks the arguments */
    int rc = f->ops->group_create(f->in, peers, npeers, s ? s->in : NULL,
                                  remote, &in, err);
    if (rc != FERRY_OK)
        return rc;
    size_t n = npeers > 0 ? (size_t)npeers : 1;
    fr_fault_group_t *g = calloc(1, sizeof(*g));
    int *rank = calloc(n, sizeof(*rank));
    uint64_t *rlen = calloc(n, sizeof(*rlen));
    if (!g || !rank || !rlen) {
        free(g);
        free(rank);
        free(rlen);
        f->ops->group_destroy(f->in, in);
        return FR_ERR(err, FERRY_ERR_NOMEM, "%s: out of memory",
                      f->ops->name);
    }
    g->in = in;
    g->npeers = npeers;
    g->slen = s ? s->len : 0;
    g->rank = rank;
    g->rlen = rlen;
    for (int i = 0; i < npeers; i++) {
        rank[i] = peers[i];
        rlen[i] = remote[i].len;
    }
    g->next = f->groups;
    if (f->groups)
        f->groups->prev = g;
    f->groups = g;
    *gp = (fr_group_t *)(void *)g;
    return FERRY_OK;
}

static void fault_group_destroy(fr_transport_t *t, fr_group_t *gp)
{
    fr_fault_t *f = fault_of(t);
    fr_fault_group_t *g = (fr_fault_group_t *)(void *)gp;
    if (!g)
        return;
    if (g->nheld > 0) {
        g->dead = 1; /* the last held post of it destroys it */
        return;
    }
    f->ops->group_destroy(f->in, g->in);
    fault_group_free(f, g);
}

/* ------------------------------------------------------------------ */
/* posting                                                             */
/* ------------------------------------------------------------------ */

static int fault_check_slice(const fr_fault_t *f, const fr_fault_group_t *g,
                             int i, const fr_slice_t *s, fr_err_t *err)
{
    return fr_slice_in_bounds(f->ops->name, i, g->rank[i], s, g->slen,
                              g->rlen[i], err);
}

/* Hold one post (room reserved by the caller). */
static void fault_hold(fr_fault_t *f, fr_fault_group_t *g, int index,
                       const fr_slice_t *s, uint64_t ctx, int fence)
{
    fr_fault_held_t h = {0, g, *s, ctx, index, fence};
    fault_hq_push(f, &f->held, h);
    g->nheld++;
}

static int fault_scatter(fr_transport_t *t, fr_group_t *gp,
                         const fr_slice_t *slices, uint64_t ctx,
                         fr_err_t *err)
{
    fr_fault_t *f = fault_of(t);
    fr_fault_group_t *g = (fr_fault_group_t *)(void *)gp;
    int rc;
    if (f->posts && g && (g->npeers == 0 || slices)) {
        for (int i = 0; i < g->npeers; i++)
            if ((rc = fault_check_slice(f, g, i, &slices[i], err)) !=
                FERRY_OK)
                return rc;
        if (fault_hq_reserve(&f->held, g->npeers)) {
            for (int i = 0; i < g->npeers; i++)
                fault_hold(f, g, i, &slices[i], ctx, 0);
            return FERRY_OK;
        }
    }
    /* not held (or no room to hold): the inner transport posts, or
     * refuses, it now */
    return f->ops->scatter(f->in, g ? g->in : NULL, slices, ctx, err);
}

static int fault_barrier(fr_transport_t *t, fr_group_t *gp, uint32_t imm,
                         uint64_t ctx, fr_err_t *err)
{
    fr_fault_t *f = fault_of(t);
    fr_fault_group_t *g = (fr_fault_group_t *)(void *)gp;
    if (f->posts && g && fault_hq_reserve(&f->held, g->npeers)) {
        fr_slice_t s = {0, 0, 0, imm};
        for (int i = 0; i < g->npeers; i++)
            fault_hold(f, g, i, &s, ctx, 0);
        return FERRY_OK;
    }
    return f->ops->barrier(f->in, g ? g->in : NULL, imm, ctx, err);
}

/* write_imm (fence 0) or write_fence (1). */
static int fault_write(fr_fault_t *f, fr_fault_group_t *g, int index,
                       const fr_slice_t *slice, uint64_t ctx, int fence,
                       fr_err_t *err)
{
    int rc;
    /* a fenced write on an instance opened without the fence capability
     * goes to the inner transport, which refuses it */
    int hold = f->posts && (!fence || (f->flags & FR_TP_OPEN_FENCE));
    if (hold && g && slice && index >= 0 && index < g->npeers) {
        if ((rc = fault_check_slice(f, g, index, slice, err)) != FERRY_OK)
            return rc;
        if (fault_hq_reserve(&f->held, 1)) {
            fault_hold(f, g, index, slice, ctx, fence);
            return FERRY_OK;
        }
    }
    fr_group_t *in = g ? g->in : NULL;
    return fence ? f->ops->write_fence(f->in, in, index, slice, ctx, err)
                 : f->ops->write_imm(f->in, in, index, slice, ctx, err);
}

static int fault_write_imm(fr_transport_t *t, fr_group_t *g, int index,
                           const fr_slice_t *slice, uint64_t ctx,
                           fr_err_t *err)
{
    return fault_write(fault_of(t), (fr_fault_group_t *)(void *)g, index,
                       slice, ctx, 0, err);
}

static int fault_write_fence(fr_transport_t *t, fr_group_t *g, int index,
                             const fr_slice_t *slice, uint64_t ctx,
                             fr_err_t *err)
{
    return fault_write(fault_of(t), (fr_fault_group_t *)(void *)g, index,
                       slice, ctx, 1, err);
}

/* ------------------------------------------------------------------ */
/* progress                                                            */
/* ------------------------------------------------------------------ */

/* A released post the inner transport refused comes back as FR_CQE_ERR
 * from this or a later poll, as every post does that fails after its
 * call returned. */
static void fault_post_failed(fr_fault_t *f, const fr_fault_held_t *h,
                              int status)
{
    if (f->nfailed == f->capfailed) {
        int cap = f->capfailed ? 2 * f->capfailed : 16;
        void *p = realloc(f->failed, sizeof(*f->failed) * (size_t)cap);
        if (!p) {
            FR_LOG_ERR(FR_SUB_NET, "fault injection: out of memory; the "
                       "failure of a post to rank %d (ctx %llu) is lost",
                       h->g->rank[h->index], (unsigned long long)h->ctx);
            return;
        }
        f->failed = p;
        f->capfailed = cap;
    }
    f->failed[f->nfailed++] = (fr_cqe_t){FR_CQE_ERR, h->slice.imm,
                                         h->g->rank[h->index], status,
                                         h->ctx};
}

/* Post held posts that are due. */
static void fault_release_posts(fr_fault_t *f, fr_err_t *err)
{
    uint64_t now = fr_now_ns();
    fr_fault_held_t h;
    while (fault_hq_pop(f, &f->held, now, &h)) {
        int rc = h.fence ? f->ops->write_fence(f->in, h.g->in, h.index,
                                               &h.slice, h.ctx, err)
                         : f->ops->write_imm(f->in, h.g->in, h.index,
                                             &h.slice, h.ctx, err);
        if (rc != FERRY_OK)
            fault_post_failed(f, &h, rc);
        fault_group_unhold(f, h.g);
    }
}

/* Hand out held arrivals that are due. */
static int fault_release_arrivals(fr_fault_t *f, fr_cqe_t *out, int max)
{
    int n = 0;
    uint64_t now = fr_now_ns();
    fr_fault_held_t h;
    while (n < max && fault_hq_pop(f, &f->arrivals, now, &h))
        out[n++] = (fr_cqe_t){FR_CQE_RX, h.slice.imm, -1, FERRY_OK, 0};
    return n;
}

/* Hold back the arrivals among c[0..n); returns how many entries stay
 * (kept in order at the front). */
static int fault_hold_arrivals(fr_fault_t *f, fr_cqe_t *c, int n)
{
    int kept = 0;
    for (int i = 0; i < n; i++) {
        fr_fault_held_t h = {0, NULL, {0, 0, 0, c[i].imm}, 0, 0, 0};
        if (c[i].kind == FR_CQE_RX && fault_hq_push(f, &f->arrivals, h))
            continue; /* released by a later poll */
        c[kept++] = c[i];
    }
    return kept;
}

static int fault_poll(fr_transport_t *t, fr_cqe_t *out, int max,
                      fr_err_t *err)
{
    fr_fault_t *f = fault_of(t);
    int n = 0;
    if (f->held.n)
        fault_release_posts(f, err);
    if (f->nfailed > 0 && max > 0) {
        n = f->nfailed < max ? f->nfailed : max;
        memcpy(out, f->failed, sizeof(*out) * (size_t)n);
        memmove(f->failed, f->failed + n,
                sizeof(*out) * (size_t)(f->nfailed - n));
        f->nfailed -= n;
    }
    if (f->arrivals.n)
        n += fault_release_arrivals(f, out + n, max - n);
    /* as many as the inner transport has, up to max, even when some of
     * them are held back */
    while (n < max) {
        int want = max - n;
        int got = f->ops->poll(f->in, out + n, want, err);
        if (got < 0) /* what was taken out already is not lost: the next
                      * poll meets the inner transport's error again */
            return n > 0 ? n : got;
        n += f->hold_arrivals ? fault_hold_arrivals(f, out + n, got) : got;
        if (got < want)
            break;
    }
    return n;
}

static int fault_pending(fr_transport_t *t)
{
    fr_fault_t *f = fault_of(t);
    long p = (long)f->ops->pending(f->in) + f->held.n + f->nfailed;
    return p > 0x7fffffff ? 0x7fffffff : (int)p;
}

static int fault_has_peer(fr_transport_t *t, int rank)
{
    return t && fault_of(t)->ops->has_peer(fault_of(t)->in, rank);
}

static const char *fault_iface(fr_transport_t *t)
{
    return fault_of(t)->ops->iface(fault_of(t)->in);
}

static const char *fault_provider(fr_transport_t *t)
{
    return fault_of(t)->ops->provider(fault_of(t)->in);
}

/* The inner transport's counters (posts held here are counted once the
 * inner transport is called). */
static void fault_tp_stats(fr_transport_t *t, fr_tp_stats_t *out)
{
    fr_fault_t *f = fault_of(t);
    *out = (fr_tp_stats_t){0};
    if (f->ops->stats)
        f->ops->stats(f->in, out);
}

const fr_transport_ops_t fr_transport_fault = {
    .size = sizeof(fr_transport_ops_t),
    .name = "fault",
    .open = fault_open,
    .reg = fault_reg,
    .dereg = fault_dereg,
    .group_create = fault_group_create,
    .group_destroy = fault_group_destroy,
    .scatter = fault_scatter,
    .barrier = fault_barrier,
    .write_imm = fault_write_imm,
    .poll = fault_poll,
    .pending = fault_pending,
    .close = fault_close,
    .provider = fault_provider,
    .has_peer = fault_has_peer,
    .iface = fault_iface,
    .fence_probe = fault_fence_probe,
    .write_fence = fault_write_fence,
    .hmem_probe = fault_hmem_probe,
    .reg_dev = fault_reg_dev,
    .stats = fault_tp_stats,
};
