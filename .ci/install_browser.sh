#!/usr/bin/env bash
# Install the headless browser that tests/test_browser.py drives (Debian's chromium, used by
# Playwright through executable_path; Playwright never downloads its own browser here).
#
#     .ci/install_browser.sh        # idempotent: does nothing when /usr/bin/chromium exists
#
# .ci/run calls it before the test command. Uses sudo only when not root.
set -euo pipefail

CHROMIUM=/usr/bin/chromium
if [ -x "$CHROMIUM" ]; then
    echo "install_browser: $("$CHROMIUM" --version 2>/dev/null || echo chromium) already installed"
    exit 0
fi

# Only CI must have the browser: elsewhere `make test` skips the browser test without it, or leaves it out with
LEAVE_OUT="make test TESTS=--deselect=tests/test_browser.py"

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "install_browser: not root and no sudo: install chromium by hand, or run the tests without the browser test: $LEAVE_OUT" >&2; exit 1; }
    SUDO="sudo"
fi
command -v apt-get >/dev/null || { echo "install_browser: needs apt-get (Debian/Ubuntu); install chromium by hand, or run the tests without the browser test: $LEAVE_OUT" >&2; exit 1; }

export DEBIAN_FRONTEND=noninteractive
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -q
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium

[ -x "$CHROMIUM" ] || { echo "install_browser: apt-get finished but $CHROMIUM is missing" >&2; exit 1; }
echo "install_browser: installed $("$CHROMIUM" --version)"
