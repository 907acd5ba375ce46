#!/usr/bin/env bash
# Watches a server's log beside a benchmark; at the first stall verdict (a whisper instance
# "made no progress"), writes where every thread of tritonserver and of each Python stub
# waits: its name, state and kernel wait channel, and its kernel stack where /proc shows
# it. The stall watch's own log line counts them; this keeps each thread, for a stall in
# Triton's process that Python's stacks cannot show.
#
#   scripts/stall_dump.sh SERVER_LOG OUT_DIR &
LOG=$1
DUMP=$2
until [[ -f $LOG ]] && grep -q "made no progress" "$LOG"; do sleep 2; done
mkdir -p "$DUMP"
for pid in $(pgrep -f "bin/tritonserver") $(pgrep -f triton_python_backend_stub); do
    {
        echo "== $pid $(tr '\0' ' ' < "/proc/$pid/cmdline" | cut -c1-200)"
        for task in /proc/"$pid"/task/*; do
            echo "-- ${task##*/} $(cat "$task/comm") $(awk '{print $3}' "$task/stat") $(cat "$task/wchan")"
            head -12 "$task/stack" 2>/dev/null
        done
    } > "$DUMP/$pid.txt" 2>&1
done
echo "dumped at $(date +%T)" > "$DUMP/done"
