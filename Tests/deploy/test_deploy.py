"""Deployment tests: the systemd unit, the Debian package, the release binary and deploy/install.sh.

The release binary (static Swift standard library) is built once per session with deploy/build-release.sh, or
taken from $BLEBRIDGE_RELEASE_BIN. Everything is installed into scratch directories; nothing touches the host's
/etc, /usr or systemd.
"""

import hashlib
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
UNIT = DEPLOY / "blebridge.service"
MAX_BINARY_BYTES = 15 * 1024 * 1024
MAX_EXPOSURE = 2.5
LIBRARY_PACKAGES = ["libdbus-1-3", "libmosquitto1", "libyaml-0-2", "libssl3", "libmicrohttpd12"]
# Warnings lintian may give and deploy/README.md explains; anything else (and every error) fails.
EXPLAINED_LINTIAN_WARNINGS = {"initial-upload-closes-no-bugs"}


def run(args, **kwargs):
    """Runs a command, returning the CompletedProcess; output is text."""
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    kwargs.setdefault("timeout", 120)
    return subprocess.run([str(a) for a in args], **kwargs)


def check(args, **kwargs):
    """Runs a command that must succeed; a failure shows its output."""
    result = run(args, **kwargs)
    assert result.returncode == 0, (
        f"{args} exited {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    )
    return result


def need(tool):
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} is not installed (scripts/install-deps.sh installs it)")


def unit_directives(text):
    """The unit's `Key=value` lines as {key: [values]} (systemd allows repeated keys)."""
    directives = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        directives.setdefault(key.strip(), []).append(value.strip())
    return directives


@pytest.fixture(scope="session")
def release_binary():
    """The unstripped release binary: $BLEBRIDGE_RELEASE_BIN, or built once with deploy/build-release.sh."""
    given = os.environ.get("BLEBRIDGE_RELEASE_BIN")
    if given:
        path = Path(given)
        assert path.is_file(), f"BLEBRIDGE_RELEASE_BIN={given} does not exist"
        return path
    result = check([DEPLOY / "build-release.sh"], timeout=1200)
    path = Path(result.stdout.strip().splitlines()[-1])
    assert path.is_file(), f"build-release.sh printed {path}, which does not exist"
    return path


@pytest.fixture(scope="session")
def stripped_binary(release_binary, tmp_path_factory):
    path = tmp_path_factory.mktemp("stripped") / "blebridge"
    shutil.copy2(release_binary, path)
    check(["strip", "--strip-all", path])
    return path


@pytest.fixture(scope="session")
def deb(release_binary, tmp_path_factory):
    need("dpkg-deb")
    need("dpkg-shlibdeps")
    out = tmp_path_factory.mktemp("deb")
    result = check([DEPLOY / "build-deb.sh", "--binary", release_binary, "--output", out], timeout=300)
    path = Path(result.stdout.strip().splitlines()[-1])
    assert path.is_file() and path.parent == out, result.stdout
    return path


@pytest.fixture(scope="session")
def deb_tree(deb, tmp_path_factory):
    """The package unpacked with `dpkg -x` (files) and `dpkg-deb -e` (control files)."""
    root = tmp_path_factory.mktemp("debroot")
    check(["dpkg", "-x", deb, root])
    control = tmp_path_factory.mktemp("debcontrol") / "DEBIAN"
    check(["dpkg-deb", "-e", deb, control])
    return root, control


# The systemd unit.


def verify_unit(unit_text, tmp_path):
    """`systemd-analyze verify` on a copy of the unit; returns its combined complaints."""
    need("systemd-analyze")
    unit_dir = tmp_path / "units"
    unit_dir.mkdir()
    (unit_dir / "blebridge.service").write_text(unit_text)
    env = dict(os.environ)
    args = ["systemd-analyze", "verify"]
    if shutil.which("man"):
        # Documentation=man:blebridge(1) is checked against our man page, found through MANPATH.
        man1 = tmp_path / "man" / "man1"
        man1.mkdir(parents=True)
        shutil.copy(DEPLOY / "blebridge.1", man1 / "blebridge.1")
        env["MANPATH"] = str(tmp_path / "man")
    else:
        args.append("--man=no")
    result = run(args + [unit_dir / "blebridge.service"], env=env)
    return result.returncode, (result.stdout + result.stderr).strip()


