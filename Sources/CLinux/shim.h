// Linux interfaces that Swift's Glibc module does not export: epoll(7), for the notification reader (one wake-up
// for the sockets that are ready, whatever the number of sockets registered).
#include <sys/epoll.h>
