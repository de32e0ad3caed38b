/* bridge-sub: the MQTT side and the clock of bench/bridge.sh.
 *
 * Subscribes (libmosquitto, QoS 0) to one topic filter on a loopback broker and records every message as
 * (CLOCK_MONOTONIC ns, device number, key): the device number is the run of digits at the end of the topic's last
 * level (blebridge/d0042 -> 42), the key the integer after the first of the --key names found in the JSON payload
 * ("seq":17 -> 17; -1 when none is there).
 *
 * It also runs the measurement window: it waits until --devices distinct devices have published (or --wait-timeout
 * passes), waits --settle seconds more, then samples the CPU time (clock_getcpuclockid) of every --pid and the
 * simulator's counters (io.blebridge.Simulator1.GetCounters over libdbus, when --bus is given), sleeps --window
 * seconds, samples again (the first --pid also per thread from schedstat, summed by name:
 * threadcpu_NAME_THREAD_s) with VmHWM, VmRSS and Threads (/proc/PID/status), waits --grace seconds for late
 * messages and then writes the records to --out ("m T_NS DEVICE KEY" a line) and the samples to stdout as
 * key=value lines.
 *
 * With --probe-address/--probe-uuid it also sends latency probes during the window: --probe-rate times a second a
 * Simulator1.PushNotification whose value is its CLOCK_MONOTONIC time in µs (u32le), which comes back as the key.
 *
 * build: cc -O2 -o bridge-sub bridge-sub.c $(pkg-config --cflags --libs libmosquitto dbus-1) -lpthread
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <dbus/dbus.h>
#include <dirent.h>
#include <mosquitto.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_DEVICES 4096
#define MAX_PIDS 8
#define MAX_KEYS 8

struct record {
    int64_t t;
    int32_t device;
    int64_t key;
};

static struct record *records;
static size_t capacity;
static atomic_size_t count;
static atomic_int devices_seen;
static unsigned char seen[MAX_DEVICES];
static const char *keys[MAX_KEYS];
static int key_count;
static const char *topic = "blebridge/+";
static atomic_int connected;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static double realtime_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void die(const char *what) {
    fprintf(stderr, "bridge-sub: %s\n", what);
    exit(1);
}

static int device_number(const char *t) {
    size_t n = strlen(t);
    size_t end = n;
    size_t start = end;
    while (start > 0 && t[start - 1] >= '0' && t[start - 1] <= '9') start--;
    if (start == end) return -1;
    long v = strtol(t + start, NULL, 10);
    return v >= 0 && v < MAX_DEVICES ? (int)v : -1;
}

static int64_t payload_key(const char *p, int len) {
    for (int k = 0; k < key_count; k++) {
        char needle[80];
        int nl = snprintf(needle, sizeof needle, "\"%s\":", keys[k]);
        const char *hit = memmem(p, (size_t)len, needle, (size_t)nl);
        if (!hit) continue;
        const char *v = hit + nl;
        while (v < p + len && *v == ' ') v++;
        if (v >= p + len) continue;
        char buf[32];
        int i = 0;
        while (v < p + len && i < 31 && ((*v >= '0' && *v <= '9') || *v == '-')) buf[i++] = *v++;
        buf[i] = 0;
        if (i == 0) continue;
        return strtoll(buf, NULL, 10);
    }
    return -1;
}

static void on_message(struct mosquitto *m, void *ctx, const struct mosquitto_message *msg) {
    (void)m;
    (void)ctx;
    int64_t t = now_ns();
    int device = device_number(msg->topic);
    if (device < 0) return;
    size_t i = atomic_load(&count);
    if (i < capacity) {
        records[i].t = t;
        records[i].device = device;
        records[i].key = payload_key(msg->payload ? (const char *)msg->payload : "", msg->payloadlen);
        atomic_store(&count, i + 1);
    }
    if (!seen[device]) {
        seen[device] = 1;
        atomic_fetch_add(&devices_seen, 1);
    }
}

static void on_connect(struct mosquitto *m, void *ctx, int rc) {
    (void)ctx;
    if (rc != 0) {
        fprintf(stderr, "bridge-sub: broker refused the connection (%d)\n", rc);
        return;
    }
    mosquitto_subscribe(m, NULL, topic, 0);
    atomic_store(&connected, 1);
}

/* The CPU time of the whole process `pid` in ns, or -1: its CPU-time clock (clock_getcpuclockid(3)), exact and
 * including threads that have ended, where utime + stime (/proc/PID/stat) count 10 ms ticks, which for the bare
 * client's 0.16 s over a 30 s window of the passive scenario is a sample of 16 ticks (+-6 %). */
