#!/usr/bin/env bash
# Build the Debian packages gpupoold and gpupool-client (amd64) from this checkout into dist/deb
# (or $1) with dpkg-deb; no debhelper, no source package. See docs/packaging.md and
# packaging/debian/README.md.
#   gpupoold        the daemon with its Python dependencies bundled (pip install --target) under
#                   /usr/lib/gpupoold/python, /usr/bin wrappers, systemd units, sysusers file, the
#                   commented default config /etc/gpupoold/gpupoold.toml (a conffile), docs.
#   gpupool-client  the client (with its shims) under /usr/lib/gpupool-client/python, /usr/bin/gpupool.
# Environment:
#   GPUPOOL_BUILD_DIR  where make builds the native code (default build-debs/: its own, so that
#                      the packaged programs are built with the package's flags, hardened and
#                      without the checkout's path), as for the wheels
#   PYTHON             the Python (3.11 or newer) that builds the wheels and fetches the daemon's
#                      dependencies (default .venv/bin/python, else python3). Their compiled parts
#                      are for its version; each has a pure-Python fallback, so other versions work.
#                      The build runs in a virtual environment made from it in
#                      $GPUPOOL_BUILD_DIR/debs-venv, with the setuptools (>= 70.1) and wheel the
#                      projects need from pip (made once, then reused).
#   DEBIAN_REVISION    the Debian revision of both packages (default 1): 0.1.0-2 is a second
#                      package of upstream 0.1.0
#   SOURCE_DATE_EPOCH  time stamp of the packaged files (default: the changelog's date); two
#                      builds of one commit are byte-identical (tests/test_debs.py)
# Earlier packages in the output directory stay (the version one would roll back to); a package of
# the same version and revision is replaced.
# Needs make, gcc, OpenSSL's headers (libssl-dev), dpkg-deb, dpkg-shlibdeps (dpkg-dev), strip
# (binutils), gzip, Python's venv module, and pip's package index (or a wheelhouse:
# PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR) for setuptools and the daemon's dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PKG=$REPO/packaging/debian
DEBIAN_REVISION=${DEBIAN_REVISION:-1}

say() { echo "build-debs: $*"; }
die() { echo "build-debs: error: $*" >&2; exit 1; }

# ---------------------------------------------------------------------------- inputs and tools
PY=${PYTHON:-.venv/bin/python}
if [[ ! -x $PY ]]; then
    PY=$(command -v python3) || die "no Python found: set PYTHON=/path/to/python3.11 (or run scripts/bootstrap.sh)"
