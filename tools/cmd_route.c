/*
 * pagekv route: the router in front of prefill and decode nodes (include/pagekv/router.h,
 * docs/design/router.md).
 *
 * Signals: SIGTERM and SIGINT are blocked in every thread and taken by the main thread
 * with sigwait. The first one drains: new requests get 503, the ones in flight go on for
 * up to --drain-timeout; a second signal ends them at once. Either way the process exits
 * 0 after a full teardown.
 */
#include "support/cli.h"
#include "tools/commands.h"

#include "pagekv/pagekv.h"
#include "pagekv/router.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#define PROCEED (-1)

static void usage(FILE *f)
{
    fprintf(
        f, "usage: pagekv route --prefill URL [--prefill URL ...] --decode URL [--decode URL ...]\n"
           "                    [--host H] [--port N] [--policy "
           "cache_aware|least_loaded|round_robin]\n"
           "\n"
           "An OpenAI-compatible front for `pagekv serve --role prefill|decode` nodes: each\n"
           "completion or chat request runs its prefill leg on a prefill node and its decode\n"
           "leg on a decode node; the decode node's answer is relayed (streamed or not).\n"
           "Also /v1/models (from the nodes), /health, /metrics.\n"
           "\n"
           "  --prefill URL             a prefill node, http://HOST:PORT (1..64)\n"
           "  --decode URL              a decode node, http://HOST:PORT (1..64)\n"
           "  --host ADDR               address to listen on (default 127.0.0.1)\n"
           "  --port N                  port (default 8000; 0 = pick a free one)\n"
           "  --policy NAME             prefill node choice: cache_aware (default: ask each\n"
           "                            node how much of the prompt it holds), least_loaded,\n"
           "                            round_robin (decode nodes: least_loaded or round_robin)\n"
           "  --max-connections N       client connections; beyond: 503 (default 4096)\n"
           "  --max-body-bytes BYTES    request body limit, K/M/G suffixes (default 4M)\n"
           "  --request-timeout-ms N    a request's deadline for its first output, retries\n"
           "                            included (default 60000)\n"
           "  --node-timeout-ms N       a node's longest silence in one attempt (default 30000)\n"
           "  --lookup-timeout-ms N     cache lookups and health probes (default 1000)\n"
           "  --health-interval-ms N    probe every node's /health this often (default 1000)\n"
           "  --node-max-in-flight N    legs one node serves at once; more wait (default 128)\n"
           "  --stream-buffer-bytes BYTES  a stream's bytes held for a slow client before\n"
           "                            the node's transfer pauses, K/M suffixes (default 256K)\n"
           "  --drain-timeout SECONDS   on SIGTERM, wait this long for requests (default 30)\n");
}

static bool url_ok(const char *v)
{
    size_t n = strlen(v);
    if (n <= 7 || n >= 256 || strncmp(v, "http://", 7)) return false;
    for (size_t i = 0; i < n; i++)
        if (v[i] <= 0x20 || v[i] >= 0x7f) return false;
    return true;
}

typedef struct {
    pkv_router_config_t cfg;
    const char *prefill[PKV_ROUTER_MAX_NODES], *decode[PKV_ROUTER_MAX_NODES];
    uint32_t drain_s, port;
} route_args_t;

