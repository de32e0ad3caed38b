// Helpers for the BLE client and command tests: blocking fixture work (starting and stopping processes, waiting
// for a child to exit) runs on its own thread so it never stalls the cooperative pool that every test shares.
import Foundation

/// Runs a blocking `body` on a fresh thread and returns its result.
public func offPool<T: Sendable>(_ body: @escaping @Sendable () throws -> T) async throws -> T {
    try await withCheckedThrowingContinuation { continuation in
        let thread = Thread { continuation.resume(with: Result { try body() }) }
        thread.start()
    }
}

/// Stops a simulator fixture on a background thread (its processes can take seconds to exit).
public func stopInBackground(_ fixture: SimulatorFixture) {
    Thread { fixture.stop() }.start()
}
