/*
 * Two network namespaces joined by a veth pair: two "hosts" on one machine, for the tests
 * and benchmarks that run a prefill and a decode node apart (support/: compiled once into
 * build/libpkvsupport.a). Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN) and iproute2's `ip`.
 *
 * Layout, for an id derived from the pid (names fit IFNAMSIZ, subnets are /30s of
 * 10.O1.O2.0/24):
 *   namespace A "pkv-a-ID"  --- veth pkva-ID / pkvb-ID (the link: .1 in A, .2 in B) ---
 *   namespace B "pkv-b-ID";
 *   with root links, each namespace also has a veth to the caller's namespace (A: .5 here,
 *   .6 in A; B: .9 here, .10 in B), so a process here (a router, a load driver) reaches
 *   servers that listen on those addresses, while what the two namespaces send each other
 *   (the KV over UCX, on addresses of the link) stays on the link between them.
 *
 * Teardown: netns_pair_destroy deletes both namespaces (each veth goes with the namespace
 * that holds an end). A guard process forked at create does the same when the creating
 * process ends any other way (a crash, SIGKILL): it waits on a pipe only the creator
 * holds, ignores SIGINT / SIGTERM / SIGHUP and leaves the terminal's process group, so a
 * Ctrl-C that stops the creator never stops the cleanup.
 */
#ifndef PKV_SUPPORT_NETNS_H
#define PKV_SUPPORT_NETNS_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#define NETNS_NAME_MAX 24
#define NETNS_IP_MAX   20

typedef struct {
    char ip_bin[32];               /* the `ip` binary (for `ip netns exec NAME ...`) */
    char ns[2][NETNS_NAME_MAX];    /* namespace names: [0] A, [1] B */
    char ip[2][NETNS_IP_MAX];      /* each namespace's address on the link between them */
    char root_ip[2][NETNS_IP_MAX]; /* with root links: each namespace's address on its link
                                      to the creator's namespace; "" without */
    char dev[2][NETNS_NAME_MAX];   /* each namespace's end of the link between them (for
                                      UCX_NET_DEVICES: with root links a namespace has two) */
    char veth[3][NETNS_NAME_MAX];  /* ends made in the creator's namespace (cleanup) */
    int home_fd;                   /* the creator's network namespace (netns_pair_enter) */
    int guard_fd;                  /* write end of the guard's pipe, -1 once destroyed */
    pid_t guard;
} netns_pair_t;

/* Create the pair (root_links: the two links to the caller's namespace too) and start the
 * guard. 0; or -1 with the reason in err (not root, no iproute2, a name in use, ...), and
 * whatever was half made is deleted again. *np is valid for netns_pair_destroy either way. */
int netns_pair_create(netns_pair_t *np, bool root_links, char *err, size_t errcap);
/* Delete both namespaces and stop the guard; a no-op when already destroyed. Processes
 * still inside a namespace keep it alive until they exit (the name is gone at once). */
void netns_pair_destroy(netns_pair_t *np);
/* Move the calling thread's new sockets into namespace `name` (one of np->ns), or back to
 * the creator's (name NULL). 0, or -1 (errno set). */
int netns_pair_enter(const netns_pair_t *np, const char *name);

#endif
