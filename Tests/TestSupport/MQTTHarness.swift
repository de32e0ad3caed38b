// MQTT test fixtures beyond MosquittoBroker: a throwaway certificate authority made with `openssl`, and a
// mosquitto password file made with `mosquitto_passwd`.
import Foundation

/// A test CA with one server certificate and one client certificate, generated with `openssl` in a temp dir.
public final class TestCertificates: @unchecked Sendable {
    public let directory: TemporaryDirectory
    public var caCertificate: String { path("ca.crt") }
    public var serverCertificate: String { path("server.crt") }
    public var serverKey: String { path("server.key") }
    public var clientCertificate: String { path("client.crt") }
    public var clientKey: String { path("client.key") }

    /// Makes the CA, a server certificate whose subjectAltName is `serverNames` (e.g. `["IP:127.0.0.1"]`), and a
    /// client certificate, all EC P-256, valid for a day.
    public init(serverNames: [String]) async throws {
        directory = try TemporaryDirectory(prefix: "blebridge-tls")
        guard let openssl = which("openssl") else { throw HarnessError("openssl not found") }
        func openSSL(_ arguments: [String]) async throws {
            let result = try await runCommand(openssl, arguments)
            guard result.status == 0 else {
                throw HarnessError("openssl \(arguments.joined(separator: " ")) failed: \(result.stderr)")
            }
        }
        let ecKey = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        try await openSSL(
            ["req", "-x509"] + ecKey + [
                "-keyout", path("ca.key"), "-out", path("ca.crt"), "-days", "1", "-subj", "/CN=blebridge test CA",
            ])
        for (name, subject, altNames) in [
            ("server", "/CN=blebridge test broker", serverNames), ("client", "/CN=blebridge-test-client", []),
        ] {
            try await openSSL(
                ["req"] + ecKey + ["-keyout", path("\(name).key"), "-out", path("\(name).csr"), "-subj", subject])
            var extensions = "basicConstraints=CA:FALSE\n"
            if !altNames.isEmpty { extensions += "subjectAltName=\(altNames.joined(separator: ","))\n" }
            try extensions.write(toFile: path("\(name).ext"), atomically: true, encoding: .utf8)
            try await openSSL([
                "x509", "-req", "-in", path("\(name).csr"), "-CA", path("ca.crt"), "-CAkey", path("ca.key"),
                "-CAcreateserial", "-out", path("\(name).crt"), "-days", "1", "-extfile", path("\(name).ext"),
            ])
        }
        // mosquitto started as root drops to the `mosquitto` user before it reads the key; these keys are
        // throwaway test keys, so let everyone read them.
        for name in ["ca.key", "server.key", "client.key"] {
            try FileManager.default.setAttributes([.posixPermissions: 0o644], ofItemAtPath: path(name))
        }
    }

    private func path(_ name: String) -> String { directory.url.appendingPathComponent(name).path }
}

/// A mosquitto password file with one user, made with `mosquitto_passwd -b -c`.
public func makeMosquittoPasswordFile(in directory: TemporaryDirectory, user: String, password: String) async throws
    -> String
{
    guard let tool = which("mosquitto_passwd") else { throw HarnessError("mosquitto_passwd not found") }
    let path = directory.url.appendingPathComponent("passwords").path
    let result = try await runCommand(tool, ["-b", "-c", path, user, password])
    guard result.status == 0 else { throw HarnessError("mosquitto_passwd failed: \(result.stderr)") }
    return path
}
