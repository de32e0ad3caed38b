#!/usr/bin/env bash
# Home Assistant core as a judge of the bridge's MQTT discovery (Tests/fidelity/test_home_assistant.py runs this, in a
# network namespace of its own when it can: loopback only). Starts, on loopback: mosquitto, bluez-sim with the demo's
# six sensors (config/demo-scenario.yaml), a thermostat and a BTHome thermometer on a private bus, `blebridge run`
# with config/demo.yaml (plus the thermostat, and the thermometer as an auto device), a subscriber recording every
# message, and Home Assistant core with its MQTT integration (discovery on), mqtt_statestream (every entity's state
# published back under hass/...), and automations that set the echo device's text entity and the thermostat's number,
# switch and select entities (commands from Home Assistant). Runs until Home Assistant has set up its MQTT entities
# and then JUDGE_SECONDS more (halfway the ear thermometer leaves the configuration: a reload), then stops the bridge,
# then Home Assistant (which saves its registries) and the rest.
#   ha_judge.sh BIN_DIR HASS WORK_DIR     (HASS: the hass executable of a Home Assistant core install)
# Leaves in WORK_DIR: all.log (topic<TAB>payload, one message a line), hass.log, bridge.log, mosquitto.log and
# hass/.storage.
set -u
BIN=$1 HASS=$2 W=$3
SECONDS_AFTER=${JUDGE_SECONDS:-25}
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
ip link set lo up 2>/dev/null || true
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PORT=$(free_port) HTTP=$(free_port)
mkdir -p "$W/hass/.storage"
PIDS=()
stop_all() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap stop_all EXIT

# log_type debug: mosquitto.log names the client of every PUBLISH it receives (who removed a discovery topic).
printf 'listener %s 127.0.0.1\nallow_anonymous true\npersistence false\nlog_type debug\nlog_dest stdout\n' "$PORT" \
    >"$W/mosquitto.conf"
mosquitto -c "$W/mosquitto.conf" >"$W/mosquitto.log" 2>&1 & PIDS+=($!)
for _ in $(seq 1 100); do (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && break; sleep 0.05; done
mosquitto_sub -p "$PORT" -F '%t	%p' -t '#' >"$W/all.log" 2>&1 & PIDS+=($!)

# The demo's sensors and one more: a thermostat whose setpoint, boost and preset are writable (Home Assistant's number,
# switch and select entities; the demo has a text one). `peripherals` is the scenario's last key: the device is
# appended to its list.
cat "$ROOT/config/demo-scenario.yaml" - >"$W/scenario.yaml" <<'YAML'

  # The judge's thermostat: three read/write characteristics (writes are stored, so a read gives what was written).
  - address: "D0:12:34:56:78:9A"
    name: "Acme Thermostat"
    rssi: -60
    service_uuids: ["6e400010-b5a3-f393-e0a9-e50e24dcca9e"]
    gatt:
      - uuid: "6e400010-b5a3-f393-e0a9-e50e24dcca9e"
        characteristics:
          - {uuid: "6e400020-b5a3-f393-e0a9-e50e24dcca9e", flags: [read, write], value: "34 08"}
          - {uuid: "6e400021-b5a3-f393-e0a9-e50e24dcca9e", flags: [read, write], value: "00"}
          - {uuid: "6e400022-b5a3-f393-e0a9-e50e24dcca9e", flags: [read, write], value: {text: "comfort"}}

  # A BTHome thermometer no device entry names: an auto device (auto_devices, its allow list).
  - address: "A4:C1:38:11:22:33"
    name: "ATC_112233"
    rssi: -70
    connectable: false
    advertising_interval: 0.5
    service_data:
      - uuid: "FCD2"
        period: 2
        sequence:
          - "40 00 01 01 50 02 08 07 03 B8 0B"     # 18.00 °C, 30.00 %, 80 %
          - "40 00 02 01 50 02 12 07 03 B8 0B"     # 18.10 °C
YAML
"$BIN/bluez-sim" --spawn-bus --scenario "$W/scenario.yaml" >"$W/sim.out" 2>&1 & PIDS+=($!)
for _ in $(seq 1 200); do grep -q "bluez-sim: ready" "$W/sim.out" && break; sleep 0.05; done
if ! grep -q "bluez-sim: ready" "$W/sim.out"; then
    cat "$W/sim.out" >&2
    echo "ha_judge: bluez-sim did not start" >&2
    exit 1
fi
export DBUS_SYSTEM_BUS_ADDRESS="$(sed -n 's/.*DBUS_SYSTEM_BUS_ADDRESS=//p' "$W/sim.out" | head -1)"

# Home Assistant: location and units given (nothing to detect), HTTP on loopback, the MQTT config entry written as
# the integration's setup would store it (storage version 1.1, migrated by Home Assistant at start).
cat >"$W/hass/configuration.yaml" <<YAML
homeassistant:
  name: judge
  latitude: 52.5
  longitude: 13.4
  elevation: 30
  unit_system: metric
  time_zone: UTC
  currency: EUR
  country: DE
  language: en
http:
  server_host: 127.0.0.1
  server_port: $HTTP
mqtt_statestream:
  base_topic: hass
logger:
  default: info
# Home Assistant's side of a command: once the echo device's text entity is available, set it (the MQTT text
# entity publishes the value to its command topic, <base>/echo/set/message); the device echoes it back.
automation:
  - alias: judge writes to the echo device
    triggers: [{trigger: homeassistant, event: start}]
    actions:
      - wait_template: "{{ states('text.echo_message') not in ['unavailable', 'unknown'] or
          states('sensor.echo_rssi') not in ['unavailable'] }}"
        timeout: 60
      - delay: 2
      - action: text.set_value
        target: {entity_id: text.echo_message}
        data: {value: "from home assistant"}
  - alias: judge sets the thermostat
    triggers: [{trigger: homeassistant, event: start}]
    actions:
      - wait_template: "{{ states('number.thermostat_setpoint') not in ['unavailable', 'unknown'] }}"
        timeout: 60
      - action: number.set_value
        target: {entity_id: number.thermostat_setpoint}
        data: {value: 22.5}
      - action: switch.turn_on
        target: {entity_id: switch.thermostat_boost}
      - action: select.select_option
        target: {entity_id: select.thermostat_preset}
        data: {option: eco}
