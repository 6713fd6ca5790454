/*
 * The CPU round-trip probe: how far apart the two CPUs a transfer's threads run on are at
 * this moment. `pagekv bench xfer` measures it beside each timed run (through the
 * transfer harness's memcpy_ref).
 */
#ifndef PKV_SUPPORT_RTT_PROBE_H
#define PKV_SUPPORT_RTT_PROBE_H

/* Round trip of one cache line between the first two CPUs this process may run on: two
 * threads pinned there, the median of 9 batches of 2,000 round trips, in ns; 0 when it
 * cannot measure (fewer than two CPUs, a thread not created or not pinned, 200 ms
 * passed without a batch). On a VM it shows how far apart the host placed the vCPUs at
 * that moment: on this 2-vCPU machine it moves between ~55 ns (hyperthreads of one
 * core), ~95-350 ns and ~500-900 ns as the host places them after they idle, and a 64
 * KiB transfer's rate follows it. */
double pkv_rtt_probe_ns(void);

#endif
