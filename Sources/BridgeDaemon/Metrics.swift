// The Prometheus endpoint (`metrics: {listen: "127.0.0.1:9464"}`): the bridge's counters and gauges in the text
// exposition format, served by libmicrohttpd on a thread of its own.
import BridgeCore
import MetricsHTTP

/// The exposition for one scrape. Reads only lock-protected state, so it is safe on the server's thread.
func metricsText(_ bridge: Bridge) -> PrometheusText {
    var text = PrometheusText()
    let c = bridge.counters
    let status = bridge.status
    let mqtt = bridge.transportStatistics
    let devices = bridge.deviceMetrics
    func counter(_ name: String, _ help: String, _ value: Int, _ labels: [String: String] = [:]) {
        try? text.counter(name: name, help: help, labels: labels, value: Double(value))
    }
    func gauge(_ name: String, _ help: String, _ value: Double, _ labels: [String: String] = [:]) {
        try? text.gauge(name: name, help: help, labels: labels, value: value)
    }
    counter("blebridge_notifications_received_total", "GATT notifications and indications received.", c.notifications)
    counter(
        "blebridge_advertisements_received_total", "Advertisements (or advertised data changes) received.",
        c.advertisements)
    counter("blebridge_values_decoded_total", "Values decoded by a parser.", c.decoded)
    counter("blebridge_decode_errors_total", "Values a parser rejected.", c.decodeErrors)
    counter("blebridge_state_publishes_total", "Device state messages published.", c.statePublishes)
    counter(
        "blebridge_passive_duplicates_suppressed_total",
        "Several gateways: passive readings another gateway had published already.", c.duplicatesSuppressed)
    counter("blebridge_commands_total", "Commands received (/set, /get, bridge requests).", c.commands)
    counter("blebridge_mqtt_published_total", "MQTT messages handed to the broker connection.", mqtt.published)
    counter("blebridge_mqtt_received_total", "MQTT messages received.", mqtt.received)
    counter("blebridge_mqtt_dropped_total", "MQTT messages dropped from the full offline queue.", mqtt.dropped)
    if c.reconnects.isEmpty {
        counter(
            "blebridge_reconnects_total", "Reconnects and failed connection attempts, by error.", 0, ["error": "none"])
    }
    for (error, n) in c.reconnects.sorted(by: { $0.key < $1.key }) {
        counter(
            "blebridge_reconnects_total", "Reconnects and failed connection attempts, by error.", n, ["error": error])
    }
    gauge("blebridge_mqtt_connected", "1 while connected to the broker.", status.mqttConnected ? 1 : 0)
    gauge("blebridge_mqtt_queue_depth", "MQTT messages waiting for the broker.", Double(mqtt.queued))
    gauge("blebridge_bluetoothd_running", "1 while bluetoothd is on the bus.", status.bluetoothdRunning ? 1 : 0)
    gauge("blebridge_adapters", "Adapters available.", Double(status.adapters))
    gauge("blebridge_devices_known", "Devices the bridge knows.", Double(status.devicesKnown))
    gauge("blebridge_devices_online", "Devices whose availability is online.", Double(status.devicesOnline))
    gauge("blebridge_devices_connected", "Devices connected and streaming.", Double(devices.filter(\.connected).count))
    for (key, value) in processStatistics() {
        if key == "rss_kb", case .int(let kb) = value {
            gauge(
                "blebridge_process_resident_memory_bytes", "Resident memory of the bridge process.", Double(kb) * 1024)
        }
        if key == "cpu_s", case .double(let s) = value {
            try? text.counter(name: "blebridge_process_cpu_seconds_total", help: "CPU time used.", value: s)
        }
        if key == "threads", case .int(let n) = value {
            gauge("blebridge_process_threads", "Threads of the bridge process.", Double(n))
        }
    }
    if let p = bridge.peripheral?.snapshot {
        gauge("blebridge_peripheral_registered", "1 while the GATT application is registered.", p.registered ? 1 : 0)
        gauge("blebridge_peripheral_advertising", "1 while the connectable advertisement is on.", p.advertising ? 1 : 0)
        gauge("blebridge_peripheral_centrals", "Centrals connected to the served services.", Double(p.centrals))
        counter("blebridge_peripheral_values_set_total", "Values from MQTT set on served characteristics.", p.counters.valuesSet)
        counter(
            "blebridge_peripheral_encode_errors_total", "Values from MQTT that could not be encoded (dropped).",
            p.counters.encodeErrors)
        counter("blebridge_peripheral_writes_total", "Central writes published on a sink topic.", p.counters.writes)
        counter("blebridge_peripheral_write_errors_total", "Central writes refused with an ATT error.", p.counters.writeErrors)
        counter("blebridge_peripheral_broadcasts_total", "BTHome broadcast data updates.", p.counters.broadcasts)
    }
    for d in devices {
        if let seen = d.lastSeen {
            gauge(
                "blebridge_device_last_seen_timestamp_seconds", "When each device was last heard, seconds since 1970.",
                seen, ["device": d.id])
        }
        counter("blebridge_device_messages_total", "Messages received per device.", d.messages, ["device": d.id])
    }
    return text
}
