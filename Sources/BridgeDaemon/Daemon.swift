// Wiring of `blebridge run`: the MQTT transport, the BlueZ central and the bridge, started in order, stopped in
// reverse on SIGTERM/SIGINT.
import BlueZ
import BridgeAdapters
import BridgeCore
import BridgeKit
import Dispatch
import GATTCrypto
import Logging
import MetricsHTTP
import Signals

#if canImport(Glibc)
    import Glibc
#endif

/// The running daemon.
struct Daemon {
    let config: BridgeConfig
    let configPath: String
    let stateDirectory: String?
    let logger: Logger

    func run() async -> Int32 {
        // With several gateways their id names them (client id, via_device, bridge/info), whatever the host.
        let host = config.gateway?.id ?? hostName()
        let (transport, central): (MQTTBrokerTransport, BlueZCentral)
        switch await startParts(
            config, clientID: "blebridge-\(host)", requiredAdapters: config.bluetooth.adapters,
            adapterKey: "bluetooth.adapters", logger: logger)
        {
        case .failure(let exit): return exit.code
        case .success(let parts): (transport, central) = parts
        }
        // A round of notifications under load leaves for the broker together: its publishes are held and sent with
        // one write.
        let rounds = BlueZNotificationRounds.observe(
            .init(begin: { transport.holdWrites() }, end: { transport.releaseWrites() }))
        defer { BlueZNotificationRounds.stopObserving(rounds) }
        // Advertisements come one signal at a time (500 advertisers at 1 Hz: a round every 2 ms): their publishes are
        // held for up to `SignalRoundBatcher.window` and leave together.
        let batcher = SignalRoundBatcher(transport: transport)
        let signalRounds = BlueZSignalRounds.observe(batcher.observer)
        defer {
            BlueZSignalRounds.stopObserving(signalRounds)
            batcher.finish()
        }
        let path = configPath
        if let stateDirectory { mkdir(stateDirectory, 0o700) }
        var mqtt: any MQTTTransport = transport
        var journal: DiskQueuedTransport?
        if config.mqtt.offlineQueueOnDisk, let stateDirectory {
            let disk = DiskQueuedTransport(base: transport, directory: stateDirectory, logger: logger)
            journal = disk
            mqtt = disk
        }
        let bridge = Bridge(
            config: config, central: PreStartedCentral(central), mqtt: mqtt, clock: SystemBridgeClock(),
            logger: logger, gatewayName: host, processStatistics: processStatistics,
            configSource: { loadConfig(path) }, store: stateDirectory.map { FileStateStore(directory: $0) },
            peripheralHost: config.peripheral == nil ? nil : BlueZPeripheralHost(central: central, logger: logger))
        var metrics: MetricsHTTPServer?
        if let listen = config.metricsListen {
            do {
                let server = try MetricsHTTPServer(listen: listen, logger: logger)
                try server.start(handler: MetricsHTTPServer.prometheusHandler { metricsText(bridge) })
                metrics = server
                logger.labelled(component: "metrics").info("Prometheus metrics on http://\(listen)/metrics")
            } catch {
                logger.error("configuration: metrics.listen: \(error)")
                await central.close()
                await transport.client.disconnect()
                return ExitCode.configError
            }
        }
        let notifier = SystemdNotifier()
        let runTask = Task { await bridge.run() }
        let queue = DispatchQueue(label: "blebridge.daemon")
        var sources = stopOnSignals(runTask, notifier: notifier)
        let log = logger.labelled(component: "bridge")
        sources.append(
            ProcessSignals.on(SIGHUP) { _ in
                Task {
                    notifier.send("RELOADING=1\nMONOTONIC_USEC=\(monotonicMicroseconds())")
                    log.info("SIGHUP: reloading \(path)")
                    _ = await bridge.reloadFromSource()
                    notifier.send("READY=1\nSTATUS=\(bridge.status.text)")
                }
            })
        // READY, STATUS and the watchdog from a timer of their own: a stalled main loop stops the pings. Only for a
        // service manager that listens (NOTIFY_SOCKET), and the disk queue's sync only with a disk queue: a timer
        // with nothing to do still wakes a thread at each tick (5 a second, ~0.3 ms of CPU, on this machine).
        let timer = notifier.isActive ? DispatchSource.makeTimerSource(queue: queue) : nil
        // A quarter of a second: pings land within that of their due time, and READY/STATUS follow changes quickly.
        let period = Duration.milliseconds(250)
        let watchdogLimit = max((notifier.watchdogInterval ?? .seconds(5)), .seconds(3))
        let notifyState = NotifyState()
        timer?.schedule(deadline: .now(), repeating: .milliseconds(Int(period.seconds * 1000)))
        timer?.setEventHandler {
            guard !runTask.isCancelled else { return }
            let status = bridge.status
            var lines: [String] = []
            if !notifyState.ready, status.isReady {
                notifyState.ready = true
                lines.append("READY=1")
            }
            let text = status.text
            if text != notifyState.lastStatus {
                notifyState.lastStatus = text
                lines.append("STATUS=\(text)")
            }
            if let interval = notifier.watchdogInterval,
                ContinuousClock.now - notifyState.lastPing >= interval - .milliseconds(200),
                status.allowsWatchdog(now: .now, limit: watchdogLimit)
            {
                notifyState.lastPing = .now
                lines.append("WATCHDOG=1")
            }
            if !lines.isEmpty { notifier.send(lines.joined(separator: "\n")) }
        }
        let syncTimer = journal == nil ? nil : DispatchSource.makeTimerSource(queue: queue)
        syncTimer?.schedule(deadline: .now() + 1, repeating: 1)
        syncTimer?.setEventHandler { journal?.sync() }
        syncTimer?.resume()
        timer?.resume()
        await runTask.value
        metrics?.stop()
        timer?.cancel()
        syncTimer?.cancel()
        journal?.sync()
        for source in sources { source.cancel() }
        await central.close()
        await transport.client.disconnect()
        logger.labelled(component: "bridge").info("exit")
        return ExitCode.success
    }

