/*
 * Lean pull: the bare-flow references beside `pagekv bench xfer`'s figures (what the
 * transfer flow itself can reach on this machine, with no engine around it). Shared by
 * the benchmark and tests/test_xfer.c.
 */
#ifndef PKV_SUPPORT_LEAN_PULL_H
#define PKV_SUPPORT_LEAN_PULL_H

#include <stddef.h>
#include <stdint.h>

/* GB/s of the leanest same-host pull of this flow (support/lean_pull.c): a forked producer
 * and this process do the two copies of a shared-arena read (read_bytes in `layers`
 * layers of `piece`-byte pieces, streaming stores, checksummed and compared), 8 reads in
 * flight through rings in shared memory with busy polling, no engine around them. Times
 * timed_reads after warm_reads; -1 on a checksum mismatch, bad arguments or no memory,
 * or when the producer died or 120 s passed. */
double xh_lean_pull_gbps(size_t read_bytes, uint32_t layers, size_t piece, uint32_t warm_reads,
                         uint32_t timed_reads);

/* The same with the engine's integrity instead of the checksum: per read, both processes
 * derive its per-layer Poly1305 keys (xf_mac_keys), the producer MACs each layer as it
 * copies it (xf_mac_copy) and the consumer verifies each as it copies it out of the arena
 * (xf_mac_copy_in, tags compared). The bound of a same-host flow that must MAC. -1 on a
 * tag mismatch, else as xh_lean_pull_gbps. */
double xh_lean_pull_mac_gbps(size_t read_bytes, uint32_t layers, size_t piece, uint32_t warm_reads,
                             uint32_t timed_reads);

/* GB/s of the leanest pull of this flow over loopback tcp (support/lean_pull.c): a forked
 * consumer and its forked producer, UCX with ucx_perftest's tcp settings, 8 reads in
 * flight, each READ (active message) -> pool -> staging copy -> the stream and its
 * checksum trailer in 60 KiB tag messages -> staging -> pool copy, checksums compared ->
 * ACK; busy polling, no engine. -1 as xh_lean_pull_gbps. */
double xh_lean_pull_tcp_gbps(size_t read_bytes, uint32_t layers, size_t piece, uint32_t warm_reads,
                             uint32_t timed_reads);

#endif
