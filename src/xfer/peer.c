/*
 * xfer peers: one UCX endpoint per connection, always in peer error-handling mode with
 * an error callback (only such an endpoint reports the other side's death). A consumer
 * connects to the producer's listener (outgoing peer); the producer creates its own
 * endpoint from the connection request (incoming peer). Both sides send HEARTBEAT every
 * heartbeat_ns and count any message as a sign of life; a peer silent for
 * peer_timeout_ns, or whose endpoint reports an error, is failed: its transfers end
 * peer_lost at once, the endpoint is force-closed from the loop, and the peer is freed
 * once no transfer and no request refers to it (requests still pending XF_CLOSE_WAIT_NS
 * after the close are written off and the peer is kept, never reused).
 *
 * Control messages are UCX active messages (eager only, reply-ep flag set so the
 * receiver knows which endpoint they came on). Payload arrives as tag messages; any
 * payload message no posted receive wanted (its transfer ended) is drained here into a
 * discarding datatype, so a sender never waits on a receiver that gave up.
 *
 * Every function here runs on the progress thread.
 */
#include "xfer/xfer_int.h"

#include "prim/prim.h"

#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

int xf_sockaddr_parse(const char *addr, struct sockaddr_storage *ss, socklen_t *len);

static void peer_drop_queued(xf_peer_t *p);
static void send_hello(pkv_xfer_agent_t *a, xf_peer_t *p);

static void peer_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    xf_peer_t *p = arg;
    (void)ep;
    if (p->err == UCS_OK) p->err = status;
}

static xf_peer_t *peer_new(pkv_xfer_agent_t *a, bool outgoing)
{
    xf_peer_t *p = calloc(1, sizeof(*p));
    if (!p) return NULL;
    p->id = a->next_peer_id++;
    p->outgoing = outgoing;
    p->state = XF_PEER_ACTIVE;
    p->last_rx_ns = pkv_now_ns();
    p->next_hb_ns = p->last_rx_ns; /* say hello at once */
    p->queued_tail = &p->queued;
    p->established = !outgoing; /* a server endpoint is wired up when accepted */
    p->map_fd = -1;
    return p;
}

static void peer_link(pkv_xfer_agent_t *a, xf_peer_t *p)
{
    p->next = a->peers;
    a->peers = p;
    XF_STAT_ADD(a, peers, 1);
}

xf_peer_t *xf_peer_connect(pkv_xfer_agent_t *a, const char *addr)
{
    for (xf_peer_t *p = a->peers; p; p = p->next)
        if (p->outgoing && p->state == XF_PEER_ACTIVE && !p->remote_closing &&
            !strcmp(p->addr, addr))
            return p;
    struct sockaddr_storage ss;
    socklen_t sl;
    if (xf_sockaddr_parse(addr, &ss, &sl)) {
        PKV_LOGW(XF_MOD, "peer address '%s' is not numeric host:port", addr);
        return NULL;
    }
    xf_peer_t *p = peer_new(a, true);
    if (!p) return NULL;
    snprintf(p->addr, sizeof(p->addr), "%s", addr);
    ucp_ep_params_t ep = {
        .field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER,
        .sockaddr = {.addr = (struct sockaddr *)&ss, .addrlen = sl},
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {.cb = peer_err_cb, .arg = p},
    };
    ucs_status_t s = ucp_ep_create(a->worker, &ep, &p->ep);
    if (s != UCS_OK) {
        PKV_LOGW(XF_MOD, "connect to %s: %s", addr, ucs_status_string(s));
        free(p);
        return NULL;
    }
    peer_link(a, p);
    PKV_LOGD(XF_MOD, "peer %u: connecting to %s", p->id, addr);
    send_hello(a, p); /* waits in the queue until the server has spoken (its HELLO) */
    return p;
}

void xf_peer_accept(pkv_xfer_agent_t *a, ucp_conn_request_h req)
{
    xf_peer_t *p = peer_new(a, false);
    if (!p) {
        ucp_listener_reject(a->listener, req);
        return;
    }
    snprintf(p->addr, sizeof(p->addr), "incoming");
    ucp_ep_params_t ep = {
        .field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .conn_request = req,
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {.cb = peer_err_cb, .arg = p},
    };
    ucs_status_t s = ucp_ep_create(a->worker, &ep, &p->ep);
    if (s != UCS_OK) {
        PKV_LOGW(XF_MOD, "accept: %s", ucs_status_string(s));
        free(p);
        return;
    }
    peer_link(a, p);
    PKV_LOGD(XF_MOD, "peer %u: accepted", p->id);
}

