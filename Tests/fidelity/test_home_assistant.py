"""Home Assistant core as the judge of the bridge's MQTT discovery.

A real Home Assistant core (installed by scripts/install-deps.sh into its own virtualenv: it needs Python 3.13)
subscribes to the broker the bridge publishes to, with its MQTT integration (discovery on) and mqtt_statestream, which
publishes every entity's state back under hass/<domain>/<object id>/state. Tests/fidelity/ha_judge.sh runs the demo
(config/demo.yaml on config/demo-scenario.yaml's six sensors) with it, in a network namespace of its own when it can.
Judged: Home Assistant makes an entity of every component of every discovery message, with distinct entity ids; its
log has no warning or error about the bridge's discovery, templates or states; the states it shows are the bridge's
values (the RuuviTag's read from a topic per field, `output: attribute`); every device's entities are available; a
thermostat read once before Home Assistant started is shown (the states sent again after its birth); and the values
Home Assistant sets on writable entities (automations set the echo device's text, and a thermostat's number, switch
and select, a device the judge adds to the demo) are written to the devices and shown back in Home Assistant.
"""
import json
import math
import os
import pathlib
import re
import subprocess

import pytest

from conftest import ROOT

HA_VENV = pathlib.Path(os.environ.get("BLEBRIDGE_HA_VENV", "/var/cache/blebridge-ha/venv"))


class Judged:
    def __init__(self, work: pathlib.Path):
        self.work = work
        # Until the bridge stops (ha_judge.sh marks where), and after.
        self.messages, self.after_stop = [], []
        target = self.messages
        for line in (work / "all.log").read_text(errors="replace").splitlines():
            topic, _, payload = line.partition("\t")
            if topic == "judge/mark" and payload == "bridge-stopping":
                target = self.after_stop
                continue
            target.append((topic, payload))
        self.hass_log = (work / "hass.log").read_text(errors="replace")
        registry = json.loads((work / "hass" / ".storage" / "core.entity_registry").read_text())
        self.entities = [e for e in registry["data"]["entities"] if e["platform"] == "mqtt"]
        self.by_unique_id = {e["unique_id"]: e for e in self.entities}
        self.devices = json.loads((work / "hass" / ".storage" / "core.device_registry").read_text())["data"]["devices"]

    def discovery(self, removed=False):
        """The last discovery message of each bridge device (topic -> payload); with `removed`, of each device whose
        discovery was removed last (an empty message), instead."""
        last = {}
        for topic, payload in self.messages:
            if re.fullmatch(r"homeassistant/device/blebridge_[a-z0-9_]+/config", topic):
                last[topic] = json.loads(payload) if payload else None
        if removed:
            return [topic for topic, payload in last.items() if payload is None]
        return {topic: payload for topic, payload in last.items() if payload is not None}

    def states(self, entity_id):
        domain, object_id = entity_id.split(".", 1)
        return [p for t, p in self.messages if t == f"hass/{domain}/{object_id}/state"]

    def bridge_values(self, device, field):
        """The values the bridge published for a device's field: from its JSON state, or (output: attribute) from
        the field's own topic (a string as it is, anything else as JSON)."""
        values = []
        for topic, payload in self.messages:
            if topic == f"blebridge/{device}":
                state = json.loads(payload)
                if state.get(field) is not None:
                    values.append(state[field])
            elif topic == f"blebridge/{device}/{field}" and payload:
                try:
                    value = json.loads(payload)
                except ValueError:
                    value = payload
                if value is not None:
                    values.append(value)
        return values


@pytest.fixture(scope="module")
def judged(binaries, tmp_path_factory):
    hass = HA_VENV / "bin" / "hass"
    if not hass.exists():
        reason = HA_VENV.parent / "unavailable"
        if reason.exists():
            pytest.skip(f"Home Assistant core is not installed: {reason.read_text().strip()}")
        pytest.fail(f"{hass} is missing: run scripts/install-deps.sh, which installs Home Assistant core there")
    work = tmp_path_factory.mktemp("home-assistant")
    command = [str(ROOT / "Tests" / "fidelity" / "ha_judge.sh"), str(binaries), str(hass), str(work)]
    # Its own network namespace (loopback only) when the machine allows it, so that nothing can leave it.
    if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0:
        command = ["unshare", "-n"] + command
    result = subprocess.run(command, capture_output=True, text=True, timeout=420)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{(work / 'hass.log').read_text()[-4000:]}"
    return Judged(work)