def test_unit_verifies_against_the_built_binary(stripped_binary, tmp_path):
    text = UNIT.read_text()
    assert "ExecStart=/usr/local/bin/blebridge run --config /etc/blebridge/config.yaml" in text
    code, complaints = verify_unit(text.replace("/usr/local/bin/blebridge", str(stripped_binary)), tmp_path)
    assert code == 0 and complaints == "", complaints


def test_unit_verify_catches_a_broken_unit(stripped_binary, tmp_path):
    # The check above can fail: a bad value makes systemd-analyze complain.
    text = UNIT.read_text().replace("/usr/local/bin/blebridge", str(stripped_binary))
    _, complaints = verify_unit(text.replace("Type=notify", "Type=notifyy"), tmp_path)
    assert "Failed to parse service type" in complaints


def test_unit_settings():
    d = unit_directives(UNIT.read_text())
    expected = {
        "Type": ["notify"],
        "ExecReload": ["/bin/kill -HUP $MAINPID"],
        "Restart": ["on-failure"],
        "WatchdogSec": ["30"],
        "User": ["blebridge"],
        "SupplementaryGroups": ["bluetooth"],
        "StateDirectory": ["blebridge"],
        "ConfigurationDirectory": ["blebridge"],
        "ProtectSystem": ["strict"],
        "ProtectHome": ["true"],
        "PrivateTmp": ["true"],
        "NoNewPrivileges": ["true"],
        "RestrictAddressFamilies": ["AF_UNIX AF_INET AF_INET6"],
        "CapabilityBoundingSet": [""],
        "MemoryDenyWriteExecute": ["true"],
        "UMask": ["0077"],
    }
    for key, value in expected.items():
        assert d.get(key) == value, f"{key}: {d.get(key)} != {value}"
    assert "@system-service" in d["SystemCallFilter"]
    for key in ("After", "Wants"):
        assert {"bluetooth.service", "network-online.target"} <= set(" ".join(d[key]).split()), key
    assert "IPAddressDeny" not in d, "the bridge must reach a broker anywhere"


def test_unit_exposure_score_is_at_most_2_5():
    need("systemd-analyze")
    result = check(["systemd-analyze", "security", "--offline=yes", UNIT])
    match = re.search(r"Overall exposure level for blebridge\.service: ([0-9.]+)", result.stdout)
    assert match, result.stdout
    score = float(match.group(1))
    print(f"exposure score {score}")
    assert score <= MAX_EXPOSURE, result.stdout


# The release binary.


def test_binary_size(stripped_binary):
    size = stripped_binary.stat().st_size
    print(f"stripped binary: {size} bytes ({size / 1048576:.1f} MiB)")
    assert size <= MAX_BINARY_BYTES, f"{size} bytes: over 15 MB (see deploy/README.md, 'The binary')"


def test_binary_has_no_regex_engine(release_binary):
    """String's substring search (contains(_:), firstRange(of:), split on a string) lives in _StringProcessing and
    pulls in the whole regex engine: 1.3 MB of text that, mapped, is all resident (deploy/README.md, 'The
    binary'). Nothing in blebridge needs it."""
    symbols = check(["nm", release_binary]).stdout
    found = sorted({m for m in re.findall(r"(_RegexParser|17_StringProcessing)", symbols)})
    assert not found, f"the release binary links {found}: replace the call that needs it (nm -u on the .o files)"


def test_binary_exports_only_the_interposed_io_functions(stripped_binary):
    """The Swift toolchain exports every public symbol of an executable; build-release.sh links with
    --no-export-dynamic. What must stay exported are the read/write/close/socketpair of CMosquittoIO, which
    libmosquitto's calls bind to (the held MQTT writes depend on it)."""
    out = check(["readelf", "--dyn-syms", "-W", stripped_binary]).stdout
    defined = set()
    for line in out.splitlines():
        fields = line.split()
        if len(fields) >= 8 and fields[0].endswith(":") and fields[6] != "UND" and fields[3] in ("FUNC", "OBJECT"):
            defined.add(fields[7].split("@")[0])
    assert defined == {"read", "write", "close", "socketpair"}, f"exported: {sorted(defined)[:20]} ({len(defined)})"