static long long cpu_ns(int pid) {
    clockid_t clock;
    struct timespec ts;
    if (clock_getcpuclockid(pid, &clock) != 0 || clock_gettime(clock, &ts) != 0) return -1;
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Per thread of `pid`: CPU time in ns by thread id (/proc/PID/task/TID/schedstat, exact, where utime+stime
 * count 10 ms ticks: too coarse for a thread that costs a few µs per message), and the thread's name (comm, with
 * anything but letters, digits, '-' and '.' made '_'). Returns the number of threads read (at most max). */
#define MAX_THREADS 256
struct thread_cpu { int tid; char name[32]; long long ns; };
static int thread_cpu(int pid, struct thread_cpu *out, int max) {
    char path[96];
    snprintf(path, sizeof path, "/proc/%d/task", pid);
    DIR *d = opendir(path);
    if (!d) return 0;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL && n < max) {
        if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
        char file[300], comm[64];
        snprintf(file, sizeof file, "/proc/%d/task/%s/schedstat", pid, e->d_name);
        FILE *f = fopen(file, "r");
        if (!f) continue;
        long long ns = -1;
        if (fscanf(f, "%lld", &ns) != 1) ns = -1;
        fclose(f);
        snprintf(file, sizeof file, "/proc/%d/task/%s/comm", pid, e->d_name);
        f = fopen(file, "r");
        if (!f) continue;
        if (!fgets(comm, sizeof comm, f)) comm[0] = 0;
        fclose(f);
        if (ns < 0) continue;
        struct thread_cpu *t = &out[n++];
        t->tid = atoi(e->d_name);
        size_t k = 0;
        for (char *c = comm; *c && *c != '\n' && k < sizeof t->name - 1; c++, k++)
            t->name[k] = (isalnum((unsigned char)*c) || *c == '-' || *c == '.') ? *c : '_';
        t->name[k] = 0;
        t->ns = ns;
    }
    closedir(d);
    return n;
}

static long status_field(int pid, const char *name) {
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", pid);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    long v = -1;
    size_t nl = strlen(name);
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, name, nl) == 0 && line[nl] == ':') {
            v = strtol(line + nl + 1, NULL, 10);
            break;
        }
    }
    fclose(f);
    return v;
}

/* GetCounters of the simulator, printed as sim_<name>_<tag>=value. */
static void sim_counters(DBusConnection *bus, const char *tag) {
    if (!bus) return;
    DBusMessage *call = dbus_message_new_method_call(
        "org.bluez", "/org/bluez/sim", "io.blebridge.Simulator1", "GetCounters");
    DBusError err;
    dbus_error_init(&err);
    DBusMessage *reply = dbus_connection_send_with_reply_and_block(bus, call, 10000, &err);
    dbus_message_unref(call);
    if (!reply) {
        fprintf(stderr, "bridge-sub: GetCounters failed: %s\n", err.message ? err.message : "?");
        dbus_error_free(&err);
        return;
    }
    DBusMessageIter it, dict, entry, var;
    if (dbus_message_iter_init(reply, &it) && dbus_message_iter_get_arg_type(&it) == DBUS_TYPE_ARRAY) {
        dbus_message_iter_recurse(&it, &dict);
        while (dbus_message_iter_get_arg_type(&dict) == DBUS_TYPE_DICT_ENTRY) {
            dbus_message_iter_recurse(&dict, &entry);
            const char *name = NULL;
            dbus_message_iter_get_basic(&entry, &name);
            dbus_message_iter_next(&entry);
            dbus_message_iter_recurse(&entry, &var);
            if (dbus_message_iter_get_arg_type(&var) == DBUS_TYPE_INT64) {
                dbus_int64_t v;
                dbus_message_iter_get_basic(&var, &v);
                printf("sim_%s_%s=%lld\n", name, tag, (long long)v);
            }
            dbus_message_iter_next(&dict);
        }
    }
    dbus_message_unref(reply);
}

/* Asks the simulator to send one notification now whose value is the current CLOCK_MONOTONIC time in µs, modulo
 * 2^32, little-endian (a latency probe: the subscriber sees it come back in the published JSON). No reply wanted. */
