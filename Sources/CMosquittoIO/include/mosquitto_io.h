// A read buffer and a write buffer for libmosquitto's plain-TCP socket.
//
// libmosquitto 2.0 reads every packet in at least three read(2) calls on its socket (net__read in lib/net_mosq.c:
// the command byte, each byte of the remaining length, then the body; lib/packet_mosq.c, packet__read), so a
// publisher at QoS 1 pays three system calls per PUBACK; and it writes every packet with a write(2) of its own
// (packet__write). It has no hook for its socket I/O, so this target defines read(2), write(2), close(2) and
// socketpair(2) for the process. For a socket attached here:
// - a read is served from a buffer that one recv(2) fills with whatever the kernel holds;
// - while writes are held (`mosquitto_io_hold`), what is written is kept and leaves in one write(2) at
//   `mosquitto_io_release`, in order with everything else written to the socket.
// Every other descriptor goes straight to the system call, as before.
//
// Only the thread that runs the client's read loop may read an attached socket (libmosquitto reads only from
// mosquitto_loop_read). Any thread may write. A socket closed through close(2) is detached on the way, and what was
// held for it is dropped.
#ifndef MOSQUITTO_IO_H
#define MOSQUITTO_IO_H

#include <stddef.h>

/// The buffers of one MQTT client, reused across its connections.
typedef struct mosquitto_io_buffer mosquitto_io_buffer;

/// New, empty buffers (NULL when out of memory).
mosquitto_io_buffer *mosquitto_io_buffer_new(void);

/// Frees buffers. They must not be attached.
void mosquitto_io_buffer_free(mosquitto_io_buffer *buffer);

/// Serves reads and writes of `fd` through `buffer` (emptied first) until `mosquitto_io_detach` or close(fd).
/// Returns 0, or -1 when `fd` cannot be attached (negative, or beyond the table); its reads and writes then go to
/// the system as before.
int mosquitto_io_attach(int fd, mosquitto_io_buffer *buffer);

/// Writes out what is held (as far as the socket takes it) and stops serving `fd` through `buffer` (nothing when
/// `fd` is not attached to it: close(2) may have detached it, and the descriptor may since serve another client).
void mosquitto_io_detach(int fd, mosquitto_io_buffer *buffer);

/// 1 when `fd` is served through a buffer, else 0.
int mosquitto_io_is_attached(int fd);

/// Bytes received and not yet read from `buffer`.
size_t mosquitto_io_buffered(const mosquitto_io_buffer *buffer);

/// From now until `mosquitto_io_release`, writes to the attached socket are kept (up to the buffer's size; a
/// larger write first sends what is kept, then itself).
void mosquitto_io_hold(mosquitto_io_buffer *buffer);

/// Ends a hold and sends what was kept. Returns the bytes still waiting (the socket was full), which
/// `mosquitto_io_flush` sends when it is writable again.
size_t mosquitto_io_release(mosquitto_io_buffer *buffer);

/// Sends what is waiting; returns the bytes still waiting, or (size_t)-1 when the socket failed (errno says why).
/// During a hold it sends nothing (what is kept leaves at `mosquitto_io_release`).
size_t mosquitto_io_flush(mosquitto_io_buffer *buffer);

/// Sends what is kept now, during a hold too (the hold goes on: what is written next is kept again). Returns the
/// bytes still waiting (the socket was full; they leave at `mosquitto_io_release`, or `mosquitto_io_flush` after
/// it), or (size_t)-1 when the socket failed (errno says why).
size_t mosquitto_io_send_kept(mosquitto_io_buffer *buffer);

/// Bytes kept and not yet sent.
size_t mosquitto_io_pending(mosquitto_io_buffer *buffer);

/// Bytes kept that wait for the socket (not for the end of a hold): what `mosquitto_io_flush` would send now.
size_t mosquitto_io_waiting(mosquitto_io_buffer *buffer);

/// recv(2) calls that filled `buffer`, read(2) calls it served, write(2) calls it kept, and write(2) system calls
/// that sent what it kept, since it was made.
unsigned long long mosquitto_io_fills(const mosquitto_io_buffer *buffer);
unsigned long long mosquitto_io_reads(const mosquitto_io_buffer *buffer);
unsigned long long mosquitto_io_kept_writes(mosquitto_io_buffer *buffer);
unsigned long long mosquitto_io_flushes(mosquitto_io_buffer *buffer);

/// While `on` is 1, a socketpair(2) made by the calling thread marks its second descriptor as a wake-up socket
/// nobody reads: writes to it then return at once without a system call, until it is closed. For
/// mosquitto_new on plain TCP: libmosquitto writes a byte to its socket pair for every packet it queues
/// (packet__queue in lib/packet_mosq.c) to wake a select(2) loop that only TLS connections run here. Returns the
/// descriptor marked since the last call with `on` 1 (-1 for none).
int mosquitto_io_silence_socketpair(int on);

/// While `on` is 1, the next socketpair(2) made by the calling thread is recorded; returns the first (read)
/// descriptor of the pair recorded since the last call with `on` 1 (-1 for none). For mosquitto_new under TLS: the
/// client's own loop polls that descriptor (libmosquitto's wake-up for a packet queued by another thread) instead
/// of running mosquitto_loop, whose select(2) cannot watch a descriptor numbered 1,024 or more.
int mosquitto_io_capture_socketpair(int on);

/// 1 when writes to `fd` are dropped (see `mosquitto_io_silence_socketpair`), else 0.
int mosquitto_io_is_silenced(int fd);

/// Writes dropped so far, in the whole process.
unsigned long long mosquitto_io_dropped_writes(void);

#endif
