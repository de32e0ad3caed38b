/* dbus-ref: the reference client of bench/bridge.sh's passive scenario: a bare libdbus client on the simulator's
 * private bus that receives the same advertisement signals as the bridge (PropertiesChanged of org.bluez.Device1,
 * BlueZ's doc/org.bluez.Device.rst) and walks every argument of each, the least any BlueZ client must do. It also
 * takes the notifications of the StartNotify path (PropertiesChanged of org.bluez.GattCharacteristic1 with Value,
 * doc/org.bluez.GattCharacteristic.rst), keyed by the benchmark's u32le counter at the value's offset 0.
 *
 * Each signal is recorded as (CLOCK_MONOTONIC ns, device number, key): the device number is the last two octets of
 * the address in the object path (dev_C0_00_00_00_01_F3 -> 0x01F3), the key the advertisement's sequence number:
 * BTHome v2 service data (FCD2) packet_id (octet 2 of "40 00 ID ..."), or RuuviTag RAWv2 (manufacturer 0x0499)
 * measurement_sequence (octets 16-17, big-endian); -1 when the signal carries neither. On SIGTERM or SIGINT it writes
 * the records to --out ("d T_NS DEVICE KEY" a line) and exits.
 *
 * build: cc -O2 -o dbus-ref dbus-ref.c $(pkg-config --cflags --libs dbus-1)
 */
#define _GNU_SOURCE
#include <dbus/dbus.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct record {
    int64_t t;
    int32_t device;
    int32_t key;
};

static volatile sig_atomic_t stop;
static struct record *records;
static size_t count, capacity = 2000000;
static unsigned long long signals_total, bytes_walked;