static void push_probe(DBusConnection *bus, const char *address, const char *uuid) {
    DBusMessage *call = dbus_message_new_method_call(
        "org.bluez", "/org/bluez/sim", "io.blebridge.Simulator1", "PushNotification");
    uint32_t us = (uint32_t)(now_ns() / 1000);
    unsigned char value[4] = {us & 0xFF, (us >> 8) & 0xFF, (us >> 16) & 0xFF, us >> 24};
    const unsigned char *v = value;
    dbus_message_append_args(call, DBUS_TYPE_STRING, &address, DBUS_TYPE_STRING, &uuid, DBUS_TYPE_ARRAY,
        DBUS_TYPE_BYTE, &v, 4, DBUS_TYPE_INVALID);
    dbus_message_set_no_reply(call, TRUE);
    dbus_connection_send(bus, call, NULL);
    dbus_connection_flush(bus);
    dbus_message_unref(call);
}

static void sleep_s(double s) {
    if (s <= 0) return;
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    while (nanosleep(&ts, &ts) != 0) {}
}

int main(int argc, char **argv) {
    int port = 1883, want_devices = 0;
    double settle = 1, window = 10, grace = 1.5, wait_timeout = 60;
    const char *out = NULL, *bus_address = NULL, *probe_address = NULL, *probe_uuid = NULL;
    double probe_rate = 100;
    const char *pid_names[MAX_PIDS];
    int pids[MAX_PIDS], pid_count = 0;
    capacity = 4000000;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (i + 1 >= argc) die("every option takes a value");
        const char *v = argv[++i];
        if (!strcmp(a, "--port")) port = atoi(v);
        else if (!strcmp(a, "--topic")) topic = v;
        else if (!strcmp(a, "--key")) {
            char *copy = strdup(v);
            for (char *s = strtok(copy, ","); s && key_count < MAX_KEYS; s = strtok(NULL, ",")) keys[key_count++] = s;
        } else if (!strcmp(a, "--devices")) want_devices = atoi(v);
        else if (!strcmp(a, "--settle")) settle = atof(v);
        else if (!strcmp(a, "--window")) window = atof(v);
        else if (!strcmp(a, "--grace")) grace = atof(v);
        else if (!strcmp(a, "--wait-timeout")) wait_timeout = atof(v);
        else if (!strcmp(a, "--out")) out = v;
        else if (!strcmp(a, "--bus")) bus_address = v;
        else if (!strcmp(a, "--probe-address")) probe_address = v;
        else if (!strcmp(a, "--probe-uuid")) probe_uuid = v;
        else if (!strcmp(a, "--probe-rate")) probe_rate = atof(v);
        else if (!strcmp(a, "--capacity")) capacity = (size_t)atoll(v);
        else if (!strcmp(a, "--pid")) {
            const char *eq = strchr(v, '=');
            if (!eq || pid_count == MAX_PIDS) die("--pid NAME=PID");
            pid_names[pid_count] = strndup(v, (size_t)(eq - v));
            pids[pid_count++] = atoi(eq + 1);
        } else {
            fprintf(stderr, "bridge-sub: unknown option %s\n", a);
            return 64;
        }
    }
    if (!out) die("--out FILE is required");
    records = calloc(capacity, sizeof *records);
    if (!records) die("out of memory");

    DBusConnection *bus = NULL;
    if (bus_address) {
        DBusError err;
        dbus_error_init(&err);
        bus = dbus_connection_open_private(bus_address, &err);
        if (!bus || !dbus_bus_register(bus, &err)) die("cannot connect to the simulator's bus");
    }

    mosquitto_lib_init();
    struct mosquitto *m = mosquitto_new("bench-bridge-sub", true, NULL);
    if (!m) die("mosquitto_new failed");
    mosquitto_connect_callback_set(m, on_connect);
    mosquitto_message_callback_set(m, on_message);
    if (mosquitto_connect(m, "127.0.0.1", port, 60) != MOSQ_ERR_SUCCESS) die("cannot connect to the broker");
    if (mosquitto_loop_start(m) != MOSQ_ERR_SUCCESS) die("cannot start the mosquitto thread");
    int64_t started = now_ns();
    while (!atomic_load(&connected) && now_ns() - started < 10000000000LL) sleep_s(0.01);
    printf("subscribed=%d\n", atomic_load(&connected));
    fflush(stdout);

    /* Ready: every device has published (or the wait timed out). */
    while (atomic_load(&devices_seen) < want_devices && (now_ns() - started) / 1e9 < wait_timeout) sleep_s(0.05);
    printf("ready_after_s=%.3f\n", (now_ns() - started) / 1e9);
    printf("devices_seen_at_start=%d\n", atomic_load(&devices_seen));
    sleep_s(settle);

    long long before[MAX_PIDS];
    sim_counters(bus, "start");
    int64_t ws = now_ns();
    double ws_real = realtime_s();
    for (int p = 0; p < pid_count; p++) before[p] = cpu_ns(pids[p]);
    /* The first --pid (the bridge) also by thread, to tell what each of its threads costs. */
    static struct thread_cpu threads_before[MAX_THREADS], threads_after[MAX_THREADS];
    int threads_before_n = pid_count > 0 ? thread_cpu(pids[0], threads_before, MAX_THREADS) : 0;
    size_t count_start = atomic_load(&count);
    long probes = 0;
    if (bus && probe_address && probe_uuid && probe_rate > 0) {
        int64_t next = ws;
        while (now_ns() < ws + (int64_t)(window * 1e9)) {
            push_probe(bus, probe_address, probe_uuid);
            probes++;
            next += (int64_t)(1e9 / probe_rate);
            int64_t left = next - now_ns();
            if (left > 0) sleep_s(left / 1e9);
            /* Drop what the bus sends back (NameAcquired and the like) so nothing piles up. */
            dbus_connection_read_write(bus, 0);
            DBusMessage *msg;
            while ((msg = dbus_connection_pop_message(bus)) != NULL) dbus_message_unref(msg);
        }
    } else {
        sleep_s(window);
    }
    for (int p = 0; p < pid_count; p++) {
        long long after = cpu_ns(pids[p]);
        printf("cpu_%s_s=%.6f\n", pid_names[p], (after - before[p]) / 1e9);
    }
    if (pid_count > 0) {
        /* Summed by name: threads that share one (the Swift runtime's pool) are one figure; a thread that started
         * in the window counts from zero. */
        int threads_after_n = thread_cpu(pids[0], threads_after, MAX_THREADS);
        char names[MAX_THREADS][32];
        long long sums[MAX_THREADS];
        int names_n = 0;
        for (int i = 0; i < threads_after_n; i++) {
            long long start = 0;
            for (int j = 0; j < threads_before_n; j++)
                if (threads_before[j].tid == threads_after[i].tid) start = threads_before[j].ns;
            int k = 0;
            while (k < names_n && strcmp(names[k], threads_after[i].name) != 0) k++;
            if (k == names_n) {
                snprintf(names[k], sizeof names[k], "%s", threads_after[i].name);
                sums[k] = 0;
                names_n++;
            }
            sums[k] += threads_after[i].ns - start;
        }
        for (int k = 0; k < names_n; k++)
            printf("threadcpu_%s_%s_s=%.6f\n", pid_names[0], names[k], sums[k] / 1e9);
    }
    int64_t we = now_ns();
    double we_real = realtime_s();
    size_t count_end = atomic_load(&count);
    sim_counters(bus, "end");
    for (int p = 0; p < pid_count; p++) {
        printf("hwm_%s_kb=%ld\n", pid_names[p], status_field(pids[p], "VmHWM"));
        printf("rss_%s_kb=%ld\n", pid_names[p], status_field(pids[p], "VmRSS"));
        printf("threads_%s=%ld\n", pid_names[p], status_field(pids[p], "Threads"));
    }
    printf("window_start_ns=%lld\nwindow_end_ns=%lld\nwindow_s=%.4f\n", (long long)ws, (long long)we, (we - ws) / 1e9);
    printf("window_start_unix=%.6f\nwindow_end_unix=%.6f\n", ws_real, we_real);
    printf("probes_sent=%ld\n", probes);
    printf("messages_in_window=%zu\n", count_end - count_start);
    printf("devices_seen=%d\n", atomic_load(&devices_seen));
    fflush(stdout);
    sleep_s(grace);
    mosquitto_disconnect(m);
    mosquitto_loop_stop(m, true);
    size_t n = atomic_load(&count);
    printf("messages_total=%zu\ncapacity_reached=%d\n", n, n >= capacity);
    FILE *f = fopen(out, "w");
    if (!f) die("cannot write --out");
    for (size_t i = 0; i < n; i++)
        fprintf(f, "m %lld %d %lld\n", (long long)records[i].t, records[i].device, (long long)records[i].key);
    fclose(f);
    mosquitto_destroy(m);
    mosquitto_lib_cleanup();
    return 0;
}
