#!/bin/sh
# Headless Chromium for tests/test_plot_browser.py, which opens `grimoire plot`'s HTML page in a
# real browser. Does nothing where a Chromium is already on PATH; otherwise installs Debian's
# `chromium` package (as root, or through sudo). Elsewhere it stops with what to install.
set -e
for name in chromium chromium-browser google-chrome google-chrome-stable; do
    if command -v "$name" >/dev/null 2>&1; then
        echo "install-chromium: found $(command -v "$name")"
        exit 0
    fi
done
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-chromium: no Chromium on PATH and no apt-get; install Chromium (or Chrome) with" \
        "your system's package manager: tests/test_plot_browser.py needs it" >&2
    exit 1
fi
if [ "$(id -u)" = 0 ]; then
    SUDO=""
elif command -v sudo >/dev/null 2>&1; then
    SUDO="sudo"
else
    echo "install-chromium: installing Debian's chromium needs root (or sudo)" >&2
    exit 1
fi
echo "install-chromium: installing Debian's chromium package"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
command -v chromium