def test_binary_lays_out_the_listed_functions_together(release_binary):
    """deploy/text-order.txt lists the functions the bridge runs; build-release.sh compiles each into a section of
    its own and has the linker put those first, together (deploy/README.md, 'The binary'). Most of them must then
    lie in one span twice their size; scattered, they keep nearly all of the text resident. (Not all: the standard
    library's prebuilt Swift.o has most of its code in one section that cannot be split.)"""
    listed = set()
    for line in (DEPLOY / "text-order.txt").read_text().splitlines():
        if line.startswith(".text.") and "*" not in line:
            listed.add(line[len(".text."):])
    assert len(listed) > 1000, "deploy/text-order.txt lists too few functions (scripts/text-order.sh makes it)"
    spans = []
    present = set()
    for line in check(["nm", "-S", "--defined-only", release_binary]).stdout.splitlines():
        fields = line.split()
        if len(fields) == 4 and fields[2] in "tTwW" and fields[3] in listed:
            spans.append((int(fields[0], 16), int(fields[1], 16)))
            present.add(fields[3])
    # A list made before the code changed names functions that are gone (a closure's mangled name changes when
    # another closure is added before it), and the renamed ones, often on the hot path, are laid out with the cold
    # code: 69 stale names of 4,072 cost 0.65 MB of resident text on 2026-12-05. Run scripts/text-order.sh.
    missing = len(listed - present)
    assert missing <= 0.01 * len(listed), (
        f"{missing} of {len(listed)} functions deploy/text-order.txt lists are not in the binary: the list is out of "
        "date with the code; run scripts/text-order.sh")
    spans.sort()
    total = sum(size for _, size in spans)
    # The most listed functions in any span of twice their total size (0.93 when laid out, 0.53 when not).
    best, first = 0, 0
    for last in range(len(spans)):
        while spans[last][0] + spans[last][1] - spans[first][0] > 2 * total:
            first += 1
        best = max(best, last - first + 1)
    print(f"{len(spans)} listed functions, {total} bytes; {best} of them within {2 * total} bytes")
    assert best >= 0.85 * len(spans), f"only {best} of {len(spans)} listed functions lie together"


def test_binary_links_only_system_libraries(stripped_binary):
    result = check(["ldd", stripped_binary])
    libs = {}
    for line in result.stdout.splitlines():
        line = line.strip()
        assert "not found" not in line, line
        if "=>" in line:
            name, _, target = line.partition("=>")
            libs[name.strip()] = target.split("(")[0].strip()
    assert libs, result.stdout
    for name, target in libs.items():
        assert not name.startswith("libswift") and "Foundation" not in name, f"Swift runtime linked: {name}"
        assert re.match(r"^/(usr/)?lib(64)?/", target), f"{name} resolves outside the system: {target}"
    needed = set(re.findall(r"\(NEEDED\).*\[(.+)\]", check(["readelf", "-d", stripped_binary]).stdout))
    assert {"libdbus-1.so.3", "libmosquitto.so.1", "libyaml-0.so.2", "libcrypto.so.3"} <= needed
    dynamic = check(["readelf", "-d", stripped_binary]).stdout
    assert "RPATH" not in dynamic and "RUNPATH" not in dynamic, "the binary must not search its own directory"
    assert "BIND_NOW" in dynamic or re.search(r"FLAGS.*\bNOW\b", dynamic), "full RELRO expected"


def test_binary_packs_its_relocations(stripped_binary):
    """build-release.sh links with lld -z pack-relative-relocs: the relative relocations of the position-independent
    binary are a DT_RELR bitmap, not a .rela.dyn table of 27,600 entries (650 KB the dynamic linker reads at every
    start, which stayed resident: deploy/README.md, 'The binary'). It stays position-independent."""
    dynamic = check(["readelf", "-d", "-W", stripped_binary]).stdout
    assert "(RELR)" in dynamic, "no DT_RELR: the binary was not linked with -z pack-relative-relocs"
    sizes = {m.group(1): int(m.group(2)) for m in re.finditer(r"\((RELASZ|RELRSZ)\)\s+(\d+)", dynamic)}
    assert sizes.get("RELASZ", 0) < 64 * 1024, f"relocation table of {sizes.get('RELASZ')} bytes"
    assert sizes.get("RELRSZ", 0) < 64 * 1024, f"packed relocations of {sizes.get('RELRSZ')} bytes"
    assert re.search(r"FLAGS_1.*\bPIE\b", dynamic), "the binary must stay position-independent"


