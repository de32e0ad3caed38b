"""A real Prometheus scrapes our MetricsHTTP endpoint (served by metrics-sample), and promtool lints what it serves.

Prometheus is Debian's `prometheus` package (scripts/install-deps.sh installs it); it runs with a temporary config and
data directory, listens on 127.0.0.1 only, and is stopped at the end of each test.
"""
import json
import pathlib
import selectors
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

WAIT_SECONDS = 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def require_tool(name: str) -> str:
    """The tool's path; a failure (not a skip) when it is missing, so a machine without it cannot pass quietly."""
    for candidate in (shutil.which(name), f"/usr/bin/{name}"):
        if candidate and pathlib.Path(candidate).exists():
            return candidate
    pytest.fail(f"{name} is not installed: it comes with Debian's 'prometheus' package "
                "(run scripts/install-deps.sh, or apt-get install prometheus)")


def http_get(url: str, timeout: float = 5) -> tuple[int, dict, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


@pytest.fixture
def sample(binaries):
    """metrics-sample on a kernel-picked 127.0.0.1 port; yields the port."""
    executable = binaries / "metrics-sample"
    assert executable.exists(), f"{executable} is missing; build it with `swift build --product metrics-sample`"
    process = subprocess.Popen([str(executable), "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        selector = selectors.DefaultSelector()
        selector.register(process.stdout, selectors.EVENT_READ)
        line = b""
        if selector.select(timeout=WAIT_SECONDS):
            line = process.stdout.readline()
        if not line.startswith(b"listening on 127.0.0.1:"):
            stop(process)
            pytest.fail(f"metrics-sample did not start: stdout {line!r}, stderr {process.stderr.read()!r}")
        yield int(line.decode().rsplit(":", 1)[1])
    finally:
        stop(process)
    assert process.returncode == 0, f"metrics-sample exited with {process.returncode} on SIGTERM"


@pytest.fixture
def prometheus(sample):
    """A Prometheus on 127.0.0.1 scraping metrics-sample every second.

    Yields (its base URL, the sample's port, the process).
    """
    executable = require_tool("prometheus")
    port = free_port()
    with tempfile.TemporaryDirectory() as directory:
        config = pathlib.Path(directory) / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
            "scrape_configs:\n  - job_name: blebridge\n    static_configs:\n"
            f"      - targets: ['127.0.0.1:{sample}']\n")
        log = open(pathlib.Path(directory) / "prometheus.log", "w+b")
        process = subprocess.Popen(
            [executable, f"--config.file={config}", f"--storage.tsdb.path={directory}/data",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + WAIT_SECONDS
            while True:
                if process.poll() is not None:
                    log.seek(0)
                    pytest.fail(f"prometheus exited with {process.returncode}: {log.read().decode(errors='replace')}")
                try:
                    if http_get(f"{base}/-/ready", timeout=1)[0] == 200:
                        break
                except OSError:
                    pass
                if time.time() > deadline:
                    pytest.fail(f"prometheus did not become ready on {base} in {WAIT_SECONDS} s")
                time.sleep(0.1)
            yield base, sample, process
        finally:
            stop(process)
            log.close()


def query(base: str, expression: str) -> list:
    status, _, body = http_get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expression}))
    assert status == 200, f"query {expression}: HTTP {status}: {body!r}"
    answer = json.loads(body)
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def query_until_present(base: str, expression: str) -> list:
    """The query's result once Prometheus has scraped it (scrapes happen every second)."""
    deadline = time.time() + WAIT_SECONDS
    while True:
        result = query(base, expression)
        if result:
            return result
        if time.time() > deadline:
            _, _, targets = http_get(f"{base}/api/v1/targets")
            pytest.fail(f"no {expression} after {WAIT_SECONDS} s; targets: {targets.decode(errors='replace')}")
        time.sleep(0.2)


def listening_addresses(pid: int) -> list:
    """The TCP addresses process `pid` listens on, from /proc (its socket inodes against /proc/net/tcp{,6})."""
    inodes = set()
    for fd in pathlib.Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().name
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    addresses = []
    for table, family in (("tcp", 4), ("tcp6", 6)):
        for line in pathlib.Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            # State 0A is LISTEN.
            if fields[3] != "0A" or fields[9] not in inodes:
                continue
            host, port = fields[1].split(":")
            raw = bytes.fromhex(host)
            if family == 4:
                text = socket.inet_ntop(socket.AF_INET, raw[::-1])
            else:
                # /proc prints each 32-bit word of the address in host (little-endian) order.
                text = "[" + socket.inet_ntop(
                    socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))) + "]"
            addresses.append(f"{text}:{int(port, 16)}")
    return addresses


def test_prometheus_scrapes_the_endpoint(prometheus):
    base, sample_port, process = prometheus
    result = query_until_present(base, "blebridge_notifications_received_total")
    assert len(result) == 1
    assert result[0]["metric"] == {
        "__name__": "blebridge_notifications_received_total", "instance": f"127.0.0.1:{sample_port}",
        "job": "blebridge"}
    assert result[0]["value"][1] == "42"

    # The scrape itself was clean: the target is up with no error.
    targets = json.loads(http_get(f"{base}/api/v1/targets")[2])["data"]["activeTargets"]
    assert [(t["health"], t["lastError"]) for t in targets] == [("up", "")]

    # Label values with a quote, a backslash and a newline come back exactly as the bridge meant them.
    reconnects = {r["metric"]["error"]: r["value"][1] for r in query(base, "blebridge_reconnects_total")}
    assert reconnects == {
        "org.bluez.Error.Failed le-connection-abort-by-local": "3",
        'odd "quoted" \\ text\nwith a newline': "1"}

    last_seen = {r["metric"]["device"]: r["value"][1]
                 for r in query(base, "blebridge_device_last_seen_timestamp_seconds")}
    assert last_seen == {"kitchen-thermo": "1764626400.25", "never-seen": "NaN"}
    assert query(base, "blebridge_process_resident_memory_bytes")[0]["value"][1] == "12345678"

    # Prometheus listens on 127.0.0.1 only.
    addresses = listening_addresses(process.pid)
    assert addresses and all(address.startswith("127.0.0.1:") for address in addresses), addresses


def test_promtool_accepts_the_exposition(sample):
    promtool = require_tool("promtool")
    status, headers, body = http_get(f"http://127.0.0.1:{sample}/metrics")
    assert status == 200
    assert headers.get("Content-Type") == "text/plain; version=0.0.4; charset=utf-8"
    lint = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, timeout=30)
    assert lint.returncode == 0 and not lint.stdout and not lint.stderr, (
        f"promtool check metrics: rc {lint.returncode}: {lint.stdout!r} {lint.stderr!r}")
    for name in ["blebridge_notifications_received_total", "blebridge_values_decoded_total",
                 "blebridge_decode_errors_total", "blebridge_advertisements_received_total",
                 "blebridge_mqtt_published_total", "blebridge_reconnects_total", "blebridge_devices_connected",
                 "blebridge_mqtt_queue_depth", "blebridge_process_resident_memory_bytes",
                 "blebridge_device_last_seen_timestamp_seconds"]:
        assert f"# TYPE {name} ".encode() in body, name

    missing = http_get(f"http://127.0.0.1:{sample}/nope")
    assert missing[0] == 404
