// The few syscalls the simulator needs: SOCK_SEQPACKET socketpairs for AcquireNotify/AcquireWrite.
#if canImport(Glibc)
    import Glibc
#elseif canImport(Musl)
    import Musl
#endif

/// A socketpair(AF_UNIX, SOCK_SEQPACKET|SOCK_NONBLOCK|SOCK_CLOEXEC) as BlueZ creates it; nil with errno on failure.
func makeSeqPacketPair() -> (Int32, Int32)? {
    var fds: [Int32] = [-1, -1]
    let type = Int32(SOCK_SEQPACKET.rawValue) | Int32(SOCK_NONBLOCK.rawValue) | Int32(SOCK_CLOEXEC.rawValue)
    guard socketpair(AF_UNIX, type, 0, &fds) == 0 else { return nil }
    return (fds[0], fds[1])
}

/// Sends one datagram without blocking; false when it could not be queued (buffer full, peer gone).
func sendDatagram(_ fd: Int32, _ bytes: [UInt8]) -> Bool {
    bytes.withUnsafeBytes { send(fd, $0.baseAddress, $0.count, Int32(MSG_DONTWAIT) | Int32(MSG_NOSIGNAL)) }
        == bytes.count
}

/// Reads one datagram (up to 512 bytes, bluetoothd's buffer). `.eof` when the peer closed, `.none` when nothing waits.
enum DatagramRead {
    case datagram([UInt8])
    case none
    case eof
}

/// Every datagram queued on `fd` now, and whether the peer closed it (read on the timer queue, so a read source does
/// not fire again and again; the caller applies the result on the loop).
func readAllDatagrams(_ fd: Int32) -> (datagrams: [[UInt8]], eof: Bool) {
    var datagrams: [[UInt8]] = []
    while true {
        switch readDatagram(fd) {
        case .datagram(let bytes): datagrams.append(bytes)
        case .none: return (datagrams, false)
        case .eof: return (datagrams, true)
        }
    }
}

func readDatagram(_ fd: Int32) -> DatagramRead {
    var buffer = [UInt8](repeating: 0, count: 512)
    let n = buffer.withUnsafeMutableBytes { recv(fd, $0.baseAddress, $0.count, Int32(MSG_DONTWAIT)) }
    if n > 0 { return .datagram(Array(buffer[0..<n])) }
    if n == 0 { return .eof }
    return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? .none : .eof
}

func closeFD(_ fd: Int32) -> Int32 { close(fd) }

/// Seconds on the monotonic clock.
func monotonicSeconds() -> Double {
    var ts = timespec()
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return Double(ts.tv_sec) + Double(ts.tv_nsec) / 1e9
}

func fputsStderr(_ s: UnsafePointer<CChar>) -> Int { write(2, s, strlen(s)) }