def test_every_component_becomes_an_entity_with_its_own_id(judged):
    discovery = judged.discovery()
    # The bridge, the six demo devices, the judge's thermostat and auto device, less the ear thermometer (removed
    # by a reload).
    assert len(discovery) == 8, sorted(discovery)
    for topic, payload in discovery.items():
        for key, component in payload["cmps"].items():
            assert key in judged.by_unique_id, f"{topic}: Home Assistant made no entity of {key}"
            entity = judged.by_unique_id[key]
            assert entity["entity_id"].split(".")[0] == component["p"], (key, entity["entity_id"])
            assert entity["original_name"] == component["name"], key
    ids = [e["entity_id"] for e in judged.entities]
    assert len(ids) == len(set(ids))
    # Two entities of one device with the same name get "_2": every name of a device is its own.
    assert not [i for i in ids if re.search(r"_\d+$", i)], ids


def publishers(judged, topic, empty):
    """The client ids that published to `topic` (empty messages only, or non-empty ones), from mosquitto's log."""
    pattern = re.compile(r"Received PUBLISH from (\S+) \(.*'" + re.escape(topic) + r"', \.\.\. \((\d+) bytes\)\)")
    found = []
    for line in (judged.work / "mosquitto.log").read_text(errors="replace").splitlines():
        m = pattern.search(line)
        if m and (m.group(2) == "0") == empty:
            found.append(m.group(1))
    return found


def test_home_assistant_logs_nothing_about_the_bridge(judged):
    problems = []
    for line in judged.hass_log.splitlines():
        if not re.search(r"\b(WARNING|ERROR|CRITICAL)\b", line):
            continue
        # Home Assistant's own echo: removing a device's entities, it clears their discovery topic itself (an empty
        # retained message, so that they are not discovered again) and then warns about that message. The bridge
        # removed it once (test_a_device_that_leaves_the_configuration_leaves_home_assistant checks who sent what).
        if "No device components to cleanup for blebridge_ear_thermometer" in line:
            continue
        if re.search(r"homeassistant\.(components\.mqtt|helpers\.template|components\.sensor|components\.binary_sensor"
                     r"|components\.text|components\.number|components\.switch|components\.select|helpers\.entity)"
                     r"|blebridge|value_json", line):
            problems.append(line)
    assert not problems, "\n".join(problems)


def test_states_are_the_bridge_values(judged):
    discovery = judged.discovery()
    compared = 0
    for topic, payload in discovery.items():
        device = topic.split("/")[2].removeprefix("blebridge_")
        for key, component in payload["cmps"].items():
            field = key.removeprefix(f"blebridge_{device}_")
            sent = judged.bridge_values(device, field)
            states = judged.states(judged.by_unique_id[key]["entity_id"])
            shown = [s for s in states if s not in ("unknown", "unavailable")]
            if not sent or component["p"] not in ("sensor", "binary_sensor") or field == "last_seen":
                continue
            assert shown, f"{key}: the bridge sent {sent[:3]}, Home Assistant showed no value"
            if component["p"] == "binary_sensor":
                assert set(shown) <= {"on" if v else "off" for v in sent}, (key, sent[:5], shown[:5])
            elif isinstance(sent[0], (int, float)) and not isinstance(sent[0], bool):
                for s in shown:
                    assert any(math.isclose(float(s), v, rel_tol=1e-9) for v in sent), (key, s, sent[:5])
            else:
                assert set(shown) <= {str(v) for v in sent}, (key, sent[:5], shown[:5])
            compared += 1
    # Heart rate, energy, contact, battery, temperatures, humidity, pressure, RuuviTag's fields, RSSI, ...
    assert compared >= 25, compared


