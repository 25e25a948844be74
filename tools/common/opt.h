/*
 * Command-line numbers for the tools: a whole decimal number in a stated
 * range, or an error naming the option. strtol's value cast to int wrapped
 * (-n 4294967298 ran 2 ranks); these refuse what does not fit instead.
 */
#ifndef FW_OPT_H
#define FW_OPT_H

#include <stdint.h>

/* arg as a whole decimal number lo..hi: 0 and *out set; else -1 after
 * "TOOL: --NAME ARG: a whole number, lo..hi" on stderr (*out untouched). */
int fr_opt_int(const char *tool, const char *name, const char *arg, long lo, long hi,
               int *out);
/* The same for 0..2^64-1 (no sign). */
int fr_opt_u64(const char *tool, const char *name, const char *arg, uint64_t *out);
/* arg as numbers lo..hi separated by commas, at most max of them, into v:
 * their count, else -1 after a message naming the option. */
int fr_opt_list(const char *tool, const char *name, const char *arg, long lo, long hi,
                int *v, int max);
/* s (up to end, or its end when end is NULL) as a whole decimal number
 * lo..hi: 0 and *out set, else -1. Prints nothing. */
int fr_opt_num(const char *s, const char *end, long lo, long hi, long *out);

#endif
