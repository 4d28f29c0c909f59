#!/usr/bin/env bash
# Remove what deploy/netem/shape.sh DEV set up: DEV's root and ingress qdiscs (with their filters)
# and the ifb device. Safe to run twice, or when shape.sh stopped halfway.
#
#   sudo deploy/netem/undo.sh DEV [--dry-run]
set -uo pipefail

[ $# -ge 1 ] && [ "${1#-}" = "$1" ] || { echo "usage: undo.sh DEV [--dry-run]" >&2; exit 2; }
DEV=$1
IFB="ifb${DEV}"; IFB=${IFB:0:15}
DRY=0
[ "${2:-}" = "--dry-run" ] && DRY=1
run() { if [ "$DRY" = 1 ]; then echo "$*"; else "$@" 2>/dev/null; fi; }

# Each step may find nothing to remove; that is not an error.
run tc qdisc del dev "$DEV" root || true
run tc qdisc del dev "$DEV" ingress || true
run ip link del "$IFB" || true
[ "$DRY" = 1 ] || echo "undo.sh: $DEV unshaped, $IFB removed"
exit 0