static void on_signal(int s) {
    (void)s;
    stop = 1;
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Walks a value completely (so the reference pays for reading everything, as a real client does); returns the byte
 * array it found at the end of `bytes`/`n` when the value is an `ay`. */
static void walk(DBusMessageIter *it, const unsigned char **bytes, int *n) {
    int type;
    while ((type = dbus_message_iter_get_arg_type(it)) != DBUS_TYPE_INVALID) {
        if (type == DBUS_TYPE_ARRAY && dbus_message_iter_get_element_type(it) == DBUS_TYPE_BYTE) {
            DBusMessageIter sub;
            dbus_message_iter_recurse(it, &sub);
            dbus_message_iter_get_fixed_array(&sub, bytes, n);
            bytes_walked += (unsigned)*n;
        } else if (dbus_type_is_container(type)) {
            DBusMessageIter sub;
            dbus_message_iter_recurse(it, &sub);
            walk(&sub, bytes, n);
        } else {
            DBusBasicValue v;
            dbus_message_iter_get_basic(it, &v);
        }
        dbus_message_iter_next(it);
    }
}

static int key_of(const char *property, DBusMessageIter *variant) {
    const unsigned char *b = NULL;
    int n = 0;
    DBusMessageIter dict, entry;
    dbus_message_iter_recurse(variant, &dict); /* a{sv} or a{qv} */
    int key = -1;
    while (dbus_message_iter_get_arg_type(&dict) == DBUS_TYPE_DICT_ENTRY) {
        dbus_message_iter_recurse(&dict, &entry);
        int is_bthome = 0, is_ruuvi = 0;
        if (!strcmp(property, "ServiceData") && dbus_message_iter_get_arg_type(&entry) == DBUS_TYPE_STRING) {
            const char *uuid;
            dbus_message_iter_get_basic(&entry, &uuid);
            is_bthome = !strncasecmp(uuid, "0000fcd2-", 9);
        } else if (dbus_message_iter_get_arg_type(&entry) == DBUS_TYPE_UINT16) {
            dbus_uint16_t company;
            dbus_message_iter_get_basic(&entry, &company);
            is_ruuvi = company == 0x0499;
        }
        dbus_message_iter_next(&entry);
        b = NULL;
        n = 0;
        walk(&entry, &b, &n);
        if (is_bthome && b && n >= 3) key = b[2];
        if (is_ruuvi && b && n >= 18) key = (b[16] << 8) | b[17];
        dbus_message_iter_next(&dict);
    }
    return key;
}

static void handle(DBusMessage *msg) {
    if (dbus_message_get_type(msg) != DBUS_MESSAGE_TYPE_SIGNAL
        || !dbus_message_is_signal(msg, "org.freedesktop.DBus.Properties", "PropertiesChanged"))
        return;
    const char *path = dbus_message_get_path(msg);
    const char *dev = path ? strstr(path, "/dev_") : NULL;
    if (!dev || strlen(dev) < 5 + 17) return;
    int device = (int)strtol(dev + 5 + 12, NULL, 16) << 8 | (int)strtol(dev + 5 + 15, NULL, 16);
    DBusMessageIter it, props, entry, variant;
    if (!dbus_message_iter_init(msg, &it) || dbus_message_iter_get_arg_type(&it) != DBUS_TYPE_STRING) return;
    const char *interface;
    dbus_message_iter_get_basic(&it, &interface);
    int characteristic = !strcmp(interface, "org.bluez.GattCharacteristic1");
    if (!characteristic && strcmp(interface, "org.bluez.Device1") != 0) return;
    signals_total++;
    int key = -1;
    dbus_message_iter_next(&it);
    if (dbus_message_iter_get_arg_type(&it) == DBUS_TYPE_ARRAY) {
        dbus_message_iter_recurse(&it, &props);
        while (dbus_message_iter_get_arg_type(&props) == DBUS_TYPE_DICT_ENTRY) {
            dbus_message_iter_recurse(&props, &entry);
            const char *name;
            dbus_message_iter_get_basic(&entry, &name);
            dbus_message_iter_next(&entry);
            dbus_message_iter_recurse(&entry, &variant);
            if (characteristic && !strcmp(name, "Value")) {
                /* A notification (StartNotify): the bench counter, u32le at offset 0. */
                const unsigned char *b = NULL;
                int n = 0;
                walk(&variant, &b, &n);
                if (b && n >= 4) key = (int)((b[0] | b[1] << 8 | b[2] << 16 | (unsigned)b[3] << 24) & 0x7FFFFFFF);
            } else if ((!strcmp(name, "ServiceData") || !strcmp(name, "ManufacturerData"))
                && dbus_message_iter_get_arg_type(&variant) == DBUS_TYPE_ARRAY) {
                int k = key_of(name, &variant);
                if (k >= 0) key = k;
            } else {
                const unsigned char *b;
                int n;
                walk(&variant, &b, &n);
            }
            dbus_message_iter_next(&props);
        }
    }
    dbus_message_iter_next(&it);
    const unsigned char *b;
    int n;
    walk(&it, &b, &n); /* the invalidated properties */
    if (count < capacity) records[count++] = (struct record){now_ns(), device, key};
}

int main(int argc, char **argv) {
    const char *address = NULL, *out = NULL;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--bus")) address = argv[i + 1];
        else if (!strcmp(argv[i], "--out")) out = argv[i + 1];
    }
    if (!address || !out) {
        fprintf(stderr, "usage: dbus-ref --bus ADDRESS --out FILE\n");
        return 64;
    }
    records = calloc(capacity, sizeof *records);
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);
    DBusError err;
    dbus_error_init(&err);
    DBusConnection *c = dbus_connection_open_private(address, &err);
    if (!c || !dbus_bus_register(c, &err)) {
        fprintf(stderr, "dbus-ref: cannot connect to %s: %s\n", address, err.message ? err.message : "?");
        return 1;
    }
    dbus_bus_add_match(c,
        "type='signal',sender='org.bluez',interface='org.freedesktop.DBus.Properties',member='PropertiesChanged',"
        "arg0='org.bluez.Device1'",
        &err);
    if (!dbus_error_is_set(&err))
        dbus_bus_add_match(c,
            "type='signal',sender='org.bluez',interface='org.freedesktop.DBus.Properties',"
            "member='PropertiesChanged',arg0='org.bluez.GattCharacteristic1'",
            &err);
    if (dbus_error_is_set(&err)) {
        fprintf(stderr, "dbus-ref: AddMatch failed: %s\n", err.message);
        return 1;
    }
    printf("dbus-ref: ready\n");
    fflush(stdout);
    while (!stop && dbus_connection_read_write(c, 200)) {
        DBusMessage *msg;
        while ((msg = dbus_connection_pop_message(c)) != NULL) {
            handle(msg);
            dbus_message_unref(msg);
        }
    }
    FILE *f = fopen(out, "w");
    if (!f) return 1;
    for (size_t i = 0; i < count; i++)
        fprintf(f, "d %lld %d %d\n", (long long)records[i].t, records[i].device, records[i].key);
    fclose(f);
    printf("dbus-ref: %llu signals, %llu payload bytes\n", signals_total, bytes_walked);
    return 0;
}