xf_peer_t *xf_peer_by_ep(pkv_xfer_agent_t *a, ucp_ep_h ep)
{
    if (!ep) return NULL;
    for (xf_peer_t *p = a->peers; p; p = p->next)
        if (p->ep == ep) return p;
    return NULL;
}

static void peer_close(pkv_xfer_agent_t *a, xf_peer_t *p)
{
    (void)a;
    if (!p->ep || p->state == XF_PEER_CLOSING || p->state == XF_PEER_CLOSED) return;
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                               .flags = UCP_EP_CLOSE_FLAG_FORCE};
    void *req = ucp_ep_close_nbx(p->ep, &prm);
    p->close_deadline_ns = pkv_now_ns() + XF_CLOSE_WAIT_NS;
    if (req == NULL || UCS_PTR_IS_ERR(req)) {
        p->state = XF_PEER_CLOSED;
        p->close_done = true;
        p->ep = NULL;
    } else {
        p->close_req = req;
        p->state = XF_PEER_CLOSING;
    }
}

void xf_peer_fail(pkv_xfer_agent_t *a, xf_peer_t *p, const char *why)
{
    if (p->state != XF_PEER_ACTIVE) return;
    p->state = XF_PEER_FAILED;
    XF_STAT_SUB(a, peers, 1);
    if (p->remote_closing) {
        PKV_LOGD(XF_MOD, "peer %u (%s) closed the connection", p->id, p->addr);
    } else {
        XF_STAT_ADD(a, peers_lost, 1);
        PKV_LOGI(XF_MOD, "peer %u (%s) lost: %s", p->id, p->addr, why);
    }
    peer_drop_queued(p);
    xf_xfers_peer_lost(a, p);
    xf_probes_on_peer(a, p, PKV_ERR_PEER_LOST);
    peer_close(a, p);
}

void xf_peer_close_all(pkv_xfer_agent_t *a, bool force)
{
    (void)force;
    for (xf_peer_t *p = a->peers; p; p = p->next) {
        if (p->state == XF_PEER_ACTIVE) {
            p->state = XF_PEER_FAILED;
            XF_STAT_SUB(a, peers, 1);
        }
        peer_drop_queued(p);
        peer_close(a, p);
    }
}

static void send_close(pkv_xfer_agent_t *a, xf_peer_t *p, uint32_t flags)
{
    xf_wire_close_t cl = {.agent_id = a->agent_id, .flags = flags};
    uint8_t buf[64];
    size_t len;
    if (xf_wire_encode_close(&cl, buf, sizeof(buf), &len) == PKV_OK) xf_ctl_send(a, p, buf, len);
}

/* Shutdown: ask every live peer to confirm it has processed everything we sent. That
 * includes an outgoing endpoint still connecting (its CLOSE waits in the queue until the
 * server has spoken): force-closing it and exiting while the server is still wiring up
 * its side made UCX 1.13 abort the server in its tcp transport (tcp_ep.c:478,
 * `!(ep->flags & UCT_TCP_EP_FLAG_CTX_TYPE_TX)`) after a reset or refused lane connect.
 * The wait has the CLOSE handshake's bound; a server that is not there fails the
 * endpoint (error callback) and is not waited for. */
void xf_peers_say_close(pkv_xfer_agent_t *a)
{
    for (xf_peer_t *p = a->peers; p; p = p->next)
        if (p->state == XF_PEER_ACTIVE && p->ep && !p->close_sent) {
            p->close_sent = true;
            send_close(a, p, 0);
        }
}

bool xf_peers_close_answered(pkv_xfer_agent_t *a)
{
    for (xf_peer_t *p = a->peers; p; p = p->next)
        if (p->state == XF_PEER_ACTIVE && p->close_sent && !p->close_acked) return false;
    return true;
}