def test_a_device_with_a_topic_per_field_is_shown_too(judged):
    # output: attribute: no JSON state, each entity reads its field's topic (plain value).
    assert not any(t == "blebridge/ruuvi" for t, _ in judged.messages)
    ruuvi = judged.discovery()["homeassistant/device/blebridge_ruuvi/config"]
    component = ruuvi["cmps"]["blebridge_ruuvi_temperature_c"]
    assert component["state_topic"] == "blebridge/ruuvi/temperature_c" and "value_template" not in component
    sent = judged.bridge_values("ruuvi", "temperature_c")
    shown = [s for s in judged.states("sensor.ruuvi_temperature") if s not in ("unknown", "unavailable")]
    assert sent and shown and all(any(math.isclose(float(s), v) for v in sent) for s in shown), (sent, shown)


def test_every_device_is_available(judged):
    for topic, payload in judged.discovery().items():
        keys = list(payload["cmps"])
        last = {k: (judged.states(judged.by_unique_id[k]["entity_id"]) or ["(none)"])[-1] for k in keys}
        assert "unavailable" not in last.values(), (topic, last)
        assert any(v not in ("unknown", "(none)") for v in last.values()), (topic, last)


def test_a_value_set_in_home_assistant_reaches_the_device(judged):
    # Home Assistant's text entity publishes to its command topic; the bridge writes it (Nordic UART RX) and reports.
    assert ("blebridge/echo/set/message", "from home assistant") in judged.messages
    results = [json.loads(p) for t, p in judged.messages if t == "blebridge/echo/set/result"]
    assert any(r.get("status") == "ok" for r in results), results
    # The device echoes it (TX notification), and Home Assistant shows the echo.
    assert "from home assistant" in judged.bridge_values("echo", "echo")
    assert "from home assistant" in judged.states(judged.by_unique_id["blebridge_echo_echo"]["entity_id"])


def test_number_switch_and_select_set_in_home_assistant_are_written(judged):
    sent = {(t, p) for t, p in judged.messages if t.startswith("blebridge/thermostat/set/")}
    # What Home Assistant's number, switch and select entities publish on their command topics.
    assert {("blebridge/thermostat/set/setpoint_c", "22.5"), ("blebridge/thermostat/set/boost", "ON"),
            ("blebridge/thermostat/set/preset", "eco")} <= sent, sent
    results = [json.loads(p) for t, p in judged.messages if t == "blebridge/thermostat/set/result"]
    assert [r.get("status") for r in results].count("ok") >= 3, results
    assert judged.bridge_values("thermostat", "setpoint_c")[-1] == 22.5
    assert judged.bridge_values("thermostat", "boost")[-1] is True
    assert judged.bridge_values("thermostat", "preset")[-1] == "eco"
    # Read once after connecting, before Home Assistant started: shown because the bridge sends the states again
    # after Home Assistant's birth (homeassistant.state_resend_delay), then what Home Assistant set.
    setpoints = judged.states("number.thermostat_setpoint")
    assert setpoints[-2:] == ["21.0", "22.5"], setpoints
    assert "comfort" in judged.states("select.thermostat_preset")
    shown = {e: (judged.states(e) or ["(none)"])[-1]
             for e in ("number.thermostat_setpoint", "switch.thermostat_boost", "select.thermostat_preset")}
    assert shown == {"number.thermostat_setpoint": "22.5", "switch.thermostat_boost": "on",
                     "select.thermostat_preset": "eco"}, shown
    thermostat = judged.discovery()["homeassistant/device/blebridge_thermostat/config"]
    number = thermostat["cmps"]["blebridge_thermostat_setpoint_c"]
    assert (number["min"], number["max"], number["step"], number["unit_of_measurement"]) == (5, 30, 0.5, "°C"), number


def test_devices_hang_off_the_bridge_with_their_bluetooth_address(judged):
    devices = {ident[1]: d for d in judged.devices for ident in d["identifiers"] if ident[0] == "mqtt"}
    bridge = next(d for key, d in devices.items() if key.startswith("blebridge_bridge_"))
    for topic, payload in judged.discovery().items():
        key = payload["dev"]["ids"][0]
        if key.startswith("blebridge_bridge_"):
            continue
        device = devices[key]
        assert device["via_device_id"] == bridge["id"], key
        assert device["connections"] == [["bluetooth", payload["dev"]["cns"][0][1]]], key
        assert device["name"] == payload["dev"]["name"], key


