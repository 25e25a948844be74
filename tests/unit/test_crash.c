/* A rank that aborts inside malloc (a corrupted heap: glibc aborts in
 * free() holding its arena lock) dies and its launcher reports it, instead
 * of hanging in the backtrace handler libinfinipath installs for SIGABRT
 * (fr_launch_drop_psm_handlers, tools/common/launch.h). Without that, this
 * test hangs until the harness's time limit. */
#include <dlfcn.h>
#include <link.h>
#include <malloc.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "launch.h"

static int fr_has_ipath(struct dl_phdr_info *info, size_t size, void *found)
{
    (void)size;
    if (info->dlpi_name && strstr(info->dlpi_name, "libinfinipath"))
        *(int *)found = 1;
    return 0;
}

int main(void)
{
    int ipath = 0;
    dl_iterate_phdr(fr_has_ipath, &ipath);
    int is_child = 0, status[2] = {-1, -1};
    fr_err_t err = {{0}};
    int rc = fr_launch_local_ex(2, &is_child, status, &err);
    if (is_child) {
        const char *r = getenv("FERRY_RANK");
        if (r && atoi(r) == 1) {
            char *a = malloc(4000), *b = malloc(4000);
            size_t u = malloc_usable_size(a);
            /* zero the next chunk's size word too: free(a) aborts */
            volatile char *p = a;
            for (size_t i = 0; i < u + sizeof(size_t); i++)
                p[i] = 0;
            free(a);
            free(b);
        }
        _exit(0);
    }
    CHECK(rc > 0, "launch returned %d (%s), want the dead rank's status\n", rc, err.msg);
    CHECK(status[0] == 0, "rank 0: status %d\n", status[0]);
#ifdef __SANITIZE_ADDRESS__
    /* the sanitizer reports the overflow and exits non-zero first */
    CHECK(status[1] != 0 && status[1] != -1, "rank 1: status %d\n", status[1]);
#else
    /* glibc's abort, nothing else: with libinfinipath's handler left in
     * place the rank hangs, or crashes again inside it (SIGSEGV, 139) */
    CHECK(status[1] == 128 + SIGABRT, "rank 1: status %d, want %d (SIGABRT)\n", status[1],
          128 + SIGABRT);
#endif
    printf("test_crash: rank 1 ended with status %d (libinfinipath %s); %d failures\n",
           status[1], ipath ? "loaded" : "not loaded", fr_test_failures);
    return fr_test_result();
}
