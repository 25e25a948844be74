/* Command-line numbers, whole and in range (opt.h). */
#include "opt.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int fr_opt_num(const char *s, const char *end, long lo, long hi, long *out)
{
    char buf[32];
    size_t n = end ? (size_t)(end - s) : strlen(s);
    /* a sign or a digit first: strtol would skip spaces */
    if (n == 0 || n >= sizeof(buf) || !(isdigit((unsigned char)s[0]) || s[0] == '-' ||
                                        s[0] == '+'))
        return -1;
    memcpy(buf, s, n);
    buf[n] = 0;
    char *e = NULL;
    errno = 0;
    long x = strtol(buf, &e, 10);
    if (errno || e == buf || *e || x < lo || x > hi)
        return -1;
    *out = x;
    return 0;
}

int fr_opt_int(const char *tool, const char *name, const char *arg, long lo, long hi,
               int *out)
{
    long x;
    if (fr_opt_num(arg, NULL, lo, hi, &x) != 0) {
        fprintf(stderr, "%s: --%s %s: a whole number, %ld..%ld\n", tool, name, arg, lo, hi);
        return -1;
    }
    *out = (int)x;
    return 0;
}

int fr_opt_u64(const char *tool, const char *name, const char *arg, uint64_t *out)
{
    char *e = NULL;
    errno = 0;
    unsigned long long x = isdigit((unsigned char)arg[0]) ? strtoull(arg, &e, 10) : 0;
    if (!e || errno || *e) {
        fprintf(stderr, "%s: --%s %s: a whole number, 0..%llu\n", tool, name, arg,
                (unsigned long long)UINT64_MAX);
        return -1;
    }
    *out = (uint64_t)x;
    return 0;
}

int fr_opt_list(const char *tool, const char *name, const char *arg, long lo, long hi,
                int *v, int max)
{
    int n = 0;
    const char *p = arg;
    for (;;) {
        const char *c = strchr(p, ',');
        long x;
        if (n == max) {
            fprintf(stderr, "%s: --%s %s: at most %d values\n", tool, name, arg, max);
            return -1;
        }
        if (fr_opt_num(p, c, lo, hi, &x) != 0) {
            fprintf(stderr, "%s: --%s %s: numbers, separated by commas, each a whole number "
                    "%ld..%ld\n", tool, name, arg, lo, hi);
            return -1;
        }
        v[n++] = (int)x;
        if (!c)
            return n;
        p = c + 1;
    }
}