def build_machine_paths(binary):
    """Build-machine paths in the binary's strings: the source tree and the directory holding it, the toolchain,
    a .build directory, the home directory."""
    strings = check(["strings", "-a", binary]).stdout.splitlines()
    places = {REPO, Path("/opt/swift"), Path.home()}
    # The directory holding the tree, unless it is a shared system directory (a clone in /tmp/x must not make
    # every "/tmp/..." or "/var/tmp/..." string of the Swift runtime look like a build path).
    if str(REPO.parent) not in {"/", "/tmp", "/var/tmp", "/home", "/root", "/srv", "/opt", "/work"}:
        places.add(REPO.parent)
    swift = shutil.which("swift")
    if swift:
        places.add(Path(swift).resolve().parents[2])  # <toolchain>/usr/bin/swift
    # A place counts only where a path starts: "/tmp/x/" must not match inside "/var/tmp/x/".
    patterns = [r"(^|[^\w./-])" + re.escape(str(p) + "/") for p in places if str(p) != "/"] + [r"(^|/)\.build/"]
    pattern = re.compile("|".join(patterns))
    return sorted({s for s in strings if pattern.search(s)})


def test_binary_has_no_build_machine_paths(stripped_binary):
    found = build_machine_paths(stripped_binary)
    assert found == [], f"{len(found)} strings name build-machine paths, e.g. {found[:5]}"


def test_build_path_check_can_fail(release_binary):
    # The unstripped binary keeps its DWARF paths: the check above would see them.
    if not build_machine_paths(release_binary):
        pytest.skip("this toolchain left no paths even in the unstripped binary")


# The Debian package.


def test_deb_contents(deb):
    listing = check(["dpkg-deb", "-c", deb]).stdout
    entries = {}
    for line in listing.splitlines():
        parts = line.split(None, 5)
        entries[parts[5].split(" -> ")[0].lstrip(".")] = (parts[0], parts[1])
    expected = {
        "/usr/bin/blebridge": "-rwxr-xr-x",
        "/lib/systemd/system/blebridge.service": "-rw-r--r--",
        "/usr/lib/sysusers.d/blebridge.conf": "-rw-r--r--",
        "/etc/blebridge/config.yaml": "-rw-r--r--",
        "/usr/share/doc/blebridge/copyright": "-rw-r--r--",
        "/usr/share/doc/blebridge/changelog.Debian.gz": "-rw-r--r--",
        "/usr/share/man/man1/blebridge.1.gz": "-rw-r--r--",
    }
    for path, mode in expected.items():
        assert path in entries, f"{path} missing from the package:\n{listing}"
        assert entries[path] == (mode, "root/root"), f"{path}: {entries[path]}"
    assert not any(p.startswith("/usr/local") for p in entries), "a package must not install into /usr/local"


def test_deb_control_and_depends(deb):
    fields = check(["dpkg-deb", "-f", deb, "Package", "Version", "Architecture", "Depends"]).stdout
    assert "Package: blebridge" in fields
    arch = check(["dpkg", "--print-architecture"]).stdout.strip()
    assert f"Architecture: {arch}" in fields
    depends = check(["dpkg-deb", "-f", deb, "Depends"]).stdout.strip()
    print(f"Depends: {depends}")
    relations = {}
    for item in depends.split(","):
        m = re.match(r"^\s*([a-z0-9.+-]+)(?:\s*\(>=\s*([^)]+)\))?\s*$", item)
        assert m, f"unexpected relation {item!r}"
        relations[m.group(1)] = m.group(2)
    assert "bluez" in relations
    # The packed relocations (DT_RELR) need glibc 2.36, which dpkg-shlibdeps cannot see (build-deb.sh adds it).
    check(["dpkg", "--compare-versions", relations.get("libc6") or "0", "ge", "2.36"])
    for package in LIBRARY_PACKAGES:
        assert relations.get(package), f"{package} missing or without a version in Depends: {depends}"
        installed = check(["dpkg-query", "-W", "-f=${Version}", package]).stdout.strip()
        # The binary was built here, so what it needs is what is installed here, or older.
        check(["dpkg", "--compare-versions", installed, "ge", relations[package]])