def test_device_information_service_names_the_device(judged):
    # The chest strap of config/demo-scenario.yaml has 180A: Polar Electro Oy, model H10, firmware 3.1.1.
    strap = next(d for d in judged.devices if ["mqtt", "blebridge_chest_strap"] in d["identifiers"])
    assert (strap["manufacturer"], strap["model"], strap["sw_version"]) == ("Polar Electro Oy", "H10", "3.1.1"), strap
    # Without the service, the advertised name is the model.
    thermostat = next(d for d in judged.devices if ["mqtt", "blebridge_thermostat"] in d["identifiers"])
    assert (thermostat["manufacturer"], thermostat["model"]) == (None, "Acme Thermostat"), thermostat


def test_packet_counters_and_addresses_are_diagnostic(judged):
    by_entity = {e["entity_id"]: e for e in judged.entities}
    for entity in ("sensor.balcony_packet_id", "sensor.ruuvi_measurement_sequence", "sensor.ruuvi_mac",
                   "sensor.ruuvi_tx_power", "sensor.ruuvi_rssi"):
        assert by_entity[entity]["entity_category"] == "diagnostic", entity
    assert by_entity["sensor.ruuvi_temperature"]["entity_category"] is None


def test_a_device_that_leaves_the_configuration_leaves_home_assistant(judged):
    # Halfway through, the ear thermometer leaves the configuration (SIGHUP): its discovery is removed (an empty
    # retained message) and Home Assistant removes its device and entities.
    topic = "homeassistant/device/blebridge_ear_thermometer/config"
    assert judged.discovery(removed=True) == [topic]
    # The bridge removed it once; Home Assistant cleared it once more when it removed the entities.
    bridge = set(publishers(judged, topic, empty=False))
    assert len(bridge) == 1, bridge
    removals = publishers(judged, topic, empty=True)
    assert removals.count(next(iter(bridge))) == 1 and len(removals) == 2, removals
    assert not [e["entity_id"] for e in judged.entities if e["unique_id"].startswith("blebridge_ear_thermometer_")]
    assert not [d for d in judged.devices if ["mqtt", "blebridge_ear_thermometer"] in d["identifiers"]]
    # It had been there: its temperature was shown before.
    assert {"36.6", "36.7", "36.8"} & set(judged.states("sensor.ear_thermometer_temperature_degc"))


def test_every_entity_is_unavailable_once_the_bridge_stops(judged):
    # The bridge's last will and its shutdown say offline on bridge/state (and each device's availability), which
    # every entity's availability list includes.
    assert ("blebridge/bridge/state", '{"state":"offline"}') in judged.after_stop
    last = {t: p for t, p in judged.after_stop if t.startswith("hass/")}
    checked = 0
    for topic, payload in judged.discovery().items():
        for key in payload["cmps"]:
            entity = judged.by_unique_id[key]
            if entity["disabled_by"] is not None:  # last_seen: disabled by default, no state
                continue
            domain, object_id = entity["entity_id"].split(".", 1)
            expected = "off" if key.startswith("blebridge_bridge_") else "unavailable"
            assert last.get(f"hass/{domain}/{object_id}/state") == expected, (entity["entity_id"], expected)
            checked += 1
    assert checked >= 30, checked  # every enabled entity of the seven devices and the bridge


def test_an_auto_device_is_a_home_assistant_device_too(judged):
    # auto_devices: the BTHome thermometer no entry names, id its compact address, named by its advertised name.
    payload = judged.discovery()["homeassistant/device/blebridge_a4c138112233/config"]
    assert payload["dev"]["name"] == "ATC_112233"
    entity = judged.by_unique_id["blebridge_a4c138112233_temperature_c"]["entity_id"]
    assert {"18.0", "18.1"} & set(judged.states(entity)), judged.states(entity)
