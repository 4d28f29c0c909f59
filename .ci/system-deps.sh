#!/usr/bin/env bash
# System tools the integration tests run for real: a Prometheus server (dashboard queries),
# iproute2's ip/tc (the namespace testbed) and HAProxy (the fleet's gRPC load balancer,
# deploy/haproxy). Debian packages, installed only when missing, and only where this can (root and
# apt-get); elsewhere one line says which tests cannot run and how to get them.
# --strict (CI): a missing tool that cannot be installed is an error instead.
set -uo pipefail
strict=0
[ "${1:-}" = "--strict" ] && strict=1

missing=()
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
command -v tc >/dev/null 2>&1 || missing+=(iproute2)
# haproxy lives in /usr/sbin, which a non-root PATH may lack
command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ] || missing+=(haproxy)
[ "${#missing[@]}" -eq 0 ] && exit 0

if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing ${missing[*]} for the integration tests (apt-get)" >&2
  export DEBIAN_FRONTEND=noninteractive
  if apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; then
    exit 0
  fi
fi
echo "not installed: ${missing[*]}; the tests that run them cannot (to run them: sudo apt-get install ${missing[*]})" >&2
exit "$strict"
