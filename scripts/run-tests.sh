#!/bin/sh
# Run each test binary (Check forks each test with its own timeout), collect Check's
# per-binary result line, and close with "N passed, N failed, N skipped" for the whole suite.
#
# Skips: Check has no skip status. A test that cannot run here calls PKV_TEST_SKIP(why)
# (tests/support/testutil.h) and returns, which Check counts as passed; it writes one line
# "SKIP <test>: <why>" to stderr and appends it to the file this script names in
# PKV_TEST_SKIP_FILE (one per binary). Each such line moves one test from passed to
# skipped; the per-binary line says how many it skipped, and the skipped tests are listed
# (binary, test, reason) just above the summary line.
set -u
# libucm (UCX, linked into every binary) patches libc's madvise; under TSan a thread's
# exit (glibc madvises its stack) then crashes inside the hook. Tests need no UCX memory
# events, so turn them off for TSan runs.
case "${SAN:-}" in *thread*) export UCX_MEM_EVENTS="${UCX_MEM_EVENTS:-no}" ;; esac
# Check's per-test timeouts (a hang's kill, not an assertion) stretched under a sanitizer,
# which runs the same work several times slower (test_xfer's 18 agent pairs of one test
# took past its 60 s under TSan).
[ -n "${SAN:-}" ] && export CK_TIMEOUT_MULTIPLIER="${CK_TIMEOUT_MULTIPLIER:-3}"
# LeakSanitizer: leaks inside UCX itself are suppressed (tests/lsan.supp says which); the
# children the tests spawn (pagekv serve, pagekv route) inherit it.
case "${SAN:-}" in *address*) export LSAN_OPTIONS="suppressions=$(cd "$(dirname "$0")/.." && pwd)/tests/lsan.supp${LSAN_OPTIONS:+:$LSAN_OPTIONS}" ;; esac
skipdir=$(mktemp -d "${TMPDIR:-/tmp}/pagekv-skips-XXXXXX") || exit 1
trap 'rm -rf "$skipdir"' EXIT
passed=0; failed=0; skipped=0; bad_bins=""; skip_list=""
for t in "$@"; do
    name=$(basename "$t"); sf="$skipdir/$name"; : >"$sf"
    out=$(PKV_TEST_SKIP_FILE="$sf" CK_DEFAULT_TIMEOUT=${CK_DEFAULT_TIMEOUT:-120} "$t" 2>&1); rc=$?
    line=$(printf '%s\n' "$out" | grep -E '^[0-9]+%: Checks:' | tail -n 1)
    s=$(grep -c '^SKIP ' "$sf")
    note=""; [ "$s" -ne 0 ] && note=" ($s skipped)"
    echo "$name: ${line:-no summary (exit $rc)}$note"
    n=$(printf '%s' "$line" | sed -n 's/.*Checks: \([0-9]*\).*/\1/p')
    f=$(printf '%s' "$line" | sed -n 's/.*Failures: \([0-9]*\).*/\1/p')
    e=$(printf '%s' "$line" | sed -n 's/.*Errors: \([0-9]*\).*/\1/p')
    if [ -z "$n" ]; then failed=$((failed + 1)); bad_bins="$bad_bins $t"; printf '%s\n' "$out" | tail -n 40; continue; fi
    skip_list="$skip_list$(sed "s/^SKIP /  $name: /" "$sf")
"
    passed=$((passed + n - f - e - s)); failed=$((failed + f + e)); skipped=$((skipped + s))
    if [ $((f + e)) -ne 0 ] || [ $rc -ne 0 ]; then
        bad_bins="$bad_bins $t"; printf '%s\n' "$out" | grep -vE '^[0-9]+%: Checks:|^Running suite' | tail -n 40
    fi
done
if [ "$skipped" -ne 0 ]; then
    echo "skipped (binary: test: why):"
    printf '%s' "$skip_list" | grep -v '^$'
fi
echo "$passed passed, $failed failed, $skipped skipped"
[ -z "$bad_bins" ]
