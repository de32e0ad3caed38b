// `blebridge serve`: the peripheral role alone (MQTT → BLE), without central sessions. It keeps the bridge's
// retained `bridge/state` and `bridge/info` so a user sees it the same way as `blebridge run`.
import Logging
import Synchronization

/// Runs only the `peripheral:` section of a configuration over an MQTT transport and a peripheral host.
public final class PeripheralBridge: Sendable {
    let mqtt: any MQTTTransport
    let topics: BridgeTopics
    let logger: Logger
    let gatewayName: String
    /// Whether the broker connection is up, and whether the source topics are subscribed: `bridge/state` online
    /// waits for both (it tells a client that values published from now on are served).
    let mqttState = Mutex((connected: false, subscribed: false))
    /// The peripheral service (nil when the configuration has no `peripheral:` section).
    public let service: PeripheralService?

    /// A runner for `config`.
    public init(
        config: BridgeConfig, host: any BLEPeripheralHost, mqtt: any MQTTTransport, clock: any BridgeClock,
        logger: Logger, gatewayName: String = "blebridge"
    ) {
        self.mqtt = mqtt
        self.gatewayName = gatewayName
        let topics = config.topics
        self.topics = topics
        let logger = Bridge.forwarding(logger, to: mqtt, config: config).labelled(component: "serve")
        self.logger = logger
        let box = WeakRunner()
        if let p = config.peripheral {
            service = PeripheralService(
                config: p, registry: config.registry, host: host, topics: topics, qos: config.mqtt.qos,
                maxPayload: config.mqtt.maxPayload, clock: clock, logger: logger,
                status: {
                    let up = box.runner.withLock { $0 }?.mqttState.withLock { $0.connected } ?? false
                    return Bridge.Status(
                        mqttConnected: up, bluetoothdRunning: true, adapters: 1, devicesOnline: 0, devicesKnown: 0,
                        heartbeat: .now)
                },
                changed: { box.runner.withLock { $0 }?.publishInfo() },
                publish: { try? mqtt.publish($0) })
        } else {
            service = nil
        }
        box.runner.withLock { $0 = self }
    }

    final class WeakRunner: Sendable {
        let runner = Mutex<PeripheralBridge?>(nil)
    }

    /// Serves until cancelled; then unregisters, publishes `bridge/state` offline and returns.
    public func run() async {
        guard let service else {
            logger.error("the configuration has no 'peripheral' section: nothing to serve")
            return
        }
        // Taken before the first subscribe: `incoming()` gives what arrives from then on, and the retained source
        // values a subscribe brings must not be lost to a consumer that starts a moment later.
        let incoming = mqtt.incoming()
        await withTaskGroup(of: Void.self) { group in
            group.addTask {
                for await state in self.mqtt.states() {
                    let up = state == .connected
                    let birth = self.mqttState.withLock { s -> Bool in
                        s.connected = up
                        return up && s.subscribed
                    }
                    if birth { self.publishBirth() }
                }
            }
            group.addTask {
                await self.mqtt.subscribe(all: service.sourceTopics) { [logger = self.logger] topic, error in
                    logger.error("cannot subscribe to \(topic): \(error); its values are not served")
                }
                // Connected meanwhile: that connection's birth waited for this.
                let birth = self.mqttState.withLock { s -> Bool in
                    s.subscribed = true
                    return s.connected
                }
                if birth { self.publishBirth() }
            }
            group.addTask {
                for await message in incoming {
                    if Task.isCancelled { return }
                    _ = service.handle(message)
                }
            }
            group.addTask { await service.run() }
            await withTaskCancellationHandler {
                await waitForever()
            } onCancel: {
            }
            logger.info("shutting down")
            group.cancelAll()
        }
        publish(topics.bridgeState, .object([("state", .string("offline"))]))
        logger.info("stopped")
    }

    /// `bridge/state` online and `bridge/info`.
    func publishBirth() {
        publish(topics.bridgeState, .object([("state", .string("online"))]))
        publishInfo()
    }

    func publishInfo() {
        guard let service else { return }
        publish(
            topics.bridgeInfo,
            .object([
                ("version", .string(BridgeVersion.current)), ("gateway", .string(gatewayName)),
                ("mode", .string("serve")), ("peripheral", service.info),
            ]))
    }

    func publish(_ topic: String, _ value: JSONValue) {
        try? mqtt.publish(BridgeOutgoingMessage(topic: topic, payload: value.bytes, qos: 1, retain: true))
    }
}