static int set_option(const char *a, const char *v, route_args_t *ra)
{
    pkv_router_config_t *cfg = &ra->cfg;
    if (!strcmp(a, "--prefill") || !strcmp(a, "--decode")) {
        bool p = !strcmp(a, "--prefill");
        uint32_t *n = p ? &cfg->n_prefill : &cfg->n_decode;
        if (!url_ok(v))
            return pkv_cli_usage_error("route", "%s wants http://HOST:PORT, got '%s'", a, v);
        if (*n >= PKV_ROUTER_MAX_NODES)
            return pkv_cli_usage_error("route", "%s: at most %u nodes", a, PKV_ROUTER_MAX_NODES);
        (p ? ra->prefill : ra->decode)[(*n)++] = v;
    } else if (!strcmp(a, "--host"))
        cfg->host = v;
    else if (!strcmp(a, "--port"))
        return pkv_cli_flag_u32("route", a, v, 0, 65535, &ra->port);
    else if (!strcmp(a, "--policy")) {
        if (pkv_router_policy_parse(v, &cfg->policy))
            return pkv_cli_usage_error(
                "route", "--policy wants cache_aware, least_loaded or round_robin, got '%s'", v);
    } else if (!strcmp(a, "--max-connections"))
        return pkv_cli_flag_u32("route", a, v, 1, 1u << 20, &cfg->max_connections);
    else if (!strcmp(a, "--max-body-bytes")) {
        if (pkv_cli_parse_bytes(v, &cfg->max_body_bytes) || cfg->max_body_bytes < 64)
            return pkv_cli_usage_error("route",
                                       "--max-body-bytes wants a size >= 64 bytes, got '%s'", v);
    } else if (!strcmp(a, "--request-timeout-ms"))
        return pkv_cli_flag_u32("route", a, v, 1, 86400000, &cfg->request_timeout_ms);
    else if (!strcmp(a, "--node-timeout-ms"))
        return pkv_cli_flag_u32("route", a, v, 1, 86400000, &cfg->node_timeout_ms);
    else if (!strcmp(a, "--lookup-timeout-ms"))
        return pkv_cli_flag_u32("route", a, v, 1, 600000, &cfg->lookup_timeout_ms);
    else if (!strcmp(a, "--health-interval-ms"))
        return pkv_cli_flag_u32("route", a, v, 10, 3600000, &cfg->health_interval_ms);
    else if (!strcmp(a, "--stream-buffer-bytes")) {
        if (pkv_cli_parse_bytes(v, &cfg->stream_buffer_bytes) || cfg->stream_buffer_bytes < 4096 ||
            cfg->stream_buffer_bytes > (64u << 20))
            return pkv_cli_usage_error(
                "route", "--stream-buffer-bytes wants a size in 4K..64M, got '%s'", v);
    } else if (!strcmp(a, "--node-max-in-flight"))
        return pkv_cli_flag_u32("route", a, v, 1, 1u << 20, &cfg->node_max_in_flight);
    else if (!strcmp(a, "--drain-timeout"))
        return pkv_cli_flag_u32("route", a, v, 0, 86400, &ra->drain_s);
    else
        return pkv_cli_usage_error("route", "unknown option %s (see pagekv route --help)", a);
    return 0;
}

static int parse_args(int argc, char **argv, route_args_t *ra)
{
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        if (i + 1 >= argc)
            return pkv_cli_usage_error("route", "unknown option or missing value: %s", a);
        int bad = set_option(a, argv[++i], ra);
        if (bad) return bad;
    }
    if (!ra->cfg.n_prefill || !ra->cfg.n_decode)
        return pkv_cli_usage_error("route",
                                   "needs at least one --prefill URL and one --decode URL");
    ra->cfg.port = (uint16_t)ra->port;
    ra->cfg.prefill = ra->prefill;
    ra->cfg.decode = ra->decode;
    return PROCEED;
}

/* Many clients: as many descriptors as the hard limit allows. */
static void raise_nofile(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
}

static void drain(pkv_router_t *r, const sigset_t *sigs, int sig, uint32_t drain_s)
{
    fprintf(stderr, "pagekv route: %s: draining (up to %u s)\n",
            sig == SIGINT ? "SIGINT" : "SIGTERM", drain_s);
    pkv_router_quiesce(r);
    uint64_t deadline = pkv_deadline_after_ns((uint64_t)drain_s * 1000000000ull);
    for (;;) {
        uint64_t slice = pkv_deadline_after_ns(100ull * 1000 * 1000);
        if (pkv_router_wait_idle(r, slice < deadline ? slice : deadline) == PKV_OK) return;
        if (pkv_now_ns() >= deadline) break;
        struct timespec zero = {0, 0};
        if (sigtimedwait(sigs, NULL, &zero) >= 0) break;
    }
    fprintf(stderr, "pagekv route: ending the requests still in flight\n");
}

int pkv_cmd_route(int argc, char **argv)
{
    route_args_t ra = {.drain_s = 30, .port = 8000};
    int rc = parse_args(argc, argv, &ra);
    if (rc != PROCEED) return rc;
    raise_nofile();
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);
    pkv_router_t *r = NULL;
    rc = pkv_router_create(&ra.cfg, &r);
    if (rc) {
        fprintf(stderr, "pagekv route: cannot start: %s\n", pkv_status_str(rc));
        return 1;
    }
    const char *host = ra.cfg.host ? ra.cfg.host : "127.0.0.1";
    bool v6 = strchr(host, ':') != NULL;
    printf("pagekv route: listening on http://%s%s%s:%u\n", v6 ? "[" : "", host, v6 ? "]" : "",
           pkv_router_port(r));
    fflush(stdout);
    fprintf(stderr, "pagekv route: %u prefill, %u decode nodes, policy %s\n", ra.cfg.n_prefill,
            ra.cfg.n_decode, pkv_router_policy_name(ra.cfg.policy));
    int sig = 0;
    while (sigwait(&sigs, &sig) != 0) {
    }
    drain(r, &sigs, sig, ra.drain_s);
    pkv_router_destroy(r);
    fprintf(stderr, "pagekv route: stopped\n");
    return 0;
}
