#!/usr/bin/env bash
# The hand workflow of /work/shared/docs/field-notes.md, host after host, as users run it today:
# rsync the payload; over ssh sed the flag into the unit, daemon-reload, restart; then poll
# `systemctl is-active` every 30 s (up to 28 polls, break on failed) and, once active, POST the golden
# completion and expect "Paris"; finally eyeball the markers with journalctl | grep | sort | uniq -c.
#
# usage: hand.sh SSH_CONFIG SERVICE PORT MODEL PAYLOAD_DIR REMOTE_DIR RUN_ID HOST...
# HAND_POLL overrides the 30 s poll interval (bench/run.py uses 1 s only for its untimed first install).
set -u
cfg=$1 svc=$2 port=$3 model=$4 payload=$5 dest=$6 run=$7
shift 7
poll=${HAND_POLL:-30}
marker=${HAND_MARKER:-plugin loaded}
rc=0
for h in "$@"; do
  echo "== $h"
  if ! rsync -az -e "ssh -F $cfg" "$payload/" "root@$h:$dest/"; then rc=1; continue; fi
  if ! ssh -F "$cfg" "$h" "P=/etc/systemd/system/$svc.service
      sed -i 's/^Environment=\"BENCH_RUN=[^\"]*\"/Environment=\"BENCH_RUN=$run\"/' \"\$P\" &&
      grep -q 'BENCH_RUN=$run\"' \"\$P\" && systemctl daemon-reload && systemctl restart $svc"; then
    rc=1; continue
  fi
  ok=0
  for _ in $(seq 28); do
    sleep "$poll"
    state=$(ssh -F "$cfg" "$h" "systemctl is-active $svc")
    echo "is-active: $state"
    [ "$state" = failed ] && break
    if [ "$state" = active ]; then
      out=$(ssh -F "$cfg" "$h" "curl -s -X POST http://127.0.0.1:$port/v1/completions \
        -H 'Content-Type: application/json' \
        -d '{\"model\": \"$model\", \"prompt\": \"The capital of France is\", \"max_tokens\": 8, \"temperature\": 0}'")
      echo "completion: $out"
      case $out in *Paris*) ok=1; break ;; esac
    fi
  done
  ssh -F "$cfg" "$h" "journalctl -u $svc --since '9 min ago' | grep -E '$marker' | sort | uniq -c"
  [ "$ok" = 1 ] || rc=1
done
exit $rc
