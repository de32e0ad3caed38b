// A read buffer for libmosquitto's plain-TCP socket.
//
// libmosquitto 2.0 reads every packet in at least three read(2) calls on its socket (net__read in lib/net_mosq.c:
// the command byte, each byte of the remaining length, then the body; lib/packet_mosq.c, packet__read), so a
// publisher at QoS 1 pays three system calls per PUBACK. It has no hook for its socket I/O, so this target defines
// read(2) and close(2) for the process: a read of a socket attached here is served from a buffer that one recv(2)
// fills with whatever the kernel holds; every other descriptor goes straight to the system call, as before.
//
// Only the thread that runs the client's read loop may read an attached socket (libmosquitto reads only from
// mosquitto_loop_read). A socket closed through close(2) is detached on the way.
#ifndef MOSQUITTO_IO_H
#define MOSQUITTO_IO_H

#include <stddef.h>

/// A read buffer; one per MQTT client, reused across its connections.
typedef struct mosquitto_io_buffer mosquitto_io_buffer;

/// A new, empty buffer (NULL when out of memory).
mosquitto_io_buffer *mosquitto_io_buffer_new(void);

/// Frees a buffer. It must not be attached.
void mosquitto_io_buffer_free(mosquitto_io_buffer *buffer);

/// Serves reads of `fd` from `buffer` (emptied first) until `mosquitto_io_detach` or close(fd). Returns 0, or -1
/// when `fd` cannot be attached (negative, or beyond the table); reads of it then go to the system as before.
int mosquitto_io_attach(int fd, mosquitto_io_buffer *buffer);

/// Stops serving reads of `fd` from `buffer` (nothing when `fd` is not attached to it: close(2) may have detached
/// it, and the descriptor may since serve another client).
void mosquitto_io_detach(int fd, mosquitto_io_buffer *buffer);

/// 1 when reads of `fd` are served from a buffer, else 0.
int mosquitto_io_is_attached(int fd);

/// Bytes received and not yet read from `buffer`.
size_t mosquitto_io_buffered(const mosquitto_io_buffer *buffer);

/// How many recv(2) calls filled `buffer` and how many read(2) calls it served, since it was made.
unsigned long long mosquitto_io_fills(const mosquitto_io_buffer *buffer);
unsigned long long mosquitto_io_reads(const mosquitto_io_buffer *buffer);

#endif
