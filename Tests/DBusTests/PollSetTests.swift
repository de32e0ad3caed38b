// PollSet: the D-Bus I/O loop's wait, poll(2)'s interface over an epoll(7) set kept between rounds. It must report
// what poll(2) reports for the same list: readiness per entry (also for a descriptor listed twice), hang-ups, nothing
// for a descriptor dropped from the list, POLLNVAL for a closed one it registers, and the right socket after a reset
// when a descriptor number was reused.
@testable import DBus
import Foundation
import Testing

#if canImport(Glibc)
    import Glibc
#endif

@Suite struct PollSetTests {
    private func pair() throws -> (Int32, Int32) {
        var fds: [Int32] = [-1, -1]
        let type = Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue) | Int32(SOCK_NONBLOCK.rawValue)
        guard socketpair(AF_UNIX, type, 0, &fds) == 0 else { throw POSIXError(.EIO) }
        return (fds[0], fds[1])
    }

    private func send(_ fd: Int32) { var b: UInt8 = 1; _ = write(fd, &b, 1) }

    private func drain(_ fd: Int32) {
        var buffer = [UInt8](repeating: 0, count: 64)
        while read(fd, &buffer, buffer.count) > 0 {}
    }

    /// The same list through poll(2), for comparison.
    private func polled(_ list: [pollfd]) -> [Int16] {
        var copy = list
        _ = poll(&copy, nfds_t(copy.count), 0)
        return copy.map(\.revents)
    }

    @Test func reportsWhatPollReports() throws {
        let (a, a2) = try pair()
        let (b, b2) = try pair()
        // b2 is closed by the test itself (closing it twice could close another test's descriptor meanwhile).
        defer { for fd in [a, a2, b] { close(fd) } }
        var set = PollSet()
        var list = [
            pollfd(fd: a, events: Int16(POLLIN), revents: 0), pollfd(fd: b, events: Int16(POLLIN), revents: 0),
            pollfd(fd: a, events: Int16(POLLOUT), revents: 0),
        ]
        // Nothing to read: only the writable entry, after no wait.
        #expect(set.wait(&list, timeoutMs: 0) == 1)
        #expect(list.map(\.revents) == polled(list))
        #expect(list[2].revents == Int16(POLLOUT))
        // b readable: its entry, and a's stays writable (the same descriptor, two entries, two answers).
        send(b2)
        #expect(set.wait(&list, timeoutMs: 1000) == 2)
        #expect(list.map(\.revents) == polled(list))
        #expect(list[1].revents == Int16(POLLIN))
        drain(b)
        // Level-triggered as poll: a byte left unread is reported again.
        send(a2)
        #expect(set.wait(&list, timeoutMs: 1000) == 2)
        #expect(set.wait(&list, timeoutMs: 1000) == 2)
        #expect(list.map(\.revents) == polled(list))
        drain(a)
        // Dropped from the list: b's data is no longer reported (nor is it in the list to be).
        send(b2)
        var onlyA = [pollfd(fd: a, events: Int16(POLLIN), revents: 0)]
        #expect(set.wait(&onlyA, timeoutMs: 0) == 0)
        // Listed again: reported.
        #expect(set.wait(&list, timeoutMs: 1000) >= 1)
        #expect(list[1].revents == Int16(POLLIN))
        // The peer closed: hang-up, as poll says.
        close(b2)
        #expect(set.wait(&list, timeoutMs: 1000) >= 1)
        #expect(list.map(\.revents) == polled(list))
        #expect(list[1].revents & Int16(POLLHUP) != 0)
    }

    @Test func waitsForTheTimeoutAndWakesForData() throws {
        let (a, a2) = try pair()
        defer { for fd in [a, a2] { close(fd) } }
        var set = PollSet()
        var list = [pollfd(fd: a, events: Int16(POLLIN), revents: 0)]
        let start = ContinuousClock.now
        #expect(set.wait(&list, timeoutMs: 50) == 0)
        #expect(ContinuousClock.now - start >= .milliseconds(45))
        let writer = Thread {
            usleep(20_000)
            var b: UInt8 = 1
            _ = write(a2, &b, 1)
        }
        writer.start()
        #expect(set.wait(&list, timeoutMs: 5000) == 1)
        #expect(list[0].revents == Int16(POLLIN))
    }

    /// Moves a descriptor to a number far above those the other tests (running meanwhile) are handed, so that
    /// once closed it stays closed: the lowest free number goes to the next socket any test opens.
    private func highNumbered(_ fd: Int32) throws -> Int32 {
        var limit = rlimit()
        getrlimit(Int32(RLIMIT_NOFILE.rawValue), &limit)
        let high = fcntl(fd, F_DUPFD_CLOEXEC, Int32(min(UInt64(limit.rlim_cur), 4096) - 64))
        close(fd)
        guard high >= 0 else { throw POSIXError(.EMFILE) }
        return high
    }

    @Test func aClosedDescriptorIsInvalidAndAReusedNumberIsWatchedAfterAReset() throws {
        var set = PollSet()
        let (low, a2) = try pair()
        let a = try highNumbered(low)
        var list = [pollfd(fd: a, events: Int16(POLLIN), revents: 0)]
        #expect(set.wait(&list, timeoutMs: 0) == 0)
        close(a)
        close(a2)
        // Closed while registered: the kernel dropped it from the set without an event, so it is not reported
        // (poll(2) would say POLLNVAL at every call, a busy loop for a loop that keeps listing it)...
        #expect(set.wait(&list, timeoutMs: 50) == 0)
        // ...and when it is registered again (after a reset), refused: POLLNVAL at once, as poll(2) says.
        set.reset()
        #expect(set.wait(&list, timeoutMs: 5000) == 1)
        #expect(list[0].revents == Int16(POLLNVAL))
        // The number taken by another socket (the loop resets when connections change): its data is seen.
        let (other, c2) = try pair()
        let c = dup2(other, a)
        close(other)
        defer { for fd in [c, c2] { close(fd) } }
        #expect(c == a)
        set.reset()
        var again = [pollfd(fd: c, events: Int16(POLLIN), revents: 0)]
        #expect(set.wait(&again, timeoutMs: 0) == 0)
        send(c2)
        #expect(set.wait(&again, timeoutMs: 1000) == 1)
        #expect(again[0].revents == Int16(POLLIN))
    }
}
