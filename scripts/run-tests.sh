#!/bin/sh
# Run each test binary (Check forks each test with its own timeout), collect Check's
# per-binary result line, and close with "N passed, N failed" for the whole suite.
set -u
# libucm (UCX, linked into every binary) patches libc's madvise; under TSan a thread's
# exit (glibc madvises its stack) then crashes inside the hook. Tests need no UCX memory
# events, so turn them off for TSan runs.
case "${SAN:-}" in *thread*) export UCX_MEM_EVENTS="${UCX_MEM_EVENTS:-no}" ;; esac
# LeakSanitizer: leaks inside UCX itself are suppressed (tests/lsan.supp says which); the
# children the tests spawn (pagekv serve, pagekv route) inherit it.
case "${SAN:-}" in *address*) export LSAN_OPTIONS="suppressions=$(cd "$(dirname "$0")/.." && pwd)/tests/lsan.supp${LSAN_OPTIONS:+:$LSAN_OPTIONS}" ;; esac
passed=0; failed=0; bad_bins=""
for t in "$@"; do
    out=$(CK_DEFAULT_TIMEOUT=${CK_DEFAULT_TIMEOUT:-120} "$t" 2>&1); rc=$?
    line=$(printf '%s\n' "$out" | grep -E '^[0-9]+%: Checks:' | tail -n 1)
    echo "$(basename "$t"): ${line:-no summary (exit $rc)}"
    n=$(printf '%s' "$line" | sed -n 's/.*Checks: \([0-9]*\).*/\1/p')
    f=$(printf '%s' "$line" | sed -n 's/.*Failures: \([0-9]*\).*/\1/p')
    e=$(printf '%s' "$line" | sed -n 's/.*Errors: \([0-9]*\).*/\1/p')
    if [ -z "$n" ]; then failed=$((failed + 1)); bad_bins="$bad_bins $t"; printf '%s\n' "$out" | tail -n 40; continue; fi
    passed=$((passed + n - f - e)); failed=$((failed + f + e))
    if [ $((f + e)) -ne 0 ] || [ $rc -ne 0 ]; then
        bad_bins="$bad_bins $t"; printf '%s\n' "$out" | grep -vE '^[0-9]+%: Checks:|^Running suite' | tail -n 40
    fi
done
echo "$passed passed, $failed failed"
[ -z "$bad_bins" ]
