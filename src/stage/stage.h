/*
 * stage: the stage's interface to the other modules (the transfer engine), beyond the
 * public API in include/pagekv/stage.h. The stage's own internals are in stage_int.h.
 */
#ifndef PKV_STAGE_STAGE_H
#define PKV_STAGE_STAGE_H

#include "pagekv/stage.h"

#include <stdatomic.h>

/* pkv_stage_acquire, also ending with PKV_ERR_CANCELLED (nothing granted) when *abort is
 * true as it takes the stage's lock. A caller that sets *abort and then calls
 * pkv_stage_cancel(transfer_id) ends the acquire whichever runs first: a cancel that
 * came before the acquire parked finds nothing to cancel, but the acquire then sees the
 * flag; one that comes after finds it parked (or granted) and cancels it. */
int pkv_stage_acquire_abortable(pkv_stage_t *st, uint64_t transfer_id, uint32_t peer,
                                uint32_t pages, uint64_t deadline_ns, const atomic_bool *abort,
                                pkv_stage_grant_t **out);

#endif
