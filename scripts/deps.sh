#!/bin/sh
# Install the Debian packages pagekv needs, only those missing. Safe to run repeatedly.
set -eu
PKGS="build-essential pkg-config check libucx-dev ucx-utils libjansson-dev libmicrohttpd-dev \
libssl-dev libcurl4-openssl-dev libxxhash-dev curl iproute2 clang-format"
missing=""
for p in $PKGS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
# node and npm run the OpenAI SDK check through the router (tests/sdk); a machine that has
# them from elsewhere (e.g. NodeSource, which bundles npm) is left as it is.
command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 || missing="$missing nodejs npm"
[ -z "$missing" ] && exit 0
echo "deps: installing:$missing" >&2
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing >/dev/null
