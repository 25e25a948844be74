/*
 * NVLink domains as nodes (fr_dom_keys): two hosts of one domain become one
 * node when their ranks share a kernel (descriptors) or every rank can use
 * fabric handles (the whole job one domain); not when one rank cannot
 * (named), when domains across kernels leave several nodes, when FERRY_NODE_ID is
 * set anywhere, when a rank is outside any domain, or when one host's
 * ranks report different domains (named).
 */
#include <stdio.h>
#include <string.h>

#include "ep/ep.h"
#include "harness.h"

#define N 8

static fr_peer_info_t peers[N];
static fr_dom_t d[N];
static char keys[N][FR_NODE_ID_LEN];

/* 2 hosts x 4 ranks, all in domain "A", fdkey per host unless same_kernel */
static void setup(int same_kernel, int fabric_ok)
{
    memset(peers, 0, sizeof(peers));
    memset(d, 0, sizeof(d));
    for (int i = 0; i < N; i++) {
        snprintf(peers[i].node, sizeof(peers[i].node), "host%d", i / 4);
        d[i].has = 1;
        d[i].fabric_ok = fabric_ok;
        snprintf(d[i].dom, sizeof(d[i].dom), "A");
        snprintf(d[i].fdkey, sizeof(d[i].fdkey), "%.60s", same_kernel ? "box:1" : peers[i].node);
        snprintf(d[i].why, sizeof(d[i].why), "no IMEX channel");
    }
}

static int one_node(void)
{
    for (int i = 1; i < N; i++)
        if (strcmp(keys[i], keys[0]) != 0)
            return 0;
    return 1;
}

static int hosts_kept(void)
{
    for (int i = 0; i < N; i++)
        if (strcmp(keys[i], peers[i].node) != 0)
            return 0;
    return 1;
}

int main(void)
{
    char why[256];
    int cross = -1;
    /* simulated hosts on one kernel: joined, descriptors do (no cross) */
    setup(1, 0);
    CHECK(fr_dom_keys(N, peers, d, keys, &cross, why, sizeof(why)) == 1, "joined");
    CHECK(one_node() && cross == 0, "one node, cross %d", cross);
    /* real hosts, every rank can use fabric handles: joined, cross */
    setup(0, 1);
    CHECK(fr_dom_keys(N, peers, d, keys, &cross, why, sizeof(why)) == 1, "joined");
    CHECK(one_node() && cross == 1, "one node, cross %d", cross);
    /* real hosts, rank 5 cannot: hosts kept, rank 5 and its reason named */
    setup(0, 1);
    d[5].fabric_ok = 0;
    CHECK(fr_dom_keys(N, peers, d, keys, &cross, why, sizeof(why)) == 0, "not joined");
    CHECK(hosts_kept() && cross == 0, "hosts kept");
    CHECK(strstr(why, "rank 5") && strstr(why, "no IMEX channel"), "why: %s", why);
    /* FERRY_NODE_ID on one rank: nodes as given */
    setup(1, 1);
    peers[3].node_set = 1;
    CHECK(fr_dom_keys(N, peers, d, keys, &cross, why, sizeof(why)) == 0 && hosts_kept(),
          "FERRY_NODE_ID");
    /* a rank outside any domain: hosts */
    setup(1, 1);
    d[6].has = 0;
    CHECK(fr_dom_keys(N, peers, d, keys, &cross, why, sizeof(why)) == 0 && hosts_kept(),
          "rank without a domain");
    /* one host, two domains: hosts kept, named */
    setup(1, 1);
    snprintf(d[2].dom, sizeof(d[2].dom), "B");
    CHECK(fr_dom_keys(N, peers, d, keys, &cross, why, sizeof(why)) == 0 && hosts_kept(),
          "split host");
    CHECK(strstr(why, "share host host0") != NULL, "why: %s", why);
    /* two domains, each on its own pair of hosts: two nodes of 2 hosts each */
    setup(0, 1);
    for (int i = 0; i < N; i++) {
        snprintf(peers[i].node, sizeof(peers[i].node), "host%d", i / 2);
        snprintf(d[i].fdkey, sizeof(d[i].fdkey), "%.60s", peers[i].node);
        snprintf(d[i].dom, sizeof(d[i].dom), "%s", i < 4 ? "A" : "B");
    }
    /* ... across kernels: not joined while other nodes remain (segments
     * with fabric peers stay on legacy IPC), named */
    CHECK(fr_dom_keys(N, peers, d, keys, &cross, why, sizeof(why)) == 0 && hosts_kept() &&
              cross == 0,
          "two domains across kernels");
    CHECK(strstr(why, "holds every rank") != NULL, "why: %s", why);
    /* ... on one kernel each (simulated hosts): joined, two nodes */
    for (int i = 0; i < N; i++)
        snprintf(d[i].fdkey, sizeof(d[i].fdkey), "box:%d", i / 4);
    CHECK(fr_dom_keys(N, peers, d, keys, &cross, why, sizeof(why)) == 1, "joined");
    CHECK(strcmp(keys[0], keys[3]) == 0 && strcmp(keys[4], keys[7]) == 0 &&
              strcmp(keys[0], keys[4]) != 0 && cross == 0,
          "two domains: %s %s %s", keys[0], keys[3], keys[4]);
    /* each host a domain of its own: nothing joined */
    setup(0, 1);
    for (int i = 0; i < N; i++)
        snprintf(d[i].dom, sizeof(d[i].dom), "D%d", i / 4);
    CHECK(fr_dom_keys(N, peers, d, keys, &cross, why, sizeof(why)) == 0 && hosts_kept(),
          "a domain per host");
    if (fr_test_result() == 0)
        printf("domain: hosts joined by an NVLink domain (descriptors on one kernel, fabric "
               "handles across), kept where a rank cannot (named), FERRY_NODE_ID, a rank "
               "outside, a split host\n");
    return fr_test_result();
}