/* A peer is gone for good once its close completed and nothing refers to it. */
bool xf_peers_closed(pkv_xfer_agent_t *a)
{
    for (xf_peer_t *p = a->peers; p; p = p->next)
        if (p->state != XF_PEER_CLOSED || p->ctl_inflight) return false;
    return true;
}

static void peer_free(xf_peer_t *p)
{
    if (p->map_base) pkv_prim_shared_close(p->map_fd, p->map_base, p->map_size);
    free(p);
}

void xf_peers_free(pkv_xfer_agent_t *a)
{
    while (a->peers) {
        xf_peer_t *p = a->peers;
        a->peers = p->next;
        peer_free(p);
    }
}

/* Map a same-host producer's staging arena (its memfd, by pid and fd), checking that the
 * file there is the one the handle names (inode) and is large enough. One mapping per
 * peer; it lives as long as the peer. Returns the mapping or NULL (then the read moves
 * its payload through UCX instead). */
const uint8_t *xf_peer_map_arena(xf_peer_t *p, uint32_t pid, int32_t fd, uint64_t ino,
                                 uint64_t bytes)
{
    if (p->map_base)
        return p->map_pid == pid && p->map_ino == ino && p->map_size >= bytes ? p->map_base : NULL;
    int mfd;
    void *base;
    if (pkv_prim_shared_map_pid(pid, fd, ino, bytes, &mfd, &base)) return NULL;
    p->map_fd = mfd;
    p->map_base = base;
    p->map_size = bytes;
    p->map_pid = pid;
    p->map_ino = ino;
    PKV_LOGD(XF_MOD, "peer %u: mapped the producer's staging arena (%llu bytes)", p->id,
             (unsigned long long)bytes);
    return base;
}

/* ---- control messages ------------------------------------------------------------------ */
struct xf_ctl_buf {
    xf_ctl_buf_t *next; /* queued on a peer not yet established */
    xf_peer_t *peer;
    size_t len;
    uint8_t data[];
};
typedef xf_ctl_buf_t ctl_buf_t;

static void ctl_sent(void *request, ucs_status_t status, void *user_data)
{
    ctl_buf_t *b = user_data;
    xf_peer_t *p = b->peer;
    p->ctl_inflight--;
    if (status != UCS_OK && status != UCS_ERR_CANCELED && p->err == UCS_OK) {
        PKV_LOGD(XF_MOD, "peer %u: control message type %u (%zu bytes) failed: %s", p->id,
                 b->len > 5 ? b->data[5] : 0, b->len, ucs_status_string(status));
        p->err = status;
    }
    free(b);
    ucp_request_free(request);
}

static int ctl_post(xf_peer_t *p, ctl_buf_t *b)
{
    size_t len = b->len;
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                        UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FLAG_NO_IMM_CMPL,
        .flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER,
        .cb = {.send = ctl_sent},
        .user_data = b,
    };
    /* Counted before posting: with NO_IMM_CMPL a send that completes at once runs
     * ctl_sent inside ucp_am_send_nbx (which frees b) and still returns the request. */
    p->ctl_inflight++;
    void *req = ucp_am_send_nbx(p->ep, XF_AM_CTRL, NULL, 0, b->data, len, &prm);
    if (UCS_PTR_IS_ERR(req)) {
        p->ctl_inflight--;
        ucs_status_t s = UCS_PTR_STATUS(req);
        PKV_LOGD(XF_MOD, "peer %u: control message type %u (%zu bytes) refused: %s", p->id,
                 len > 5 ? b->data[5] : 0, len, ucs_status_string(s));
        free(b);
        if (p->err == UCS_OK) p->err = s;
        return PKV_ERR_PEER_LOST;
    }
    if (req == NULL) { /* completed without its callback (not with NO_IMM_CMPL) */
        p->ctl_inflight--;
        free(b);
    }
    return PKV_OK;
}

/* Send a control message (copied). On a connecting endpoint it waits in the peer's queue
 * until the other side has spoken: an active message with the reply flag posted while
 * the client endpoint is still being wired up can fail with "Invalid parameter" in UCX
 * 1.13, which would be misread as a lost peer. */
