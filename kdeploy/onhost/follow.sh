# Wait until the unit ($2) has an invocation other than $1 and is not stopping; $3: seconds between looks.
old=$1 unit=$2 seen=
while :; do
  s=$(systemctl show "$unit" -p ActiveState,InvocationID) || exit 1
  inv=${s#*InvocationID=}; inv=${inv%%[!0-9a-f]*}
  case $s in
    *ActiveState=deactivating*) [ -n "$seen" ] || echo @@stopping; seen=1 ;;
    *) [ -n "$inv" ] && [ "$inv" != "$old" ] && exit 0 ;;
  esac
  sleep $3
done
