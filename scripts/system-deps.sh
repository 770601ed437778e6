#!/usr/bin/env bash
# Makes sure the system programs that the tests run for real are installed: redis-server and redis-cli (the
# shared store, standalone and Cluster), prometheus and promtool (monitoring rules), openssl (TLS test
# certificates). Missing ones are installed with apt-get (as root, or through passwordless sudo); otherwise
# this fails naming the packages, so that `make test` never silently skips those tests.
# kubectl (its built-in kustomize builds every shipped kustomization, tests/unit/test_kustomize.py) is checked,
# not installed: Debian's only package of it, kubernetes-client (1.20 in bookworm), bundles kustomize v2.0.3,
# which predates the Components that k8s/kustomization.yaml uses.
set -euo pipefail

# kustomize v5 or later: what the kustomizations are tested with (kubectl 1.27+ bundles it).
check_kubectl() {
  local how="install kubectl 1.27 or later from https://kubernetes.io/docs/tasks/tools/ (pkgs.k8s.io)"
  if ! command -v kubectl >/dev/null 2>&1; then
    echo "error: the tests need kubectl (its built-in kustomize builds k8s/); ${how}" >&2
    exit 1
  fi
  local version
  version=$(kubectl version --client -o json 2>/dev/null | sed -n 's/.*"kustomizeVersion": *"v\{0,1\}\([0-9]*\).*/\1/p')
  if [ -z "$version" ] || [ "$version" -lt 5 ]; then
    echo "error: kubectl's kustomize is ${version:-unknown} (major), the tests need v5 or later; ${how}" >&2
    exit 1
  fi
}
check_kubectl

declare -A package=(
  [redis-server]=redis-server
  [redis-cli]=redis-tools
  [prometheus]=prometheus
  [promtool]=prometheus
  [openssl]=openssl
  [curl]=curl
)
missing=()
for bin in "${!package[@]}"; do
  command -v "$bin" >/dev/null 2>&1 || missing+=("${package[$bin]}")
done
[ "${#missing[@]}" -eq 0 ] && exit 0
packages=$(printf '%s\n' "${missing[@]}" | sort -u | tr '\n' ' ')

fail() {
  echo "error: the tests need the Debian/Ubuntu packages: ${packages}" >&2
  echo "       $1; install them with: sudo apt-get install ${packages}" >&2
  exit 1
}
command -v apt-get >/dev/null 2>&1 || fail "apt-get is not available here"
if [ "$(id -u)" -eq 0 ]; then
  sudo=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  sudo=(sudo -n)
else
  fail "not root and no passwordless sudo"
fi

echo "system-deps: installing ${packages}" >&2
# The packages' own services are not wanted (the tests start their own servers on free ports): a policy-rc.d
# that refuses every start keeps the maintainer scripts from starting them. One that exists already is kept.
policy=/usr/sbin/policy-rc.d
created=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | "${sudo[@]}" tee "$policy" >/dev/null
  "${sudo[@]}" chmod 755 "$policy"
  created=1
fi
cleanup() { if [ "$created" -eq 1 ]; then "${sudo[@]}" rm -f "$policy"; fi; }
trap cleanup EXIT
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
# shellcheck disable=SC2086  # one word per package
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $packages >/dev/null
for bin in "${!package[@]}"; do
  command -v "$bin" >/dev/null 2>&1 || fail "$bin is still missing after the install"
done
