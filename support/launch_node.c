/*
 * The node command lines the disaggregation benchmarks, the resharding bench and its test
 * share (support/launch.h, "nodes"): a `pagekv serve` node, in a network namespace or
 * here, and a `pagekv route` in front of a prefill and a decode node.
 */
#include "support/launch.h"

#include "core/core.h"

#include <stdio.h>

#define NODE_ARGV_MAX 48
#define NODE_START_NS 120000000000ull

/* argv[*n...] = extra (NULL-terminated, may be NULL), within NODE_ARGV_MAX. */
static void node_argv_extra(char **argv, int *n, char *const extra[])
{
    for (size_t i = 0; extra && extra[i] && *n < NODE_ARGV_MAX - 1; i++) argv[(*n)++] = extra[i];
    argv[*n] = NULL;
}

static int node_start(launch_proc_t *p, const char *name, char *const argv[], bool tcp,
                      const char *dev, const char *logdir)
{
    char devs[64];
    snprintf(devs, sizeof(devs), "UCX_NET_DEVICES=%s", dev ? dev : "");
    char *env[3] = {NULL, NULL, NULL};
    int ne = 0;
    if (tcp) env[ne++] = "UCX_TLS=tcp";
    if (dev) env[ne++] = devs;
    char err[1024];
    if (launch_start(p, name, argv, env, logdir, pkv_now_ns() + NODE_START_NS, err, sizeof(err)) !=
        0) {
        fprintf(stderr, "pagekv bench: %s\n", err);
        return -1;
    }
    return 0;
}

int launch_serve(const char *bin, const char *logdir, const char *name, const char *preset,
                 uint32_t ctx, const char *role, char *const extra[], bool tcp,
                 const launch_place_t *at, launch_proc_t *p)
{
    char cs[16], kv[64];
    snprintf(cs, sizeof(cs), "%u", ctx);
    char *argv[NODE_ARGV_MAX];
    int n = 0;
    if (at) {
        snprintf(kv, sizeof(kv), "%s:0", at->kv_host);
        char *pre[] = {(char *)at->ip_bin, "netns", "exec", (char *)at->netns, NULL};
        node_argv_extra(argv, &n, pre);
    }
    char *base[] = {(char *)bin,
                    "serve",
                    "--port",
                    "0",
                    "--preset",
                    (char *)preset,
                    "--max-context",
                    cs,
                    "--kv-cache-budget",
                    "none",
                    NULL};
    node_argv_extra(argv, &n, base);
    if (at) {
        char *place[] = {"--host", (char *)at->host, "--kv-listen", kv, NULL};
        node_argv_extra(argv, &n, place);
    }
    if (role) {
        char *r[] = {"--role", (char *)role, "--kv-lease-ms", "600000", "--kv-transfer-timeout-ms",
                     "60000",  NULL};
        node_argv_extra(argv, &n, r);
    }
    node_argv_extra(argv, &n, extra);
    return node_start(p, name, argv, tcp, at ? at->kv_dev : NULL, logdir);
}

int launch_route(const char *bin, const char *logdir, const char *name, const launch_proc_t *pre,
                 const launch_proc_t *dec, char *const extra[], launch_proc_t *p)
{
    char *argv[NODE_ARGV_MAX] = {(char *)bin, "route",          "--port",   "0",
                                 "--prefill", (char *)pre->url, "--decode", (char *)dec->url};
    int n = 8;
    node_argv_extra(argv, &n, extra);
    return node_start(p, name, argv, false, NULL, logdir);
}
