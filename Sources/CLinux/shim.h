// Linux interfaces that Swift's Glibc module does not export: epoll(7), for the notification reader (one wake-up
// for the sockets that are ready, whatever the number of sockets registered), and recvmmsg(2), which reads every
// queued notification of a socket in one call (Glibc declares it, and struct mmsghdr, only under _GNU_SOURCE).
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>

/// struct mmsghdr of recvmmsg(2), under a name of its own (same layout).
struct clinux_mmsghdr {
    struct msghdr msg_hdr;
    unsigned int msg_len;
};

/// recvmmsg(2).
int clinux_recvmmsg(int sockfd, struct clinux_mmsghdr *msgvec, unsigned int vlen, int flags,
                    struct timespec *timeout) __asm__("recvmmsg");