    func hostName() -> String {
        var buffer = [CChar](repeating: 0, count: 256)
        guard gethostname(&buffer, buffer.count - 1) == 0 else { return "blebridge" }
        let name = buffer.withUnsafeBufferPointer { String(cString: $0.baseAddress!) }
        return name.isEmpty ? "blebridge" : name
    }
}

/// The central after the daemon's own `start()`: the bridge's `start()` only reads the adapters.
final class PreStartedCentral: BLECentral {
    let base: BlueZCentral
    init(_ base: BlueZCentral) { self.base = base }
    func start() async throws(BLEError) -> [BLEAdapterInfo] {
        guard base.bluetoothdRunning else {
            throw BLEError(
                .bluetoothdUnavailable,
                message: "bluetoothd (org.bluez) is not running on the system bus; start bluetooth.service")
        }
        return base.adapters()
    }
    func events() -> AsyncStream<BLECentralEvent> { base.events() }
    func adapters() -> [BLEAdapterInfo] { base.adapters() }
    func startScanning(_ request: BLEScanRequest) async throws(BLEError) { try await base.startScanning(request) }
    func stopScanning() async { await base.stopScanning() }
    func deliverScanResults(to deliver: @escaping @Sendable (BLECentralEvent) -> Void) {
        base.deliverScanResults(to: deliver)
    }
    func connect(_ address: BLEAddress, adapter: String, timeout: Duration) async throws(BLEError) -> any BLELink {
        try await base.connect(address, adapter: adapter, timeout: timeout)
    }
    func removeDevice(_ address: BLEAddress, adapter: String) async throws(BLEError) {
        try await base.removeDevice(address, adapter: adapter)
    }
    func connectedDevices() -> [BLEAdvertisement] { base.connectedDevices() }
    func disconnect(_ address: BLEAddress, adapter: String) async throws(BLEError) {
        try await base.disconnect(address, adapter: adapter)
    }
    func close() async { await base.close() }
}

/// RSS and CPU time of this process, for `bridge/health`.
func processStatistics() -> [(String, JSONValue)] {
    var usage = rusage()
    getrusage(RUSAGE_SELF.rawValue, &usage)
    let cpu =
        Double(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec)
        + Double(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) / 1e6
    var fields: [(String, JSONValue)] = [("cpu_s", .double((cpu * 1000).rounded() / 1000))]
    if let status = fopen("/proc/self/status", "r") {
        defer { fclose(status) }
        var line = [CChar](repeating: 0, count: 256)
        while fgets(&line, Int32(line.count), status) != nil {
            let text = line.withUnsafeBufferPointer { String(cString: $0.baseAddress!) }
            for (key, name) in [("VmRSS:", "rss_kb"), ("VmHWM:", "peak_rss_kb"), ("Threads:", "threads")]
            where text.hasPrefix(key) {
                let digits = text.dropFirst(key.count).filter(\.isNumber)
                if let v = Int64(digits) { fields.append((name, .int(v))) }
            }
        }
    }
    return fields
}

/// Only touched on the daemon's dispatch queue.
final class NotifyState: @unchecked Sendable {
    var ready = false
    var lastStatus = ""
    var lastPing = ContinuousClock.now - .seconds(3600)
}

/// CLOCK_MONOTONIC in microseconds (sd_notify's MONOTONIC_USEC).
func monotonicMicroseconds() -> Int64 {
    var ts = timespec()
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return Int64(ts.tv_sec) * 1_000_000 + Int64(ts.tv_nsec) / 1000
}

/// `blebridge serve`: the peripheral role alone, stopped on SIGTERM/SIGINT.
struct ServeDaemon {
    let config: BridgeConfig
    let logger: Logger