fi
[[ $PY == /* ]] || PY=$REPO/$PY
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
    die "$PY is $("$PY" --version 2>&1); the daemon needs Python 3.11 or newer: set PYTHON=/path/to/python3.11"
"$PY" -m pip --version >/dev/null 2>&1 ||
    die "$PY has no pip: run scripts/bootstrap.sh, or set PYTHON to a Python with pip"
py_minor=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
py_next=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1] + 1}")')

need() {  # need COMMAND DEBIAN-PACKAGE
    command -v "$1" >/dev/null 2>&1 ||
        die "$1 not found: install it with \`apt-get install --no-install-recommends $2\`"
}
need make make
need gcc gcc
need dpkg-deb dpkg
need dpkg-shlibdeps dpkg-dev
need strip binutils
need readelf binutils
need gzip gzip
[[ $DEBIAN_REVISION =~ ^[0-9][A-Za-z0-9.+~]*$ ]] ||
    die "DEBIAN_REVISION=$DEBIAN_REVISION is no Debian revision: a digit, then letters, digits" \
        "and . + ~ (e.g. 1, 2, 1+local1)"
echo '#include <openssl/ssl.h>' | gcc -E -x c - >/dev/null 2>&1 ||
    die "OpenSSL's headers (openssl/ssl.h) not found: gpupool-worker needs them; install them" \
        "with \`apt-get install --no-install-recommends libssl-dev\`"

OUT=${1:-dist/deb}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
BUILD=${GPUPOOL_BUILD_DIR:-build-debs}
[[ $BUILD == /* ]] || BUILD=$REPO/$BUILD
mkdir -p "$BUILD"

version_of() {  # the __version__ = "..." of a Python file
    sed -n 's/^__version__ = "\([^"]*\)"$/\1/p' "$1"
}
D_VERSION=$(version_of gpupoold/__init__.py)
C_VERSION=$(version_of client/gpupool/__init__.py)
[[ -n $D_VERSION && -n $C_VERSION ]] ||
    die "no __version__ = \"X.Y.Z\" line in gpupoold/__init__.py or client/gpupool/__init__.py"
MAINTAINER=$(sed -n 's/^ -- \(.*>\)  .*$/\1/p' "$PKG/changelog" | head -n 1)
CHANGELOG_DATE=$(sed -n 's/^ -- .*>  \(.*\)$/\1/p' "$PKG/changelog" | head -n 1)
[[ -n $MAINTAINER && -n $CHANGELOG_DATE ]] ||
    die "$PKG/changelog: no ' -- NAME <EMAIL>  DATE' line in its first entry"
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(date -d "$CHANGELOG_DATE" +%s)}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpupool-debs.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
umask 022
started=$SECONDS
step() { say "[$1/6] $2 ($((SECONDS - started)) s)"; }

# ------------------------------------------------------------------------------------- wheels
step 1 "building the gpupoold $D_VERSION, gpupool $C_VERSION and gpupool-protocol wheels (native code: make in $BUILD/)"
# The build's own virtual environment: the projects need setuptools >= 70.1 (its bdist_wheel),
# which neither Debian 12's python3 (66.1) nor a new venv (65.5) has.
VENV=$BUILD/debs-venv
build_tools_ok() {
    "$VENV/bin/python" - <<'PY' 2>/dev/null
import sys
import setuptools
import setuptools.command.bdist_wheel  # noqa: F401 (setuptools >= 70.1)
import wheel  # noqa: F401
sys.exit(tuple(int(p) for p in setuptools.__version__.split(".")[:2]) < (70, 1))
PY
}
if [[ ! -x $VENV/bin/python ]] ||
    [[ $("$VENV/bin/python" -c 'import sys; print(sys.version_info[:2])' 2>/dev/null) != \
       $("$PY" -c 'import sys; print(sys.version_info[:2])') ]]; then
    say "making the build's virtual environment $VENV (from $PY)"
    rm -rf "$VENV"
    "$PY" -m venv "$VENV" ||
        die "$PY could not make a virtual environment in $VENV (see above); on Debian install" \
            "python3-venv (\`apt-get install --no-install-recommends python3-venv\`), or set" \
            "PYTHON to a Python with the venv module"
fi
if ! build_tools_ok; then
    say "installing setuptools (>= 70.1) and wheel into $VENV with pip"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "setuptools>=70.1" wheel ||
        die "pip could not install setuptools >= 70.1 and wheel into $VENV (see above): the" \
            "build needs the package index, or a wheelhouse holding them:" \
            "PIP_NO_INDEX=1 PIP_FIND_LINKS=/path/to/wheels $0"
    build_tools_ok || die "$VENV still has no setuptools >= 70.1 with bdist_wheel after pip" \
                          "installed it: remove $VENV and run $0 again"
fi
PY=$VENV/bin/python
# The native code with the package's flags: the Makefile's hardening (HARDEN=1: stack protector,
# _FORTIFY_SOURCE=2, stack clash protection, CET, RELRO, BIND_NOW, as dpkg-buildflags gives) and
# no path of this checkout in the binaries (their build ids are then the same in any clone).
export HARDEN=1 OPT="-O2 -g -ffile-prefix-map=$REPO=."
unset SAN
wheel_log=$WORK/wheels.log
if ! GPUPOOL_BUILD_DIR=$BUILD "$PY" -m pip wheel --quiet --disable-pip-version-check --no-deps \
        --no-build-isolation --wheel-dir "$WORK/wheels" . ./client ./protocol/python \
        > "$wheel_log" 2>&1; then
    cat "$wheel_log" >&2
    if grep -q "make failed\|Error [0-9]" "$wheel_log"; then
        die "building the native code failed (make, above): it needs make, gcc and libssl-dev," \
            "as \`make\` does; the first error above names the cause"
    fi
    die "building the wheels failed (pip, above; setuptools $("$PY" -c 'import setuptools;
print(setuptools.__version__)' 2>/dev/null || echo missing) in $VENV): the last lines above name the cause"
fi
cat "$wheel_log"

# --------------------------------------------------------------------------- the Python trees
# Each package bundles its own copy of gpupool-protocol (our wheel, found with --find-links).
STAGE=$WORK/debian  # dpkg-shlibdeps expects debian/<package>/ and debian/control
D=$STAGE/gpupoold
C=$STAGE/gpupool-client
D_TREE=$D/usr/lib/gpupoold/python
C_TREE=$C/usr/lib/gpupool-client/python
pip_target=("$PY" -m pip install --quiet --disable-pip-version-check --no-compile
            --ignore-installed --no-warn-script-location --only-binary=:all:
            --find-links "$WORK/wheels")
step 2 "installing gpupoold and its dependencies into /usr/lib/gpupoold/python (pip --target)"
# The dependencies from their hashed lock (scripts/lock-deps.py): two builds of one commit bundle
# the same bytes. The lock is for one Python minor version (compiled extensions).
LOCK=packaging/debian/gpupoold-deps.lock
lock_py=$(sed -n '1s/^# Python \([0-9.]*\):.*/\1/p' "$LOCK")
[[ "$lock_py" == "$py_minor" ]] ||
    die "$LOCK is for Python $lock_py, this build uses $py_minor ($PY): run" \
        "\`$PY scripts/lock-deps.py\` (or build with Python $lock_py: PYTHON=python$lock_py)"
"${pip_target[@]}" --target "$D_TREE" --require-hashes --no-deps -r "$LOCK" ||
    die "pip could not install the daemon's locked dependencies (see above): it needs the" \
        "package index, or a wheelhouse: PIP_NO_INDEX=1 PIP_FIND_LINKS=/path/to/wheels $0;" \
        "after a dependency change, run scripts/lock-deps.py"
"${pip_target[@]}" --no-deps --target "$D_TREE" "$WORK"/wheels/gpupoold-*.whl \
    "$WORK"/wheels/gpupool_protocol-*.whl
"${pip_target[@]}" --no-deps --target "$C_TREE" "$WORK"/wheels/gpupool-*.whl \
    "$WORK"/wheels/gpupool_protocol-*.whl
# Console scripts with the build's interpreter in their #! line (the packages have their own
# wrappers), byte code, and the build's paths (direct_url.json) do not ship; each RECORD then
# lists only what ships (a direct_url.json line would carry the hash of a temporary path).
rm -rf "${D_TREE:?}/bin" "${C_TREE:?}/bin"
find "$D_TREE" "$C_TREE" -depth \( -name __pycache__ -o -name direct_url.json \) -exec rm -rf {} +
"$PY" - "$D_TREE" "$C_TREE" <<'PY' || die "rewriting the dist-info RECORD files failed (see above)"
import csv
import io
import os
import sys
from pathlib import Path

for tree in map(Path, sys.argv[1:]):
    for record in sorted(tree.glob("*.dist-info/RECORD")):
        rows = list(csv.reader(io.StringIO(record.read_text())))
        kept = [r for r in rows if r and (tree / r[0]).resolve().is_relative_to(tree.resolve())
                and (os.path.lexists(tree / r[0]) or r[0].endswith("/RECORD"))]
        out = io.StringIO()
        csv.writer(out, lineterminator="\n").writerows(kept)
        record.write_text(out.getvalue())
PY

# ------------------------------------------------------------------------------------- layout
step 3 "laying out the files (wrappers, systemd units, sysusers, config, docs)"
wrapper() {  # wrapper PACKAGE COMMAND MODULE [FOLDER under /usr, default bin]
    local folder=${4:-bin}
    local up=$(( $(tr -cd / <<<"$folder" | wc -c) + 2 ))  # from the wrapper's folder up to /usr
    install -d "$STAGE/$1/usr/$folder"
    sed -e "s/@PACKAGE@/$1/g" -e "s/@COMMAND@/$2/g" -e "s/@MODULE@/$3/g" -e "s/@UP@/$up/g" \
        "$PKG/wrapper.in" > "$STAGE/$1/usr/$folder/$2"
    chmod 0755 "$STAGE/$1/usr/$folder/$2"
}
install -d "$D/usr/bin" "$C/usr/bin"
wrapper gpupoold gpupoold gpupoold.cli
# The root-only reset helper is no command for people: not on PATH (socket-activated by its unit).
wrapper gpupoold gpupool-reset-helper gpupoold.gpu.reset_helper libexec/gpupoold
wrapper gpupool-client gpupool gpupool.cli

install -d "$D/usr/lib/systemd/system"
units=0
for unit in systemd/*.service systemd/*.socket systemd/*.timer; do
    [[ -e $unit ]] || continue
    install -m 0644 "$unit" "$D/usr/lib/systemd/system/"
    units=$((units + 1))
done
[[ -f systemd/gpupoold.service ]] || die "systemd/gpupoold.service is missing"
install -D -m 0644 systemd/gpupoold.sysusers "$D/usr/lib/sysusers.d/gpupoold.conf"
install -D -m 0644 "$PKG/gpupoold.toml" "$D/etc/gpupoold/gpupoold.toml"

changelog() {  # changelog PACKAGE VERSION: changelog.Debian.gz; an entry is added if none matches
    local doc=$STAGE/$1/usr/share/doc/$1 top
    install -d "$doc"
    top=$(sed -n '1s/^[^ ]* (\([^)]*\)).*/\1/p' "$PKG/changelog")
    if [[ $top == "$2" ]]; then
        cp "$PKG/changelog" "$doc/changelog.Debian"
    else
        say "warning: packaging/debian/changelog's first entry is $top, not $2: adding an entry" \
            "for $2 to the package (add one to the file for the next release)"
        { printf 'gpupool (%s) unstable; urgency=medium\n\n  * New upstream version %s.\n\n' \
              "$2" "${2%-*}"
          printf ' -- %s  %s\n\n' "$MAINTAINER" "$(date -u -R -d "@$SOURCE_DATE_EPOCH")"
          cat "$PKG/changelog"; } > "$doc/changelog.Debian"
    fi
    gzip -9n "$doc/changelog.Debian"
}
changelog gpupoold "$D_VERSION-$DEBIAN_REVISION"
changelog gpupool-client "$C_VERSION-$DEBIAN_REVISION"
D_DOC=$D/usr/share/doc/gpupoold
C_DOC=$C/usr/share/doc/gpupool-client
install -m 0644 "$PKG/gpupoold.copyright" "$D_DOC/copyright"
install -m 0644 "$PKG/gpupool-client.copyright" "$C_DOC/copyright"

# ship_docs ROOT PACKAGE FOLLOW MANIFEST-IN MANIFEST-OUT SOURCE=DEST...: install the documents
# SOURCE (from this checkout) as DEST (under /usr/share/doc/PACKAGE, or an absolute path) with
# their links made to work where they are installed. FOLLOW=yes also ships every document of
# docs/ they link to, and those documents' own, so that no installed link leads nowhere; links to
# documents the other package installs (MANIFEST-IN, written by its MANIFEST-OUT) name their
# installed path; a link to a source file (a script, the protocol's table) becomes its text.
ship_docs() {
    "$PY" - "$@" <<'PY' || die "shipping the documents failed (see above)"
import os
import re
import shutil
import sys
from pathlib import Path, PurePosixPath

root, package, follow = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "yes"
manifest_in, manifest_out = sys.argv[4], Path(sys.argv[5])
repo, docs = Path.cwd().resolve(), Path("docs").resolve()
doc_dir = PurePosixPath("/usr/share/doc") / package
shipped: dict[Path, PurePosixPath] = {}  # source file -> where this package installs it
for arg in sys.argv[6:]:
    src, _, dest = arg.partition("=")
    shipped[Path(src).resolve()] = PurePosixPath(dest) if dest.startswith("/") else doc_dir / dest
elsewhere: dict[Path, PurePosixPath] = {}  # source file -> where the other package has it
if manifest_in != "-":
    for line in Path(manifest_in).read_text().splitlines():
        src, _, dest = line.partition("\t")
        elsewhere[Path(src)] = PurePosixPath(dest)
LINK = re.compile(r"(!?)\[([^\]\n]*)\]\(([^)\s]+)\)")
queue = list(shipped)


def fix(page: Path, installed: PurePosixPath, m: re.Match[str]) -> str:
    bang, label, target = m.groups()
    if target.startswith("#") or re.match(r"[a-z][a-z0-9+.-]*:", target):
        return m[0]  # an anchor on the page, a URL
    path, _, fragment = target.partition("#")
    source = (page.parent / path).resolve()
    if not source.exists():
        sys.exit(f"build-debs: error: {page.relative_to(repo)} links to {path}, which does not "
                 "exist: fix the link")
    in_repo = source.relative_to(repo).as_posix()
    where = shipped.get(source)
    if where is None and follow and source.is_file() and source.is_relative_to(docs):
        where = shipped[source] = doc_dir / source.relative_to(docs).as_posix()
        queue.append(source)
    where = where or elsewhere.get(source)
    if where is None:  # no document: a file of the sources (a script, a table)
        if bang:
            sys.exit(f"build-debs: error: {page.relative_to(repo)} shows {path}, which is not "
                     "shipped")
        return (f"`{in_repo}` (in gpupool's sources)" if label.strip("`") == in_repo
                else f"{label} (`{in_repo}` in gpupool's sources)")
    new = (os.path.relpath(where, installed.parent) if where.is_relative_to(doc_dir)
           else str(where))
    if label.strip("`") == in_repo:  # the link's text is the path: the installed one now
        label = label.replace(in_repo, new if new.startswith("/") else where.name)
    return f"{bang}[{label}]({new}{'#' + fragment if fragment else ''})"


while queue:
    page = queue.pop(0)
    installed = shipped[page]
    out = root / str(installed).lstrip("/")
    out.parent.mkdir(parents=True, exist_ok=True)
    if page.suffix == ".md":
        out.write_text(LINK.sub(lambda m: fix(page, installed, m), page.read_text()))
    else:
        shutil.copyfile(page, out)
manifest_out.write_text("".join(f"{src}\t{dest}\n" for src, dest in shipped.items()))
print(f"build-debs: {package}: {len(shipped)} documents in {doc_dir} and beside it")
PY
}
# The daemon's documents and those they link to; with them the Grafana dashboard, ready for
# file provisioning (packaging/grafana/README.md), and as an example the provisioning file that
# points Grafana at it. The client's guides; their links to the server's name its paths.
ship_docs "$D" gpupoold yes - "$WORK/gpupoold.docs" \
    packaging/debian/gpupoold.README.md=README.md docs/operator-guide.md=operator-guide.md \
    docs/configuration.md=configuration.md docs/security.md=security.md docs/api.md=api.md \
    docs/metrics.md=metrics.md docs/dashboard.md=dashboard.md docs/packaging.md=packaging.md \
    systemd/README.md=systemd.md packaging/grafana/README.md=grafana.md \
    packaging/grafana/provisioning/gpupool.yaml=examples/grafana-provisioning.yaml \
    packaging/grafana/gpupool.json=/usr/share/gpupoold/grafana/gpupool.json
ship_docs "$C" gpupool-client no "$WORK/gpupoold.docs" "$WORK/gpupool-client.docs" \
    packaging/debian/gpupool-client.README.md=README.md docs/user-guide.md=user-guide.md \
    docs/client-configuration.md=client-configuration.md
# Man pages, made from the commands' argparse definitions (scripts/man_pages.py), compressed
# without a time stamp (gzip -n) for reproducible packages.
"$PY" scripts/man_pages.py "$WORK/man" >/dev/null || die "making the man pages failed (see above)"
man_page() {  # man_page PACKAGE PAGE SECTION
    install -D -m 0644 "$WORK/man/$2.$3" "$STAGE/$1/usr/share/man/man$3/$2.$3"
    gzip -9nf "$STAGE/$1/usr/share/man/man$3/$2.$3"
}
man_page gpupoold gpupoold 8
man_page gpupoold gpupool-reset-helper 8
man_page gpupool-client gpupool 1
for pkg in gpupoold gpupool-client; do
    if [[ -f $PKG/$pkg.lintian-overrides ]]; then
        install -D -m 0644 "$PKG/$pkg.lintian-overrides" "$STAGE/$pkg/usr/share/lintian/overrides/$pkg"
    fi
done

# ------------------------------------------------------- modes, stripping, library dependencies
step 4 "stripping native files and finding their library dependencies (dpkg-shlibdeps)"
is_elf() { [[ $(head -c 4 "$1" | od -An -c | tr -d ' ') == '177ELF' ]]; }
printf 'Source: gpupool\n\nPackage: gpupoold\nArchitecture: amd64\n\nPackage: gpupool-client\nArchitecture: amd64\n' \
    > "$STAGE/control"
shlibs_depends() {  # shlibs_depends PACKAGE ELF...: the Depends dpkg-shlibdeps derives
    local pkg=$1
    shift
    # --warnings=1: only "symbol not found" (not the bundled wheels' superfluous links)
    (cd "$WORK" && dpkg-shlibdeps -O --warnings=1 "${@#"$WORK/"}") | sed -n 's/^shlibs:Depends=//p'
}
for pkg in gpupoold gpupool-client; do
    root=$STAGE/$pkg
    install -d "$root/DEBIAN"  # how dpkg-shlibdeps recognises the package's root
    find "$root" -type d -exec chmod 0755 {} +
    find "$root" -type f ! -path "$root/usr/bin/*" ! -path "$root/usr/libexec/*" \
        -exec chmod 0644 {} +
    elves=()
    while IFS= read -r -d '' f; do
        is_elf "$f" || continue
        elves+=("$f")
        strip --strip-unneeded --remove-section=.comment --remove-section=.note "$f"
        # programs (they have an ELF interpreter) are executable, libraries are not
        if readelf -l "$f" 2>/dev/null | grep -q 'Requesting program interpreter'; then
            chmod 0755 "$f"
        fi
        # our own programs and libraries (not the bundled wheels'): built hardened
        case $f in
            */gpupoold/bin/*|*/gpupool/lib/*)
                readelf -d "$f" | grep -q 'FLAGS.*NOW' && readelf -lW "$f" | grep -q GNU_RELRO ||
                    die "${f#"$root"} has no BIND_NOW or RELRO: it was linked without the" \
                        "Makefile's hardening flags (HARDEN=1); remove $BUILD and build again"
                ;;
        esac
    done < <(find "$root/usr/lib" -type f -print0)
    (( ${#elves[@]} > 0 )) || die "no native files in the $pkg tree: the wheel was built without them"
    deps=$(shlibs_depends "$pkg" "${elves[@]}")
    [[ -n $deps ]] || die "dpkg-shlibdeps found no library dependencies for $pkg"
    echo "$deps" > "$WORK/$pkg.shlibs"
    say "$pkg: ${#elves[@]} native files, needs $deps"
done

# ---------------------------------------------------------------------------- control, build
step 5 "writing the control files"
control() {  # control PACKAGE VERSION DEPENDS
    local root=$STAGE/$1 size
    install -d -m 0755 "$root/DEBIAN"
    size=$(du -s -k --apparent-size "$root" | cut -f1)
    sed -e "s/@VERSION@/$2/" -e "s/@DEPENDS@/$3/" -e "s/@INSTALLED_SIZE@/$size/" \
        -e "s/@MAINTAINER@/$MAINTAINER/" "$PKG/control.$1" > "$root/DEBIAN/control"
    for script in config postinst prerm postrm; do
        if [[ -f $PKG/$1.$script ]]; then
            install -m 0755 "$PKG/$1.$script" "$root/DEBIAN/$script"
        fi
    done
    # debconf's questions of the maintainer scripts (the purge's)
    if [[ -f $PKG/$1.templates ]]; then
        install -m 0644 "$PKG/$1.templates" "$root/DEBIAN/templates"
    fi
    if [[ -f $PKG/$1.conffiles ]]; then
        install -m 0644 "$PKG/$1.conffiles" "$root/DEBIAN/conffiles"
    fi
    (cd "$root" && find . -type f ! -path './DEBIAN/*' -printf '%P\0' | LC_ALL=C sort -z |
        xargs -0 md5sum) > "$root/DEBIAN/md5sums"
    chmod 0644 "$root/DEBIAN/md5sums"
}
# The daemon's bundled dependencies include compiled extensions for the building Python's minor
# version (aiohttp, multidict, yarl: cpython-3XY): the package works with that Python only.
control gpupoold "$D_VERSION-$DEBIAN_REVISION" \
    "python3 (>= $py_minor), python3 (<< $py_next), $(cat "$WORK/gpupoold.shlibs")"
control gpupool-client "$C_VERSION-$DEBIAN_REVISION" "python3 (>= 3.9), $(cat "$WORK/gpupool-client.shlibs")"
say "gpupoold: $units systemd units, $(find "$D_TREE" -maxdepth 1 -name '*.dist-info' | wc -l) bundled distributions"

step 6 "building the .deb files with dpkg-deb"
built=()
for pkg in gpupoold gpupool-client; do
    version=$D_VERSION
    [[ $pkg == gpupool-client ]] && version=$C_VERSION
    deb=$OUT/${pkg}_${version}-${DEBIAN_REVISION}_amd64.deb
    dpkg-deb --root-owner-group -Zxz --build "$STAGE/$pkg" "$deb" >/dev/null
    built+=("$deb")
done
say "done in $((SECONDS - started)) s:"
ls -l "${built[@]}"