int xf_ctl_send(pkv_xfer_agent_t *a, xf_peer_t *p, void *msg, size_t len)
{
    if (p->state != XF_PEER_ACTIVE || !p->ep) return PKV_ERR_PEER_LOST;
    ctl_buf_t *b = malloc(sizeof(*b) + len);
    if (!b) return PKV_ERR_NOMEM;
    b->next = NULL;
    b->peer = p;
    b->len = len;
    memcpy(b->data, msg, len);
    if (a->faults.wire_version) b->data[4] = a->faults.wire_version; /* the header's version */
    if (a->faults.malformed_read && len >= 112 && b->data[5] == XF_WIRE_READ)
        b->data[111] |= 0x80; /* an unknown bit in READ's flags (offset 108, little-endian) */
    if (!p->established) {
        *p->queued_tail = b;
        p->queued_tail = &b->next;
        return PKV_OK;
    }
    return ctl_post(p, b);
}

static void peer_established(xf_peer_t *p)
{
    p->established = true;
    p->established_ns = pkv_now_ns();
    ctl_buf_t *b = p->queued;
    p->queued = NULL;
    p->queued_tail = &p->queued;
    while (b) {
        ctl_buf_t *next = b->next;
        ctl_post(p, b);
        b = next;
    }
}

static void peer_drop_queued(xf_peer_t *p)
{
    while (p->queued) {
        ctl_buf_t *b = p->queued;
        p->queued = b->next;
        free(b);
    }
    p->queued_tail = &p->queued;
}

void xf_send_fail_why(pkv_xfer_agent_t *a, xf_peer_t *p, uint64_t xfer_id, uint64_t request_id,
                      int reason, uint16_t why, const char *text)
{
    xf_wire_fail_t f;
    memset(&f, 0, sizeof(f));
    f.xfer_id = xfer_id;
    f.request_id = request_id;
    f.reason = reason;
    f.why = why;
    snprintf(f.text, sizeof(f.text), "%s", text ? text : "");
    uint8_t buf[XF_WIRE_HEADER_BYTES + 24 + XF_WIRE_MAX_TEXT];
    size_t len;
    if (xf_wire_encode_fail(&f, buf, sizeof(buf), &len) == PKV_OK) xf_ctl_send(a, p, buf, len);
}

void xf_send_fail(pkv_xfer_agent_t *a, xf_peer_t *p, uint64_t xfer_id, uint64_t request_id,
                  int reason, const char *text)
{
    xf_send_fail_why(a, p, xfer_id, request_id, reason, 0, text);
}

/* Who we are and our layout. The connecting side's is queued at connect and leaves once
 * the server has spoken (its first heartbeat); the accepting side answers it with its own.
 * Not the accepting side's first message: with a layout it is longer than the
 * shared-memory transport's short limit (100 bytes), and UCX 1.13 replays a message posted
 * on a server endpoint still wiring up with the short protocol anyway ("Invalid
 * am_short_iov length: 123 (expected: <= 100)", the endpoint fails: openucx/ucx#6872);
 * once the client's HELLO arrived, the endpoint is up. */
static void send_hello(pkv_xfer_agent_t *a, xf_peer_t *p)
{
    xf_wire_hello_t h = {.agent_id = a->agent_id, .layout = a->layout};
    snprintf(h.identity, sizeof(h.identity), "%s", a->identity);
    uint8_t buf[XF_WIRE_HEADER_BYTES + 56 + XF_WIRE_MAX_IDENTITY + XF_WIRE_MAX_MODEL_ID];
    size_t len;
    if (xf_wire_encode_hello(&h, buf, sizeof(buf), &len) == PKV_OK) xf_ctl_send(a, p, buf, len);
    p->hello_sent = true;
}

static void send_heartbeat(pkv_xfer_agent_t *a, xf_peer_t *p)
{
    xf_wire_heartbeat_t h = {.agent_id = a->agent_id, .seq = ++p->hb_seq};
    uint8_t buf[64];
    size_t len;
    if (xf_wire_encode_heartbeat(&h, buf, sizeof(buf), &len) == PKV_OK) xf_ctl_send(a, p, buf, len);
}