    func run() async -> Int32 {
        let host = Daemon(config: config, configPath: "", stateDirectory: nil, logger: logger).hostName()
        let adapters = config.peripheral?.adapter.map { [$0] } ?? []
        let (transport, central): (MQTTBrokerTransport, BlueZCentral)
        switch await startParts(
            config, clientID: "blebridge-serve-\(host)", requiredAdapters: adapters, adapterKey: "peripheral.adapter",
            logger: logger)
        {
        case .failure(let exit): return exit.code
        case .success(let parts): (transport, central) = parts
        }
        let runner = PeripheralBridge(
            config: config, host: BlueZPeripheralHost(central: central, logger: logger), mqtt: transport,
            clock: SystemBridgeClock(), logger: logger, gatewayName: host)
        let notifier = SystemdNotifier()
        let runTask = Task { await runner.run() }
        let queue = DispatchQueue(label: "blebridge.serve")
        let sources = stopOnSignals(runTask, notifier: notifier)
        notifier.send("READY=1\nSTATUS=serving")
        // The service manager's watchdog (WatchdogSec= in the unit): a ping every half interval while serving.
        let timer = DispatchSource.makeTimerSource(queue: queue)
        let notifyState = NotifyState()
        timer.schedule(deadline: .now(), repeating: .milliseconds(250))
        timer.setEventHandler {
            guard notifier.isActive, !runTask.isCancelled, let interval = notifier.watchdogInterval,
                ContinuousClock.now - notifyState.lastPing >= interval - .milliseconds(200)
            else { return }
            notifyState.lastPing = .now
            notifier.send("WATCHDOG=1")
        }
        timer.resume()
        await runTask.value
        timer.cancel()
        for source in sources { source.cancel() }
        await central.close()
        await transport.client.disconnect()
        logger.labelled(component: "serve").info("exit")
        return ExitCode.success
    }
}

/// Why the daemon could not start: its exit status.
struct StartFailure: Error {
    let code: Int32
}

/// The broker transport (started) and the BlueZ central (started), in the order `run` and `serve`
/// need them: a bad MQTT setting or a missing configured adapter is a configuration error (78), a D-Bus policy
/// denial stops with 77, bluetoothd not running yet is only a warning (the process waits for it).
///
/// - Parameter adapterKey: the configuration key `requiredAdapters` come from, for the error.
func startParts(
    _ config: BridgeConfig, clientID: String, requiredAdapters: [String], adapterKey: String, logger: Logger
) async -> Result<(MQTTBrokerTransport, BlueZCentral), StartFailure> {
    Bridge.cipher = OpenSSLAESCCM()
    let transport: MQTTBrokerTransport
    do {
        transport = try MQTTBrokerTransport(
            settings: config.mqtt, defaultClientID: clientID, gateway: config.gateway?.id)
    } catch {
        logger.error("configuration: \(error)")
        return .failure(StartFailure(code: ExitCode.configError))
    }
    let central: BlueZCentral
    do {
        central = try BlueZCentral(logger: logger)
    } catch {
        logger.error("\(error.message)")
        return .failure(StartFailure(code: ExitCode.unavailable))
    }
    // Configured adapters must exist before anything connects.
    do {
        let adapters = try await central.start()
        let missing = requiredAdapters.filter { name in
            !adapters.contains { $0.name == name || $0.address.uppercased() == name.uppercased() }
        }
        if !missing.isEmpty {
            logger.error(
                "configuration: \(adapterKey): \(missing.joined(separator: ", ")) not found (there are: "
                    + "\(adapters.isEmpty ? "none" : adapters.map(\.name).joined(separator: ", ")))")
            await central.close()
            return .failure(StartFailure(code: ExitCode.configError))
        }
    } catch {
        if error.kind == .notPermitted {
            // A D-Bus policy denial does not go away by waiting: say what to change and stop.
            logger.error("\(error.message)")
            await central.close()
            return .failure(StartFailure(code: ExitCode.notPermitted))
        }
        logger.warning("\(error.message); starting anyway and waiting for bluetoothd")
    }
    do {
        try transport.client.start()
    } catch {
        logger.error("MQTT: \(error)")
        await central.close()
        return .failure(StartFailure(code: ExitCode.configError))
    }
    return .success((transport, central))
}

/// SIGINT and SIGTERM cancel `task` (a clean stop, `STOPPING=1` to systemd); a second one ends the process at once.
func stopOnSignals(_ task: Task<Void, Never>, notifier: SystemdNotifier) -> [ProcessSignals.Token] {
    [SIGINT, SIGTERM].map { sig in
        ProcessSignals.on(sig) { sig in
            // The first signal asks for a clean stop; a second one (the operator insisting) ends the process now.
            if task.isCancelled { exit(128 + sig) }
            notifier.send("STOPPING=1\nSTATUS=stopping")
            task.cancel()
        }
    }
}
