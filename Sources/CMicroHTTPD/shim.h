// libmicrohttpd for Swift, loaded with dlopen(3) the first time a metrics endpoint starts: a bridge without
// `metrics.listen` never maps libmicrohttpd and the TLS stack it links (gnutls, p11-kit, nettle, gmp, ...; about
// 2.4 MB of resident memory and their constructors at every start). The header is only for the types; the
// functions are looked up into `struct blebridge_mhd_api`. MHD_start_daemon and MHD_get_daemon_info are C variadic
// functions, which Swift cannot call, so the two calls MetricsHTTP needs are spelled out here with a fixed option
// list.
#include <dlfcn.h>
#include <stddef.h>
#include <sys/socket.h>
#include <microhttpd.h>

/// The libmicrohttpd functions MetricsHTTP calls, with the prototypes of <microhttpd.h>.
struct blebridge_mhd_api {
    __typeof__(&MHD_start_daemon) start_daemon;
    __typeof__(&MHD_get_daemon_info) get_daemon_info;
    __typeof__(&MHD_stop_daemon) stop_daemon;
    __typeof__(&MHD_create_response_from_buffer) create_response_from_buffer;
    __typeof__(&MHD_add_response_header) add_response_header;
    __typeof__(&MHD_queue_response) queue_response;
    __typeof__(&MHD_destroy_response) destroy_response;
};

/// Loads `library` (a soname such as "libmicrohttpd.so.12") and fills `api`. Returns NULL on success, otherwise
/// dlerror(3)'s message (the library is missing, or lacks one of the functions). The handle is never closed: the
/// functions stay valid for the life of the process.
static inline const char *blebridge_mhd_load(const char *library, struct blebridge_mhd_api *api) {
    void *handle = dlopen(library, RTLD_NOW | RTLD_LOCAL);
    if (handle == NULL) return dlerror();
#define BLEBRIDGE_MHD_SYMBOL(field, name)                                                                            \
    do {                                                                                                             \
        void *symbol = dlsym(handle, name);                                                                          \
        if (symbol == NULL) return dlerror();                                                                        \
        *(void **)&api->field = symbol;                                                                              \
    } while (0)
    BLEBRIDGE_MHD_SYMBOL(start_daemon, "MHD_start_daemon");
    BLEBRIDGE_MHD_SYMBOL(get_daemon_info, "MHD_get_daemon_info");
    BLEBRIDGE_MHD_SYMBOL(stop_daemon, "MHD_stop_daemon");
    BLEBRIDGE_MHD_SYMBOL(create_response_from_buffer, "MHD_create_response_from_buffer");
    BLEBRIDGE_MHD_SYMBOL(add_response_header, "MHD_add_response_header");
    BLEBRIDGE_MHD_SYMBOL(queue_response, "MHD_queue_response");
    BLEBRIDGE_MHD_SYMBOL(destroy_response, "MHD_destroy_response");
#undef BLEBRIDGE_MHD_SYMBOL
    return NULL;
}

/// Starts a daemon bound to exactly `address` with its own polling thread. The external logger comes first so that
/// every message, including those about the options, reaches it (libmicrohttpd's MHD_OPTION_EXTERNAL_LOGGER docs).
static inline struct MHD_Daemon *blebridge_mhd_start(const struct blebridge_mhd_api *api, unsigned int flags,
                                                     const struct sockaddr *address,
                                                     MHD_AccessHandlerCallback handler, void *handler_context,
                                                     MHD_LogCallback logger, void *logger_context,
                                                     unsigned int connection_limit, unsigned int timeout_seconds,
                                                     size_t memory_limit) {
    return api->start_daemon(flags, 0, NULL, NULL, handler, handler_context,
                             MHD_OPTION_EXTERNAL_LOGGER, logger, logger_context,
                             MHD_OPTION_SOCK_ADDR, address,
                             MHD_OPTION_CONNECTION_LIMIT, connection_limit,
                             MHD_OPTION_CONNECTION_TIMEOUT, timeout_seconds,
                             MHD_OPTION_CONNECTION_MEMORY_LIMIT, memory_limit,
                             MHD_OPTION_END);
}

/// The port the daemon's listening socket is bound to, or 0 if libmicrohttpd cannot say.
static inline unsigned int blebridge_mhd_bound_port(const struct blebridge_mhd_api *api, struct MHD_Daemon *daemon) {
    const union MHD_DaemonInfo *info = api->get_daemon_info(daemon, MHD_DAEMON_INFO_BIND_PORT);
    return info == NULL ? 0 : info->port;
}
