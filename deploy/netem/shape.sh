#!/usr/bin/env bash
# Shape a real host's link with tc netem, uplink and downlink separately.
#
#   sudo deploy/netem/shape.sh DEV [--up-rate 1mbit] [--up-delay 20ms] [--up-jitter 5ms] [--up-loss 0.5%]
#                                  [--down-rate 10mbit] [--down-delay 20ms] [--down-jitter 5ms] [--down-loss 0.5%]
#                                  [--port 50051] [--dry-run]
#
# Run it on the DEVICE host, DEV being its interface towards the edge: the uplink (device -> edge)
# is DEV's egress, shaped by netem at DEV's root; the downlink (edge -> device) is DEV's ingress,
# which tc cannot queue, so an ingress filter redirects it to an ifb device whose egress netem
# shapes. --port limits shaping to TCP traffic to/from that edge port (else ALL traffic on DEV,
# your ssh session included, is shaped). --dry-run prints the commands instead of running them.
# Undo with deploy/netem/undo.sh DEV. Needs root and the sch_netem and ifb kernel modules.
set -euo pipefail

NETEM_LIMIT=10000   # packets netem may queue (its default of 1000 drops at rate x delay above ~1 MB)

usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
die() { echo "shape.sh: error: $*" >&2; exit 2; }

[ $# -ge 1 ] || usage
DEV=$1; shift
case "$DEV" in -*|"") usage;; esac
IFB="ifb${DEV}"; IFB=${IFB:0:15}   # interface names have at most 15 characters
PORT="" DRY=0
declare -A OPT=()
RATE_RE='^[0-9]+(\.[0-9]+)?(bit|kbit|mbit|gbit|bps|kbps|mbps)$'
TIME_RE='^[0-9]+(\.[0-9]+)?(us|ms|s)$'
LOSS_RE='^[0-9]+(\.[0-9]+)?%$'
while [ $# -gt 0 ]; do
  case "$1" in
    --up-rate|--down-rate) [[ ${2:-} =~ $RATE_RE ]] || die "$1 needs a rate like 1mbit, got '${2:-}'";;
    --up-delay|--down-delay|--up-jitter|--down-jitter)
      [[ ${2:-} =~ $TIME_RE ]] || die "$1 needs a time like 20ms, got '${2:-}'";;
    --up-loss|--down-loss) [[ ${2:-} =~ $LOSS_RE ]] || die "$1 needs a percentage like 0.5%, got '${2:-}'";;
    --port) [[ ${2:-} =~ ^[0-9]+$ ]] || die "--port needs a number, got '${2:-}'"; PORT=$2; shift 2; continue;;
    --dry-run) DRY=1; shift; continue;;
    *) die "unknown option $1";;
  esac
  OPT[${1#--}]=$2; shift 2
done

run() { if [ "$DRY" = 1 ]; then echo "$*"; else "$@"; fi; }

# netem arguments of one direction (up or down): delay [jitter], loss, rate.
netem_args() {
  local side=$1 args="limit $NETEM_LIMIT"
  if [ -n "${OPT[$side-delay]:-}${OPT[$side-jitter]:-}" ]; then
    args+=" delay ${OPT[$side-delay]:-0ms}"
    [ -z "${OPT[$side-jitter]:-}" ] || args+=" ${OPT[$side-jitter]}"
  fi
  [ -z "${OPT[$side-loss]:-}" ] || args+=" loss ${OPT[$side-loss]}"
  [ -z "${OPT[$side-rate]:-}" ] || args+=" rate ${OPT[$side-rate]}"
  echo "$args"
}

# Shape the egress of $1 with netem; with --port only the traffic matching $2 (dport or sport).
shape_egress() {
  local dev=$1 match=$2 args
  args=$(netem_args "$3")
  if [ -z "$PORT" ]; then
    # shellcheck disable=SC2086  # $args is a word list on purpose
    run tc qdisc replace dev "$dev" root netem $args
    return
  fi
  # prio with 4 bands, every priority mapped to band 1; the filter sends the edge's traffic to
  # band 4, the only one with netem.
  run tc qdisc replace dev "$dev" root handle 1: prio bands 4 priomap 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0
  # shellcheck disable=SC2086
  run tc qdisc replace dev "$dev" parent 1:4 handle 40: netem $args
  run tc filter replace dev "$dev" parent 1: protocol ip prio 1 u32 match ip protocol 6 0xff \
    match ip "$match" "$PORT" 0xffff flowid 1:4
}

# Uplink: DEV's egress (towards the edge's port).
shape_egress "$DEV" dport up
# Downlink: DEV's ingress, redirected to the ifb device and shaped on its egress.
run modprobe ifb numifbs=0 2>/dev/null || true
if [ "$DRY" = 1 ] || ! ip link show "$IFB" >/dev/null 2>&1; then
  run ip link add "$IFB" type ifb
fi
run ip link set "$IFB" up
run tc qdisc replace dev "$DEV" handle ffff: ingress
run tc filter replace dev "$DEV" parent ffff: protocol all prio 1 u32 match u32 0 0 \
  action mirred egress redirect dev "$IFB"
shape_egress "$IFB" sport down
[ "$DRY" = 1 ] || echo "shape.sh: $DEV shaped: up [$(netem_args up)] down [$(netem_args down)] via $IFB${PORT:+ (port $PORT only)}"