def test_deb_conffiles_md5sums_and_scripts(deb_tree):
    root, control = deb_tree
    assert (control / "conffiles").read_text().split() == ["/etc/blebridge/config.yaml"]
    assert (root / "etc/blebridge/config.yaml").read_bytes() == (REPO / "config/blebridge.example.yaml").read_bytes()
    sums = {}
    for line in (control / "md5sums").read_text().splitlines():
        digest, path = line.split(None, 1)
        sums[path] = digest
    files = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
    assert set(sums) == files - {"etc/blebridge/config.yaml"}, "md5sums covers every file but the conffile"
    for path, digest in sums.items():
        assert hashlib.md5((root / path).read_bytes()).hexdigest() == digest, path
    for script in ("postinst", "prerm", "postrm"):
        path = control / script
        assert path.stat().st_mode & stat.S_IXUSR, f"{script} is not executable"
        check(["sh", "-n", path])
    postinst = (control / "postinst").read_text()
    assert "systemd-sysusers" in postinst and "adduser" in postinst
    # As dh_installsystemd --no-enable: `enable` only re-creates the links of a unit that was enabled before.
    lines = postinst.splitlines()
    enables = [i for i, line in enumerate(lines) if "deb-systemd-helper enable" in line]
    assert len(enables) == 1 and "was-enabled" in lines[enables[0] - 1], "a first install must enable nothing"
    assert "systemctl enable" not in postinst.replace("'systemctl enable --now blebridge'", "")


def test_deb_unit_points_at_usr_bin(deb_tree, tmp_path):
    root, _ = deb_tree
    text = (root / "lib/systemd/system/blebridge.service").read_text()
    assert "ExecStart=/usr/bin/blebridge run --config /etc/blebridge/config.yaml" in text
    assert "/usr/local" not in text
    binary = root / "usr/bin/blebridge"
    code, complaints = verify_unit(text.replace("/usr/bin/blebridge", str(binary)), tmp_path)
    assert code == 0 and complaints == "", complaints


def test_deb_binary_runs_from_a_scratch_root(deb_tree):
    root, _ = deb_tree
    result = check([root / "usr/bin/blebridge", "--version"], timeout=30)
    assert re.fullmatch(r"blebridge \d+\.\d+\.\d+\S*", result.stdout.strip()), result.stdout
    assert build_machine_paths(root / "usr/bin/blebridge") == []


OVERLAY_SCRIPT = r"""
set -eu
merged="$1"; upper="$2"; work="$3"; deb="$4"
mount -t overlay overlay -o "lowerdir=/,upperdir=$upper,workdir=$work" "$merged"
mount -t proc proc "$merged/proc"
mount --rbind /dev "$merged/dev"
cp "$deb" "$merged/root/blebridge.deb"
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
in_root() { chroot "$merged" "$@"; }
report() { echo "== $1"; shift; in_root sh -c "$*" 2>&1 || echo "(exit $?)"; }
in_root getent passwd blebridge >/dev/null && { echo "the host already has a blebridge user"; exit 3; }
echo "== install"; in_root dpkg -i /root/blebridge.deb 2>&1
report user "getent passwd blebridge"
report groups "id -nG blebridge"
report config "stat -c '%U:%G %a' /etc/blebridge/config.yaml"
report version "blebridge --version"
report enabled "ls /etc/systemd/system/multi-user.target.wants/ 2>/dev/null | grep -c blebridge || true"
in_root sh -c 'echo "# edited" >> /etc/blebridge/config.yaml'
echo "== reinstall"; in_root dpkg -i /root/blebridge.deb 2>&1
report edited "tail -n 1 /etc/blebridge/config.yaml"
echo "== remove"; in_root dpkg -r blebridge 2>&1
report removed "ls /usr/bin/blebridge /lib/systemd/system/blebridge.service 2>&1; tail -n 1 /etc/blebridge/config.yaml"
in_root mkdir -p /var/lib/blebridge
echo "== purge"; in_root dpkg --purge blebridge 2>&1
report purged "ls -d /etc/blebridge/config.yaml /var/lib/blebridge 2>&1; getent passwd blebridge | cut -d: -f1"
"""


def overlay_sections(output):
    sections, current = {}, None
    for line in output.splitlines():
        if line.startswith("== "):
            current = line[3:].strip()
            sections[current] = []
        elif current:
            sections[current].append(line)
    return {k: "\n".join(v) for k, v in sections.items()}


