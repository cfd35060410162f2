#!/usr/bin/env bash
# Install Debian's chromium for the dashboard's browser tests (Playwright drives it; Playwright's
# own browser downloads are never used). Needs root or sudo when chromium is missing.
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
  exit 0
fi
sudo=""
if [ "$(id -u)" != 0 ]; then
  sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq chromium >/dev/null
