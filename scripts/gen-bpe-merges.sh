#!/bin/sh
# Regenerate src/tokenizer/bpe_merges.c, the builtin BPE's merge table, from general
# English text shipped by Debian packages (never from the benchmarks' filler):
#   common-licenses/*   /usr/share/common-licenses (base-files, always installed)
#   fortunes/*          /usr/share/games/fortunes  (package fortunes: quotes, jokes,
#                       literature; ascii-art left out)
#   dictd/jargon.dict   the Jargon File (package dict-jargon, gunzipped)
#   dictd/foldoc.dict   the Free On-line Dictionary of Computing (package dict-foldoc)
# The output is committed; the build never runs this. Training is deterministic, so on
# Debian 12 with the same package versions the output is identical byte for byte:
#   scripts/gen-bpe-merges.sh            regenerate in place
#   scripts/gen-bpe-merges.sh --check    regenerate to a temp file and compare (exit 1 on drift)
# Needs: apt-get install fortunes dict-jargon dict-foldoc
set -eu
MERGES=${MERGES:-16122}   # 256 bytes + 16122 merges + 6 specials = 16384 ids
BUILD=${BUILD:-build}
OUT=src/tokenizer/bpe_merges.c
cd "$(dirname "$0")/.."
ROOT=$(pwd)
for f in /usr/share/games/fortunes/cookie /usr/share/dictd/jargon.dict.dz /usr/share/dictd/foldoc.dict.dz; do
    if [ ! -e "$f" ]; then
        echo "gen-bpe-merges: $f missing; apt-get install fortunes dict-jargon dict-foldoc" >&2
        exit 2
    fi
done
make --no-print-directory -s BUILD="$BUILD" "$BUILD/pagekv" >&2
CORPUS=$(mktemp -d /tmp/bpe-corpus.XXXXXX)
trap 'rm -rf "$CORPUS"' EXIT
mkdir -p "$CORPUS/dictd"
ln -s /usr/share/common-licenses "$CORPUS/common-licenses"
ln -s /usr/share/games/fortunes "$CORPUS/fortunes"
gzip -dc /usr/share/dictd/jargon.dict.dz > "$CORPUS/dictd/jargon.dict"
gzip -dc /usr/share/dictd/foldoc.dict.dz > "$CORPUS/dictd/foldoc.dict"
cd "$CORPUS"
FILES=$(LC_ALL=C ls common-licenses/* | LC_ALL=C sort)
for f in $(LC_ALL=C ls fortunes/ | LC_ALL=C sort); do
    case "$f" in *.dat|*.u8|ascii-art) continue ;; esac
    FILES="$FILES fortunes/$f"
done
FILES="$FILES dictd/jargon.dict dictd/foldoc.dict"
target=$ROOT/$OUT
[ "${1:-}" = "--check" ] && target=$CORPUS/bpe_merges.c
# shellcheck disable=SC2086
"$ROOT/$BUILD/pagekv" tokenizer train --seed-digits --merges "$MERGES" --out "$target" $FILES
if [ "${1:-}" = "--check" ]; then
    if cmp -s "$target" "$ROOT/$OUT"; then echo "gen-bpe-merges: $OUT reproduced exactly"; exit 0; fi
    echo "gen-bpe-merges: $OUT differs from a fresh run:" >&2
    diff "$ROOT/$OUT" "$target" | head -20 >&2
    exit 1
fi