YAML
cat >"$W/hass/.storage/core.config_entries" <<JSON
{"version": 1, "minor_version": 1, "key": "core.config_entries", "data": {"entries": [
 {"entry_id": "0123456789abcdef0123456789abcdef", "version": 1, "minor_version": 2, "domain": "mqtt",
  "title": "127.0.0.1", "data": {"broker": "127.0.0.1", "port": $PORT, "discovery": true,
  "discovery_prefix": "homeassistant"}, "options": {}, "source": "user", "unique_id": null, "disabled_by": null,
  "pref_disable_new_entities": false, "pref_disable_polling": false}]}}
JSON

# config/demo.yaml with homeassistant.state_resend_delay 3, output: attribute for the RuuviTag, the thermostat's
# parsers at the end of `parsers` (just before `devices:`) and the thermostat at the end of `devices` (just before
# `peripheral:`).
cat >"$W/parsers.yaml" <<'YAML'
  - name: judge_setpoint
    uuid: 6e400020-b5a3-f393-e0a9-e50e24dcca9e
    fields:
      - {name: setpoint_c, type: s16le, offset: 0, scale: 0.01}
  - name: judge_boost
    uuid: 6e400021-b5a3-f393-e0a9-e50e24dcca9e
    fields:
      - {name: boost, type: "bool:bit0", offset: 0}
  - name: judge_preset
    uuid: 6e400022-b5a3-f393-e0a9-e50e24dcca9e
    fields:
      - {name: preset, type: utf8, offset: 0}
YAML
cat >"$W/devices.yaml" <<'YAML'
  - name: thermostat
    match: {address: "D0:12:34:56:78:9A"}
    mode: connected
    poll: [judge_setpoint, judge_boost, judge_preset]
    writable:
      - {name: setpoint_c, min: 5, max: 30, step: 0.5}
      - boost
      - {name: preset, platform: select, options: [comfort, eco, away]}
YAML
python3 - "$ROOT/config/demo.yaml" "$W/parsers.yaml" "$W/devices.yaml" "$PORT" >"$W/demo.yaml" <<'PY'
import sys
text, parsers, devices = (open(p).read() for p in sys.argv[1:4])
text = text.replace("mqtt://127.0.0.1:1883", f"mqtt://127.0.0.1:{sys.argv[4]}")
text = text.replace("\ndevices:\n", "\n" + parsers + "devices:\n", 1)
# States again 3 s after Home Assistant's birth (30 s by default): the thermostat reports once, before it starts.
text = text.replace("\nparsers:\n", "\nhomeassistant: {state_resend_delay: 3}\nparsers:\n", 1)
# Auto devices: the extra BTHome thermometer only.
text = text.replace("\nparsers:\n", '\nauto_devices: {enabled: true, allow: ["A4:C1:38:11:22:33"]}\nparsers:\n', 1)
# The RuuviTag publishes each field on its own topic (output: attribute), the other discovery shape.
ruuvi = "    mode: passive                     # RuuviTag RAWv2\n"
assert ruuvi in text
text = text.replace(ruuvi, ruuvi + "    output: attribute\n", 1)
text = text.replace("\nperipheral:", "\n" + devices + "peripheral:", 1)
print(text, end="")
PY
"$BIN/blebridge" run --config "$W/demo.yaml" >"$W/bridge.log" 2>&1 & BRIDGE=$!
PIDS+=($BRIDGE)
"$HASS" -c "$W/hass" --skip-pip >"$W/hass.log" 2>&1 & HA=$!

ready=0
for _ in $(seq 1 240); do
    grep -q "Setting up mqtt.sensor" "$W/hass.log" && { ready=1; break; }
    kill -0 $HA 2>/dev/null || break
    sleep 0.5
done
if [ $ready != 1 ]; then
    tail -40 "$W/hass.log" >&2
    echo "ha_judge: Home Assistant did not set up MQTT" >&2
    kill $HA
    exit 1
fi
# Halfway: the ear thermometer leaves the configuration (a reload, SIGHUP): its discovery is removed, and Home
# Assistant removes the device and its entities.
sleep $((SECONDS_AFTER / 2))
python3 - "$W/demo.yaml" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
text, n = re.subn(r"  - name: ear_thermometer\n(    .*\n)+", "", text)
assert n == 1
open(sys.argv[1], "w").write(text)
PY
kill -HUP $BRIDGE
sleep $((SECONDS_AFTER - SECONDS_AFTER / 2))
# The bridge stops (SIGTERM) while Home Assistant runs: its entities must all become unavailable. A marker message
# in all.log tells the judge where this begins.
mosquitto_pub -p "$PORT" -t judge/mark -m bridge-stopping
kill -TERM $BRIDGE
for _ in $(seq 1 40); do kill -0 $BRIDGE 2>/dev/null || break; sleep 0.5; done
sleep 3
# Then Home Assistant (it saves its registries on stop).
kill -TERM $HA
for _ in $(seq 1 60); do kill -0 $HA 2>/dev/null || break; sleep 0.5; done
kill -KILL $HA 2>/dev/null
echo "ha_judge: done"
