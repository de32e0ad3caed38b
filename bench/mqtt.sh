#!/usr/bin/env bash
# MQTT client throughput: release build of bench-mqtt against its own mosquitto on a free loopback port.
#   bench/mqtt.sh [--count N] [--payload BYTES] [--qos 0,1] [--inflight WINDOW]
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=/opt/swift/usr/bin:$PATH
swift build -c release --product bench-mqtt >&2
bin="$(swift build -c release --show-bin-path)/bench-mqtt"

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
dir=$(mktemp -d)
cat > "$dir/mosquitto.conf" <<CONF
listener $port 127.0.0.1
allow_anonymous true
persistence false
log_dest stderr
log_type error
log_type warning
max_queued_messages 1000000
max_inflight_messages 1000
max_keepalive 65535
CONF
mosquitto -c "$dir/mosquitto.conf" 2> "$dir/mosquitto.log" &
broker=$!
trap 'kill $broker 2>/dev/null || true; wait $broker 2>/dev/null || true; rm -rf "$dir"' EXIT
for _ in $(seq 100); do
    (exec 3<>/dev/tcp/127.0.0.1/$port) 2>/dev/null && break
    sleep 0.05
done
echo "mosquitto $(mosquitto -h 2>/dev/null | head -1 | awk '{print $3}') on 127.0.0.1:$port; $(nproc) cores"
"$bin" --port "$port" "$@"