def test_deb_install_upgrade_remove_purge_in_an_overlay_root(deb, tmp_path):
    # dpkg -i runs the real maintainer scripts, in a chroot whose root is an overlay of this machine's: every
    # write lands in tmp_path, in a private mount namespace, and the machine itself is not changed.
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a private overlay mount")
    dirs = [tmp_path / name for name in ("merged", "upper", "work")]
    for d in dirs:
        d.mkdir()
    probe = run(["unshare", "-m", "sh", "-c", f"mount -t overlay overlay -o lowerdir=/,upperdir={dirs[1]},"
                 f"workdir={dirs[2]} {dirs[0]}"])
    if probe.returncode != 0:
        pytest.skip(f"overlay mounts are not permitted here: {probe.stderr.strip()}")
    shutil.rmtree(dirs[2])
    dirs[2].mkdir()
    result = run(["unshare", "-m", "sh", "-c", OVERLAY_SCRIPT, "overlay", *dirs, deb], timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    print(result.stdout)
    out = overlay_sections(result.stdout)
    assert "Setting up blebridge" in out["install"], out["install"]
    assert "systemctl enable --now blebridge" in out["install"], "postinst says what to do next"
    assert out["user"].startswith("blebridge:x:") and out["user"].endswith(":/var/lib/blebridge:/usr/sbin/nologin")
    assert "bluetooth" in out["groups"].split(), out["groups"]
    assert out["config"] == "root:blebridge 640", out["config"]
    assert re.fullmatch(r"blebridge \d+\.\d+\.\d+\S*", out["version"]), out["version"]
    assert out["enabled"] == "0", "a first install must not enable the unit"
    assert out["edited"] == "# edited", "the conffile keeps the administrator's edit"
    assert "No such file" in out["removed"] and out["removed"].endswith("# edited"), out["removed"]
    assert out["purged"].count("No such file") == 2, out["purged"]
    assert out["purged"].splitlines()[-1] == "blebridge", "the system user stays after a purge"


def test_lintian(deb):
    need("lintian")
    result = run(["lintian", "--info", "--no-tag-display-limit", deb], timeout=300)
    tags = [line for line in result.stdout.splitlines() if re.match(r"^[EWIPX]: ", line)]
    print("lintian:\n" + "\n".join(tags or ["(no tags)"]))
    errors = [t for t in tags if t.startswith("E: ")]
    assert errors == [], "\n".join(errors)
    warnings = [t for t in tags if t.startswith("W: ")]
    unexplained = [t for t in warnings if t.split()[2] not in EXPLAINED_LINTIAN_WARNINGS]
    assert unexplained == [], "\n".join(unexplained)


# deploy/install.sh


def scratch_root(tmp_path):
    """A tiny target root with the user database of a machine that has bluez installed."""
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (root / "etc/group").write_text("root:x:0:\nbluetooth:x:112:\n")
    (root / "etc/shadow").write_text("root:*:19000:0:99999:7:::\n")
    (root / "etc/gshadow").write_text("root:*::\nbluetooth:!::\n")
    return root


def snapshot(root):
    """Every file and directory under root: mode, owner, size, modification time and content hash."""
    state = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
        state[str(path.relative_to(root))] = (st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_mtime_ns, digest)
    return state


def install(root, binary, *extra, env=None):
    return check([DEPLOY / "install.sh", "--root", root, "--binary", binary, *extra], timeout=120, env=env)


def user_entry(root, name):
    for line in (root / "etc/passwd").read_text().splitlines():
        if line.startswith(name + ":"):
            return line
    return None


def test_install_is_idempotent(release_binary, stripped_binary, tmp_path):
    root = scratch_root(tmp_path)
    first = install(root, release_binary)
    assert (root / "usr/local/bin/blebridge").read_bytes() == stripped_binary.read_bytes(), "installed stripped"
    assert (root / "etc/systemd/system/blebridge.service").read_bytes() == UNIT.read_bytes()
    assert (root / "etc/sysusers.d/blebridge.conf").read_bytes() == (DEPLOY / "blebridge.sysusers").read_bytes()
    assert (root / "usr/local/share/man/man1/blebridge.1").read_bytes() == (DEPLOY / "blebridge.1").read_bytes()
    config = root / "etc/blebridge/config.yaml"
    assert config.read_bytes() == (REPO / "config/blebridge.example.yaml").read_bytes()
    assert stat.S_IMODE(config.stat().st_mode) == 0o640
    entry = user_entry(root, "blebridge")
    assert entry and entry.endswith(":/var/lib/blebridge:/usr/sbin/nologin"), entry
    assert re.search(r"^bluetooth:x:112:(.*,)?blebridge(,|$)", (root / "etc/group").read_text(), re.M)
    assert "Next steps" in first.stdout and "systemctl enable --now blebridge" in first.stdout
    assert re.search(r"binary: [0-9.]+ MB", first.stdout)
    run_state = check([root / "usr/local/bin/blebridge", "--version"]).stdout
    assert run_state.startswith("blebridge ")

    before = snapshot(root)
    second = install(root, release_binary)
    assert snapshot(root) == before, "the second run changed files"
    assert "installed" not in second.stdout and "created" not in second.stdout, second.stdout

    # A configuration the administrator edited stays as it is.
    config.write_text("mqtt:\n  url: mqtt://broker.lan:1883\n")
    edited = snapshot(root)
    install(root, release_binary)
    assert snapshot(root) == edited
    assert config.read_text() == "mqtt:\n  url: mqtt://broker.lan:1883\n"


def test_install_keeps_a_config_that_was_there_first(release_binary, tmp_path):
    root = scratch_root(tmp_path)
    config = root / "etc/blebridge/config.yaml"
    config.parent.mkdir(parents=True)
    config.write_text("# mine\n")
    result = install(root, release_binary)
    assert config.read_text() == "# mine\n"
    assert "kept existing" in result.stdout


def test_uninstall_removes_what_it_installed_and_keeps_the_config(release_binary, tmp_path):
    root = scratch_root(tmp_path)
    install(root, release_binary)
    config = root / "etc/blebridge/config.yaml"
    config.write_text("# edited\n")
    result = check([DEPLOY / "install.sh", "--root", root, "--uninstall"])
    installed = [
        "usr/local/bin/blebridge",
        "usr/local/share/man/man1/blebridge.1",
        "etc/systemd/system/blebridge.service",
        "etc/sysusers.d/blebridge.conf",
    ]
    for path in installed:
        assert not (root / path).exists(), f"{path} left behind"
    assert user_entry(root, "blebridge") is None
    group = (root / "etc/group").read_text()
    assert re.search(r"^bluetooth:", group, re.M) and not re.search(r"^blebridge:", group, re.M)
    assert "blebridge" not in re.search(r"^bluetooth:.*$", group, re.M).group(0)
    assert config.read_text() == "# edited\n"
    assert "kept" in result.stdout
    # Uninstalling again is harmless; installing again brings everything back and keeps the config.
    check([DEPLOY / "install.sh", "--root", root, "--uninstall"])
    install(root, release_binary)
    assert user_entry(root, "blebridge") and config.read_text() == "# edited\n"


def test_install_rejects_a_missing_binary(tmp_path):
    result = run([DEPLOY / "install.sh", "--root", scratch_root(tmp_path), "--binary", tmp_path / "nope"])
    assert result.returncode != 0 and "does not exist" in result.stderr


def test_install_without_systemd_sysusers_creates_the_group_too(release_binary, tmp_path):
    # A PATH with every tool of this machine but systemd-sysusers: install.sh falls back to groupadd/useradd.
    tools = tmp_path / "bin"
    tools.mkdir()
    for directory in os.environ.get("PATH", "").split(os.pathsep) + ["/usr/sbin", "/sbin"]:
        if not os.path.isdir(directory):
            continue
        for entry in os.scandir(directory):
            target = tools / entry.name
            if entry.name != "systemd-sysusers" and not target.exists() and os.access(entry.path, os.X_OK):
                target.symlink_to(entry.path)
    for tool in ("useradd", "groupadd", "userdel", "groupdel"):
        if not (tools / tool).exists():
            pytest.skip(f"{tool} is not installed")
    env = dict(os.environ, PATH=str(tools))
    root = scratch_root(tmp_path)
    (root / "etc/group").write_text("root:x:0:\n")  # no bluetooth group yet: bluez is not installed there
    (root / "etc/gshadow").write_text("root:*::\n")
    install(root, release_binary, env=env)
    assert re.search(r"^bluetooth:x:\d+:blebridge$", (root / "etc/group").read_text(), re.M)
    entry = user_entry(root, "blebridge")
    assert entry and entry.endswith(":/var/lib/blebridge:/usr/sbin/nologin"), entry
    before = snapshot(root)
    install(root, release_binary, env=env)
    assert snapshot(root) == before
    check([DEPLOY / "install.sh", "--root", root, "--uninstall"], env=env)
    assert user_entry(root, "blebridge") is None
    assert re.search(r"^bluetooth:x:\d+:$", (root / "etc/group").read_text(), re.M)
