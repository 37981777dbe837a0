#!/usr/bin/env bash
# Installs what kvq needs to build and test on Debian/Ubuntu.
set -euo pipefail
# python3-jinja2: the reference renderer test_jinja compares chat templates against;
# libhiredis-dev: serve's --prefix-cache-remote; redis-server: the store its tests start
pkgs="build-essential clang cmake pkg-config libpcre2-dev libmicrohttpd-dev libjansson-dev libhiredis-dev redis-server python3 python3-jinja2 python3-jsonschema"
missing=""
for p in $pkgs; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing
fi
