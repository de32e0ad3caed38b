// libmicrohttpd for Swift. MHD_start_daemon and MHD_get_daemon_info are C variadic functions, which Swift cannot
// call, so the two calls MetricsHTTP needs are spelled out here with a fixed option list.
#include <stddef.h>
#include <sys/socket.h>
#include <microhttpd.h>

/// Starts a daemon bound to exactly `address` with its own polling thread. The external logger comes first so that
/// every message, including those about the options, reaches it (libmicrohttpd's MHD_OPTION_EXTERNAL_LOGGER docs).
static inline struct MHD_Daemon *blebridge_mhd_start(unsigned int flags, const struct sockaddr *address,
                                                     MHD_AccessHandlerCallback handler, void *handler_context,
                                                     MHD_LogCallback logger, void *logger_context,
                                                     unsigned int connection_limit, unsigned int timeout_seconds,
                                                     size_t memory_limit) {
    return MHD_start_daemon(flags, 0, NULL, NULL, handler, handler_context,
                            MHD_OPTION_EXTERNAL_LOGGER, logger, logger_context,
                            MHD_OPTION_SOCK_ADDR, address,
                            MHD_OPTION_CONNECTION_LIMIT, connection_limit,
                            MHD_OPTION_CONNECTION_TIMEOUT, timeout_seconds,
                            MHD_OPTION_CONNECTION_MEMORY_LIMIT, memory_limit,
                            MHD_OPTION_END);
}

/// The port the daemon's listening socket is bound to, or 0 if libmicrohttpd cannot say.
static inline unsigned int blebridge_mhd_bound_port(struct MHD_Daemon *daemon) {
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(daemon, MHD_DAEMON_INFO_BIND_PORT);
    return info == NULL ? 0 : info->port;
}
