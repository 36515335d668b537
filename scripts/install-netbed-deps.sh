#!/usr/bin/env bash
# System tools of the network test bed (src/elastic_ep/harness/netns.py): ip and tc (iproute2),
# nft (nftables) and iptables-legacy (iptables). Installs whichever is missing with apt-get;
# does nothing when all are there. Without root the bed's tests skip, so this skips too.
set -euo pipefail

# promtool (Debian's prometheus package): tests/deploy checks deploy/prometheus/alerts.yml and runs
# its unit tests, and fails without it.
if ! command -v promtool >/dev/null; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "install-netbed-deps: not root, not installing prometheus (tests/deploy need promtool)" >&2
    else
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
    fi
fi

# Debian's chromium for the dashboard's browser tests (tests/e2e/test_dashboard_browser.py,
# tests/serve/test_serve_admin.py), which fail in CI (CI=true) without it.
if ! command -v chromium >/dev/null; then
    if [ "$(id -u)" -eq 0 ]; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
    else
        echo "install-netbed-deps: not root, not installing chromium (the dashboard's browser tests skip)" >&2
    fi
fi

# Debian's etcd-server: the controller group's tests (tests/group, tests/e2e/test_ha.py) start their own
# etcd and fail without it.
if ! command -v etcd >/dev/null; then
    if [ "$(id -u)" -eq 0 ]; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends etcd-server >/dev/null
    else
        echo "install-netbed-deps: not root, not installing etcd-server (the controller group's tests need etcd)" >&2
    fi
fi

declare -A package=([ip]=iproute2 [tc]=iproute2 [nft]=nftables [iptables-legacy]=iptables)
missing=()
for tool in "${!package[@]}"; do
    command -v "$tool" >/dev/null || missing+=("${package[$tool]}")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
    echo "install-netbed-deps: not root, not installing ${missing[*]} (the network test bed tests skip)" >&2
    exit 0
fi
readarray -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