void xf_peers_tick(pkv_xfer_agent_t *a, uint64_t now)
{
    xf_peer_t **pp = &a->peers;
    while (*pp) {
        xf_peer_t *p = *pp;
        if (p->rx_seen) {
            /* Heard from this round: stamped with the tick's clock, not the round's start,
             * so a round held up (a debugger, a stop) cannot age what just arrived. */
            p->last_rx_ns = now;
            p->rx_seen = false;
        }
        if (p->state == XF_PEER_ACTIVE) {
            if (p->err != UCS_OK) {
                char why[96];
                snprintf(why, sizeof(why), "endpoint error: %s", ucs_status_string(p->err));
                xf_peer_fail(a, p, why);
            } else if (xf_since(now, p->last_rx_ns) > a->cfg.peer_timeout_ns) {
                xf_peer_fail(a, p, "silent past the peer timeout");
            } else if (now >= p->next_hb_ns && p->established) {
                /* A stalled peer stops completing our sends: don't pile heartbeats up. The
                 * accepting side's first heartbeat goes at once: the client waits for it. */
                if (p->ctl_inflight < 16) send_heartbeat(a, p);
                p->next_hb_ns = now + a->cfg.heartbeat_ns;
            }
        }
        if (p->state == XF_PEER_CLOSING) {
            ucs_status_t s = ucp_request_check_status(p->close_req);
            if (s != UCS_INPROGRESS) {
                ucp_request_free(p->close_req);
                p->close_req = NULL;
                p->ep = NULL;
                p->state = XF_PEER_CLOSED;
                p->close_done = true;
            }
        }
        if (p->state == XF_PEER_CLOSED && !p->refs && !p->ctl_inflight) {
            *pp = p->next;
            peer_free(p);
            continue;
        }
        if (p->state == XF_PEER_CLOSED && p->ctl_inflight && now > p->close_deadline_ns &&
            p->close_deadline_ns) {
            PKV_LOGW(XF_MOD,
                     "peer %u: %u control sends never completed after close; "
                     "written off",
                     p->id, p->ctl_inflight);
            XF_STAT_ADD(a, written_off, p->ctl_inflight);
            p->close_deadline_ns = 0; /* log once; the peer is kept, never reused */
        }
        pp = &p->next;
    }
}

/* ---- incoming control messages --------------------------------------------------------- */
/* A message of another wire version: its transfer, if it names one of ours, ends with
 * `rejected` on both sides now (the READ answered by a FAIL, which every version decodes;
 * the DATA by ending our read, whose FAIL tells the producer; a FAIL we could not decode
 * ends the read or serve it names). Logged once a peer. */
/* A message we cannot decode (another version's, or a malformed one of ours) that still
 * names a transfer: answer a READ with FAIL rejected and end a read or serve it names,
 * so neither side waits out its deadline. */
static void on_unreadable(pkv_xfer_agent_t *a, xf_peer_t *p, const xf_wire_foreign_t *f,
                          const char *why)
{
    if (!f->xfer_id) return;
    if (f->type == XF_WIRE_READ && !p->outgoing)
        xf_send_fail(a, p, f->xfer_id, 0, PKV_ERR_REJECTED, why);
    else if ((f->type == XF_WIRE_DATA || f->type == XF_WIRE_FAIL) && p->outgoing)
        xf_read_on_foreign(a, p, f->xfer_id, why);
    else if (f->type == XF_WIRE_FAIL) /* one we could not decode (a reason we do not know) */
        xf_serve_on_foreign(a, p, f->xfer_id, why);
}

/* A message xf_wire_decode refused. Another version's is counted and logged once a peer;
 * on a client still waiting for the producer's HELLO it ends the reads that wait (the peer
 * answered, in another version). A malformed one of ours is a protocol error. Either way
 * a transfer it names ends now (on_unreadable). */
