"""Debian's bluetoothctl (BlueZ 5.66) against bluez-sim."""
import re
import subprocess
import time

from sim_fixtures import BTHOME, ECHO, HR_STRAP, RUUVI, sim  # noqa: F401


def test_bluetoothctl_lists_the_adapter(sim):
    r = subprocess.run(["bluetoothctl", "list"], env=sim.env, capture_output=True, text=True, timeout=20)
    assert r.returncode == 0, r.stderr
    assert "Controller 00:1A:7D:DA:71:13 blebridge-sim [default]" in r.stdout


def test_bluetoothctl_show_reports_powered_and_roles(sim):
    r = subprocess.run(["bluetoothctl", "show"], env=sim.env, capture_output=True, text=True, timeout=20)
    assert r.returncode == 0, r.stderr
    assert "Powered: yes" in r.stdout
    assert "Roles: central" in r.stdout


def test_bluetoothctl_scan_then_devices(sim):
    p = subprocess.Popen(["bluetoothctl"], env=sim.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(0.5)
        p.stdin.write("scan on\n")
        p.stdin.flush()
        time.sleep(2.5)
        p.stdin.write("devices\n")
        p.stdin.flush()
        time.sleep(0.5)
        p.stdin.write("scan off\n")
        p.stdin.write("quit\n")
        p.stdin.flush()
        out, _ = p.communicate(timeout=15)
    finally:
        if p.poll() is None:
            p.kill()
    out = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", out)
    out = re.sub(r"[\r\x01\x02]", "", out)  # readline's invisible-prompt markers
    assert "Discovery started" in out
    for address, name in [(HR_STRAP, "Polar H10 4F2C11"), (ECHO, "Echo NUS"), (BTHOME, "ATC_8F80A5"),
                          (RUUVI, "Ruuvi 884F")]:
        assert f"[NEW] Device {address} {name}" in out, out
        assert f"Device {address} {name}" in out.split("devices", 1)[-1]
