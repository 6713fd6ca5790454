/*
 * pagekv bench footprint: the server process, started with the launcher
 * (support/launch.h) with its output in a log file of its own; ready once it listens and
 * answers /health; stopped with SIGTERM (SIGKILL after 30 s).
 */
#include "footprint.h"

#include "core/core.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int fp_server_spawn(const fp_opts_t *o, fp_run_t *run, const char *const *argv, launch_proc_t *out)
{
    snprintf(run->log_path, sizeof(run->log_path), "/tmp/pagekv-footprint-%d-XXXXXX",
             (int)getpid());
    int lfd = mkstemp(run->log_path);
    if (lfd < 0) {
        snprintf(run->error, sizeof(run->error), "mkstemp: %s", strerror(errno));
        return PKV_ERR_IO;
    }
    close(lfd);
    const char *args[FP_MAX_PASS + 24];
    size_t n = 0;
    for (; argv[n] && n + 1 < PKV_ARRAY_LEN(args); n++) args[n] = argv[n];
    args[0] = o->server_bin; /* argv[0] names it "pagekv" in the report */
    args[n] = NULL;
    launch_spec_t spec = {.name = "server",
                          .argv = (char *const *)args,
                          .log_path = run->log_path,
                          .death_signal = SIGTERM};
    run->start_ns = pkv_now_ns();
    if (launch_spawn(out, &spec, run->error, sizeof(run->error)) != 0) return PKV_ERR_IO;
    return PKV_OK;
}

int fp_server_wait_ready(fp_run_t *run, launch_proc_t *srv)
{
    uint64_t deadline = pkv_deadline_after_ns(300 * FP_NS);
    char err[400];
    if (launch_wait_listening(srv, false, deadline, err, sizeof(err)) != 0) {
        snprintf(run->error, sizeof(run->error), "%s (log %s)", err, run->log_path);
        return PKV_ERR_IO;
    }
    while (!launch_reap(srv) && pkv_now_ns() < deadline) {
        json_t *j = NULL;
        if (fp_http_json(srv->port, "GET", "/health", 2.0, &j, err, sizeof(err)) == 0) {
            json_decref(j);
            run->ready_ns = pkv_now_ns();
            return PKV_OK;
        }
        usleep(100000);
    }
    char tail[400];
    launch_log_tail(srv, tail, sizeof(tail));
    if (srv->reaped)
        snprintf(run->error, sizeof(run->error),
                 "the server exited (code %d) before it was ready; log %s ends: %s",
                 launch_exit_code(srv->wstatus), run->log_path, tail);
    else
        snprintf(run->error, sizeof(run->error),
                 "the server was not ready within 300 s (port %u); log %s ends: %s", srv->port,
                 run->log_path, tail);
    launch_stop(srv, SIGKILL, pkv_now_ns() + 10 * FP_NS);
    return PKV_ERR_IO;
}

void fp_exit_text(int code, char *out, size_t cap)
{
    if (code == FP_SERVER_KILLED)
        snprintf(out, cap, "SIGKILL after 30 s");
    else if (code >= 0 && code < 128)
        snprintf(out, cap, "exit %d", code);
    else if (code >= 128)
        snprintf(out, cap, "signal %d", code - 128);
    else
        snprintf(out, cap, "not started");
}

int fp_server_stop(launch_proc_t *s)
{
    int code = launch_stop(s, SIGTERM, pkv_deadline_after_ns(30 * FP_NS));
    return s->killed ? FP_SERVER_KILLED : code;
}