static void on_undecodable(pkv_xfer_agent_t *a, xf_peer_t *p, const void *data, size_t length)
{
    xf_wire_foreign_t f = {0, 0, 0};
    char why[64];
    bool peeked = xf_wire_peek(data, length, &f) == PKV_OK;
    if (peeked && f.version != XF_WIRE_VERSION) {
        XF_STAT_ADD(a, foreign_msgs, 1);
        snprintf(why, sizeof(why), "wire version %u (this agent speaks %u)", f.version,
                 XF_WIRE_VERSION);
        if (!p->foreign_logged) {
            p->foreign_logged = true;
            PKV_LOGW(XF_MOD, "peer %u: %s: its transfers end rejected", p->id, why);
        }
        if (p->outgoing && !p->hello_seen && !p->foreign_version) {
            p->foreign_version = f.version ? f.version : 1;
            xf_reads_no_hello(a, p, why);
            xf_probes_on_peer(a, p, PKV_OK); /* answered: another version */
        }
    } else {
        XF_STAT_ADD(a, proto_errors, 1);
        snprintf(why, sizeof(why), "malformed message (type %u, %zu bytes)", f.type, length);
        PKV_LOGW(XF_MOD, "peer %u: %s", p->id, why);
    }
    if (peeked) on_unreadable(a, p, &f, why);
}

/* The peer's HELLO (once a connection): who it is and its layout. An incompatible layout
 * is kept on the peer; a client's reads waiting for the HELLO go on (or end) now. */
static void on_hello(pkv_xfer_agent_t *a, xf_peer_t *p, const xf_wire_hello_t *h)
{
    p->remote_agent_id = h->agent_id;
    snprintf(p->identity, sizeof(p->identity), "%s", h->identity);
    p->layout = h->layout;
    p->hello_seen = true;
    if (!xf_layout_compatible(&a->layout, &p->layout, p->layout_why, sizeof(p->layout_why))) {
        /* Once a connection: every read on it ends rejected (why LAYOUT) before READ. */
        p->layout_bad = true;
        PKV_LOGW(XF_MOD, "peer %u (%s, tp %u rank %u): layout incompatible: %s", p->id, p->addr,
                 p->layout.tp, p->layout.rank, p->layout_why);
    }
    if (p->outgoing) {
        xf_reads_on_hello(a, p);
        xf_probes_on_peer(a, p, PKV_OK);
    }
}

/* Messages on one endpoint arrive in order: everything the peer sent before its CLOSE has
 * been handled by now, so answering tells it so. Its disconnect is then expected (not a
 * lost peer), and new reads to it open a new connection. */
static void on_close(pkv_xfer_agent_t *a, xf_peer_t *p, const xf_wire_close_t *c)
{
    if (c->flags & XF_WIRE_CLOSE_REPLY) {
        p->close_acked = true;
    } else {
        p->remote_closing = true;
        send_close(a, p, XF_WIRE_CLOSE_REPLY);
    }
}

/* A decoded message to its handler. false: a type this side of the connection never
 * receives (or a second HELLO), dropped by the caller. */
static bool on_message(pkv_xfer_agent_t *a, xf_peer_t *p, const xf_wire_msg_t *m)
{
    switch (m->type) {
    case XF_WIRE_READ:
        if (p->outgoing) return false;
        xf_serve_on_read(a, p, &m->u.read);
        break;
    case XF_WIRE_ACK: /* a consumer's; a producer's answers a token-only release */
        if (p->outgoing)
            xf_read_on_ack(a, p, &m->u.ack);
        else
            xf_serve_on_ack(a, p, &m->u.ack);
        break;
    case XF_WIRE_DATA:
        if (!p->outgoing) return false;
        xf_read_on_data(a, p, &m->u.data);
        break;
    case XF_WIRE_FAIL:
        if (p->outgoing)
            xf_read_on_fail(a, p, &m->u.fail);
        else
            xf_serve_on_fail(a, p, &m->u.fail);
        break;
    case XF_WIRE_HEARTBEAT:
        p->remote_agent_id = m->u.hb.agent_id;
        break;
    case XF_WIRE_HELLO:
        if (p->hello_seen) return false;
        on_hello(a, p, &m->u.hello);
        break;
    case XF_WIRE_CLOSE:
        on_close(a, p, &m->u.close);
        break;
    }
    return true;
}

