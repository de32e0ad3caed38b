// poll(2)'s interface over an epoll(7) set kept from round to round, for the D-Bus I/O loop: the loop still says what
// it waits for as a pollfd list each round (every connection's wake-up socket and enabled watches), but the kernel
// only looks at the descriptors that are ready. With a connection per connected peripheral, poll(2) had the kernel
// check every socket of every connection at every wake-up: with a hundred devices half of the loop's CPU went there.
import CLinux

#if canImport(Glibc)
    import Glibc
#endif

/// Owned by the loop's thread (not thread-safe). One difference from poll(2): a descriptor closed while registered
/// leaves the epoll set without an event, so it is not reported at all (poll(2) says POLLNVAL at every call); one
/// that cannot be registered (closed before its first wait, or after a `reset`) is reported POLLNVAL. libdbus removes
/// a connection's watches before it closes the socket, and the loop resets the set when connections come or go.
struct PollSet {
    private var epoll: Int32 = -1
    /// Per descriptor: the events registered in the epoll set (`registeredFlag` set when registered at all).
    private var registered: [UInt32] = []
    /// Per descriptor: the events asked for this round, valid when `stamp` is this round's.
    private var wanted: [UInt32] = []
    private var stamp: [UInt32] = []
    private var round: UInt32 = 0
    /// The descriptors now in the epoll set.
    private var members: [Int32] = []
    private var nextMembers: [Int32] = []
    /// Descriptors epoll_ctl refused (closed, not pollable): reported as POLLNVAL, as poll(2) reports them.
    private var invalid: [Int32] = []
    private var ready: [epoll_event] = []
    private var readyEvents: [UInt32] = []
    private var readyStamp: [UInt32] = []

    private static let registeredFlag: UInt32 = 1 << 31

    /// Forgets the set (the next wait registers everything again): after connections came or went, a descriptor
    /// number may name another socket than the one registered under it.
    mutating func reset() {
        if epoll >= 0 { close(epoll) }
        epoll = -1
        for fd in members where Int(fd) < registered.count { registered[Int(fd)] = 0 }
        members.removeAll(keepingCapacity: true)
    }

    /// Waits as `poll(fds, timeoutMs)` does and sets each entry's `revents` the same way; returns what poll would
    /// (the number of entries with events, 0 on timeout, -1 with `errno` on failure). The same descriptor may appear
    /// more than once. Falls back to poll(2) when no epoll instance can be had.
    mutating func wait(_ fds: inout [pollfd], timeoutMs: Int32) -> Int32 {
        if epoll < 0 {
            epoll = epoll_create1(Int32(EPOLL_CLOEXEC))
            if epoll < 0 { return poll(&fds, nfds_t(fds.count), timeoutMs) }
        }
        round &+= 1
        if round == 0 {
            // Wrapped: stale stamps could match again.
            for i in stamp.indices { stamp[i] = 0 }
            for i in readyStamp.indices { readyStamp[i] = 0 }
            round = 1
        }
        invalid.removeAll(keepingCapacity: true)
        for f in fds {
            guard f.fd >= 0 else { continue }
            let fd = Int(f.fd)
            grow(to: fd + 1)
            let events = UInt32(UInt16(bitPattern: f.events))
            if stamp[fd] == round {
                wanted[fd] |= events
            } else {
                stamp[fd] = round
                wanted[fd] = events
            }
        }
        // Gone since the last round: out of the set (an error only means the kernel already dropped it on close).
        nextMembers.removeAll(keepingCapacity: true)
        for fd in members {
            if stamp[Int(fd)] == round {
                nextMembers.append(fd)
            } else {
                _ = epoll_ctl(epoll, EPOLL_CTL_DEL, fd, nil)
                registered[Int(fd)] = 0
            }
        }
        swap(&members, &nextMembers)
        // New or changed.
        for f in fds {
            guard f.fd >= 0 else { continue }
            let fd = Int(f.fd)
            let want = wanted[fd] | Self.registeredFlag
            guard registered[fd] != want else { continue }
            var event = epoll_event()
            event.events = wanted[fd]
            event.data.fd = f.fd
            let isMember = registered[fd] != 0
            var rc = epoll_ctl(epoll, isMember ? EPOLL_CTL_MOD : EPOLL_CTL_ADD, f.fd, &event)
            if rc < 0, errno == EEXIST {
                rc = epoll_ctl(epoll, EPOLL_CTL_MOD, f.fd, &event)
            } else if rc < 0, errno == ENOENT {
                rc = epoll_ctl(epoll, EPOLL_CTL_ADD, f.fd, &event)
            }
            if rc == 0 {
                if !isMember { members.append(f.fd) }
                registered[fd] = want
            } else {
                if isMember { members.removeAll { $0 == f.fd } }
                registered[fd] = 0
                invalid.append(f.fd)
            }
        }
        let capacity = max(16, members.count + 1)
        if ready.count < capacity { ready = [epoll_event](repeating: epoll_event(), count: capacity) }
        let n = ready.withUnsafeMutableBufferPointer {
            epoll_wait(epoll, $0.baseAddress, Int32(capacity), invalid.isEmpty ? timeoutMs : 0)
        }
        if n < 0 { return -1 }
        for i in 0..<Int(n) {
            let fd = Int(ready[i].data.fd)
            guard fd >= 0, fd < readyStamp.count else { continue }
            readyStamp[fd] = round
            readyEvents[fd] = ready[i].events
        }
        for fd in invalid {
            readyStamp[Int(fd)] = round
            readyEvents[Int(fd)] = UInt32(POLLNVAL)
        }
        var count: Int32 = 0
        let always = UInt32(POLLERR) | UInt32(POLLHUP) | UInt32(POLLNVAL)
        for i in fds.indices {
            let fd = Int(fds[i].fd)
            guard fd >= 0, readyStamp[fd] == round else {
                fds[i].revents = 0
                continue
            }
            let mask = UInt32(UInt16(bitPattern: fds[i].events)) | always
            fds[i].revents = Int16(truncatingIfNeeded: readyEvents[fd] & mask)
            if fds[i].revents != 0 { count += 1 }
        }
        return count
    }

    private mutating func grow(to size: Int) {
        guard registered.count < size else { return }
        let n = max(size, registered.count * 2, 64)
        registered += [UInt32](repeating: 0, count: n - registered.count)
        wanted += [UInt32](repeating: 0, count: n - wanted.count)
        stamp += [UInt32](repeating: 0, count: n - stamp.count)
        readyEvents += [UInt32](repeating: 0, count: n - readyEvents.count)
        readyStamp += [UInt32](repeating: 0, count: n - readyStamp.count)
    }
}
