// metrics-sample <listen>: serves a fixed set of blebridge's metrics on <listen> (e.g. 127.0.0.1:0) until SIGTERM or
// SIGINT, for the Prometheus fidelity test. Prints `listening on <host>:<port>` on stdout once it accepts scrapes.
import Logging
import MetricsHTTP

#if canImport(Glibc)
    import Glibc
#elseif canImport(Musl)
    import Musl
#endif

func fail(_ message: String, code: Int32) -> Never {
    _ = "metrics-sample: \(message)\n".withCString { write(2, $0, strlen($0)) }
    exit(code)
}

/// The sample: every family the bridge exports, with values the fidelity test checks.
func sampleMetrics() throws(PrometheusTextError) -> PrometheusText {
    var text = PrometheusText()
    try text.counter(
        name: "blebridge_notifications_received_total", help: "GATT notifications received from devices.", value: 42)
    try text.counter(
        name: "blebridge_values_decoded_total", help: "Characteristic values decoded by a parser.", value: 40)
    try text.counter(
        name: "blebridge_decode_errors_total", help: "Characteristic values no parser could decode.", value: 2)
    try text.counter(
        name: "blebridge_advertisements_received_total", help: "BLE advertisements seen for configured devices.",
        value: 1234)
    try text.counter(name: "blebridge_mqtt_published_total", help: "Messages published to the broker.", value: 57)
    let reconnectHelp = "Reconnect attempts to devices, by the error that ended the link."
    try text.counter(
        name: "blebridge_reconnects_total", help: reconnectHelp,
        labels: ["error": "org.bluez.Error.Failed le-connection-abort-by-local"], value: 3)
    try text.counter(
        name: "blebridge_reconnects_total", help: reconnectHelp,
        labels: ["error": "odd \"quoted\" \\ text\nwith a newline"], value: 1)
    try text.gauge(name: "blebridge_devices_connected", help: "Devices connected right now.", value: 2)
    try text.gauge(name: "blebridge_mqtt_queue_depth", help: "Messages waiting to be published.", value: 0)
    try text.gauge(
        name: "blebridge_process_resident_memory_bytes", help: "Resident memory of the bridge process.",
        value: 12_345_678)
    let lastSeenHelp = "When each device was last heard from (Unix time)."
    try text.gauge(
        name: "blebridge_device_last_seen_timestamp_seconds", help: lastSeenHelp, labels: ["device": "kitchen-thermo"],
        value: 1_764_626_400.25)
    try text.gauge(
        name: "blebridge_device_last_seen_timestamp_seconds", help: lastSeenHelp, labels: ["device": "never-seen"],
        value: .nan)
    return text
}

let arguments = CommandLine.arguments
guard arguments.count == 2 else { fail("usage: metrics-sample <listen address, e.g. 127.0.0.1:0>", code: 2) }

let sample: PrometheusText
do {
    sample = try sampleMetrics()
} catch {
    fail("sample metrics are invalid: \(error)", code: 1)
}

// Block the signals before the server thread exists, so only sigwait below sees them.
var signals = sigset_t()
sigemptyset(&signals)
sigaddset(&signals, SIGTERM)
sigaddset(&signals, SIGINT)
pthread_sigmask(SIG_BLOCK, &signals, nil)

let server: MetricsHTTPServer
do {
    server = try MetricsHTTPServer(
        listen: arguments[1], logger: Logger(handler: StandardErrorLogHandler(), level: .warning))
    try server.start(handler: MetricsHTTPServer.prometheusHandler { sample })
} catch {
    fail("\(error)", code: 1)
}

let host = arguments[1].prefix(upTo: arguments[1].lastIndex(of: ":") ?? arguments[1].endIndex)
// One write(2), unbuffered, so the test reading our stdout sees the line at once.
_ = "listening on \(host):\(server.port ?? 0)\n".withCString { write(1, $0, strlen($0)) }

var received: Int32 = 0
sigwait(&signals, &received)
server.stop()