ucs_status_t xf_am_ctrl(void *arg, const void *header, size_t header_length, void *data,
                        size_t length, const ucp_am_recv_param_t *param)
{
    pkv_xfer_agent_t *a = arg;
    (void)header;
    (void)header_length;
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
        /* We only ever send control messages eager: this is not one of ours. */
        XF_STAT_ADD(a, proto_errors, 1);
        return UCS_OK;
    }
    ucp_ep_h ep = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : NULL;
    xf_peer_t *p = xf_peer_by_ep(a, ep);
    if (!p || p->state != XF_PEER_ACTIVE) return UCS_OK;
    p->rx_seen = true; /* the tick stamps last_rx_ns */
    if (!p->established) peer_established(p);
    /* The client spoke (its HELLO, or another version's message): the endpoint is up, our
     * HELLO may go (see send_hello). */
    if (!p->outgoing && !p->hello_sent) send_hello(a, p);
    xf_wire_msg_t m;
    if (xf_wire_decode(data, length, &m)) {
        on_undecodable(a, p, data, length);
        return UCS_OK;
    }
    if (!on_message(a, p, &m)) {
        XF_STAT_ADD(a, proto_errors, 1);
        PKV_LOGW(XF_MOD, "peer %u: message type %u on the wrong side of the connection dropped",
                 p->id, m.type);
    }
    return UCS_OK;
}

/* ---- stale payload ---------------------------------------------------------------------- */
/* A generic datatype whose unpack throws the bytes away: receiving into it costs no
 * buffer, whatever the message size. The state is the byte count plus one. */
static void *dd_start_pack(void *context, const void *buffer, size_t count)
{
    (void)context;
    (void)buffer;
    return (void *)(uintptr_t)(count + 1);
}
static void *dd_start_unpack(void *context, void *buffer, size_t count)
{
    (void)context;
    (void)buffer;
    return (void *)(uintptr_t)(count + 1);
}
static size_t dd_packed_size(void *state)
{
    return (size_t)((uintptr_t)state - 1);
}
static size_t dd_pack(void *state, size_t offset, void *dest, size_t max_length)
{
    (void)state;
    (void)offset;
    (void)dest;
    (void)max_length;
    return 0;
}
static ucs_status_t dd_unpack(void *state, size_t offset, const void *src, size_t length)
{
    (void)state;
    (void)offset;
    (void)src;
    (void)length;
    return UCS_OK;
}
static void dd_finish(void *state)
{
    (void)state;
}

int xf_discard_dt_create(pkv_xfer_agent_t *a)
{
    static const ucp_generic_dt_ops_t ops = {
        .start_pack = dd_start_pack,
        .start_unpack = dd_start_unpack,
        .packed_size = dd_packed_size,
        .pack = dd_pack,
        .unpack = dd_unpack,
        .finish = dd_finish,
    };
    ucs_status_t s = ucp_dt_create_generic(&ops, NULL, &a->discard_dt);
    if (s != UCS_OK) {
        PKV_LOGE(XF_MOD, "ucp_dt_create_generic: %s", ucs_status_string(s));
        return PKV_ERR_IO;
    }
    return PKV_OK;
}

static void discard_done(void *request, ucs_status_t status, const ucp_tag_recv_info_t *info,
                         void *user_data)
{
    pkv_xfer_agent_t *a = user_data;
    (void)status;
    (void)info;
    a->discards_inflight--;
    ucp_request_free(request);
}

void xf_drain_stale(pkv_xfer_agent_t *a)
{
    for (int i = 0; i < 64; i++) {
        ucp_tag_recv_info_t info;
        ucp_tag_message_h msg =
            ucp_tag_probe_nb(a->worker, XF_WIRE_TAG_KIND, XF_WIRE_TAG_KIND_MASK, 1, &info);
        if (!msg) return;
        ucp_request_param_t prm = {
            .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                            UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FLAG_NO_IMM_CMPL,
            .cb = {.recv = discard_done},
            .datatype = a->discard_dt,
            .user_data = a,
        };
        void *req = ucp_tag_msg_recv_nbx(a->worker, NULL, info.length, msg, &prm);
        XF_STAT_ADD(a, stale_dropped, 1);
        if (UCS_PTR_IS_ERR(req)) {
            PKV_LOGW(XF_MOD, "discarding a stale payload message: %s",
                     ucs_status_string(UCS_PTR_STATUS(req)));
            continue;
        }
        if (req) a->discards_inflight++;
    }
}
