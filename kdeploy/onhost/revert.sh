# The host's own way back from an unconfirmed switch (kdeploy.core.provisional), run by a transient service at the
# deadline or, $7 = boot, by the boot guard: $1 service dir, $2 unit file, $3 token, $4 first-deploy policy,
# $5 the environment file kdeploy writes secrets into ("-": none; its last confirmed content is put back),
# $6 how long to wait for a held deploy lock before ending its holder. At boot systemctl must not wait for
# jobs: the service's own start job waits for the guard. Its at-sign marks are filled by kdeploy.onhost.shell.
d=$1 unit=$2 token=$3 policy=$4 envfile=$5 wait=$6 how=${7:-timer}
nb=; [ "$how" = boot ] && nb=--no-block
exec 9>>"$d/@LOCK@" || exit 1
if ! flock -w "$wait" 9; then  # a live controller confirms or re-arms long before: the holder's link is dead
  pid=$(sed -n 's/.*"remote_pid": *\([0-9]*\).*/\1/p' "$d/@LOCK_RECORD@" 2>/dev/null)
  [ -n "$pid" ] && { pkill -TERM -P "$pid"; kill -TERM "$pid"; }
  flock -w 30 9 || exit 1
fi
read -r tok prev target deadline < "$d/@PENDING@" 2>/dev/null || exit 0
[ "$tok" = "$token" ] || exit 0
now=$(date -u +%Y-%m-%dT%H:%M:%SZ)
info=$(printf '{"user":"systemd","controller":"%s","pid":%s,"since":"%s","command":"%s","remote_pid":%s}' \
  "$(hostname)" $$ "$now" "kdeploy-revert: unconfirmed switch to $target" $$)
printf '%s\n' "$info" > "$d/.@LOCK_RECORD@.tmp" && mv -f "$d/.@LOCK_RECORD@.tmp" "$d/@LOCK_RECORD@"
unrecord() { [ "$(cat "$d/@LOCK_RECORD@" 2>/dev/null)" = "$info" ] && rm -f "$d/@LOCK_RECORD@"; }  # ours only
if [ "$envfile" != - ] && [ -f "$d/@SECRETS_PREVIOUS@" ]; then
  (umask 077 && rm -f "$envfile.kdeploy-tmp" && cp "$d/@SECRETS_PREVIOUS@" "$envfile.kdeploy-tmp" &&
    sync "$envfile.kdeploy-tmp" && mv -T "$envfile.kdeploy-tmp" "$envfile")
fi
if [ "$prev" = "-" ]; then
  release=null
  if [ "$policy" = stop ]; then
    systemctl disable --quiet "$unit"; systemctl $nb stop "$unit"; what="first deploy not confirmed: service stopped"
  else
    what="first deploy not confirmed: service left running"
  fi
  [ "$how" = boot ] && what="host rebooted before the confirm; $what"
else
  release="\"$prev\""
  # A node of a server is armed before any node moves: one the controller never reached still has its last
  # confirmed unit and current. It keeps running (its peers did not move either), or, its run ended by its head's
  # stop, is started to join the head that goes back with it.
  if [ "$(readlink "$d/@CURRENT@")" = "@RELEASES@/$prev" ] &&
      cmp -s "$d/@RELEASES@/$prev/@META@/unit.service" "@UNIT_DIR@/$unit"; then
    systemctl $nb start "$unit"
    what="switch to $target not confirmed; the host had not moved from $prev"
  else
    # the unit and current, both or again (a full disk clears): pending stays until they moved, so a swap that
    # never succeeds is retried at boot and shown to the next kdeploy run, instead of a host on an unconfirmed
    # release
    tries=0
    until cp "$d/@RELEASES@/$prev/@META@/unit.service" "@UNIT_DIR@/.$unit.kdeploy-revert" &&
        chmod 0644 "@UNIT_DIR@/.$unit.kdeploy-revert" &&
        mv -T "@UNIT_DIR@/.$unit.kdeploy-revert" "@UNIT_DIR@/$unit" &&
        rm -rf "$d/.@CURRENT@.tmp" && ln -sfn "@RELEASES@/$prev" "$d/.@CURRENT@.tmp" &&
        mv -T "$d/.@CURRENT@.tmp" "$d/@CURRENT@"; do
      tries=$((tries + 1))
      if [ "$tries" -ge @SWAP_TRIES@ ]; then
        echo "kdeploy-revert: could not put $prev back after $tries tries; the switch to $target stays pending" >&2
        unrecord
        exit 1
      fi
      echo "kdeploy-revert: putting $prev back failed (try $tries of @SWAP_TRIES@); again in @SWAP_PAUSE@s" >&2
      sleep @SWAP_PAUSE@
    done
    systemctl daemon-reload
    systemctl $nb restart "$unit"
    what="switch to $target not confirmed by the deadline: the host went back to $prev by itself"
    [ "$how" = boot ] &&
      what="host rebooted before the switch to $target was confirmed: it went back to $prev by itself at boot"
  fi
fi
rm -f "$d/@PENDING@" "$d/@SECRETS_PREVIOUS@"
printf '{"attempted":"%s","command":"kdeploy-revert","controller":"%s","error":"%s","release":%s,%s}\n' \
  "$target" "$(hostname)" "$what" "$release" "\"result\":\"reverted\",\"time\":\"$now\",\"user\":\"systemd\"" \
  >> "$d/@HISTORY@"
unrecord
exit 0
