// Process-wide settings a program that links the MQTT client makes once, at startup.
#if canImport(Glibc)
    import Glibc
#elseif canImport(Musl)
    import Musl
#endif

/// Process-wide settings for programs that use `MQTTClient`.
public enum MQTTProcess {
    /// Makes a connection that the broker drops while the client writes to it a lost connection instead of the end
    /// of the process: sets SIGPIPE to SIG_IGN for the whole process.
    ///
    /// libmosquitto writes to its socket with plain write(2) (OpenSSL's SSL_write for TLS), not with
    /// `send(..., MSG_NOSIGNAL)`. Once the peer has closed or reset the connection, such a write raises SIGPIPE, and
    /// the default action of SIGPIPE ends the process without a word. With SIGPIPE ignored the write fails with
    /// EPIPE instead, and the client reports the lost connection in `MQTTClient.connectionStates()` and reconnects.
    ///
    /// Call it once at process start, before the first client connects (before other threads start, so none of them
    /// can be writing while the disposition changes). Calling it again does no harm. Child processes started later
    /// inherit the ignored SIGPIPE (execve keeps ignored signals ignored), so a child that relies on the default must
    /// reset it.
    public static func ignoreBrokenPipe() {
        _ = signal(SIGPIPE, SIG_IGN)
    }
}
