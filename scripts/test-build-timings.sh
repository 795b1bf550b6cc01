#!/usr/bin/env bash
# Compile time and disk size of a checkout's integration tests.
#
#   scripts/test-build-timings.sh [--keep] CHECKOUT
#
# Builds CHECKOUT's tests (`cargo test --no-run --timings`) into a fresh target directory, then
# prints the compile time of each integration-test unit and their sum (dependencies, the library
# and its unit tests excluded), and the size of the whole target directory. Run it on two
# checkouts, one after the other on the same machine, to compare them. The target directory is
# removed afterwards unless --keep is given.
#
# Compile times come from cargo's own timings report: the unit data that cargo writes, as a JSON
# array, into target/cargo-timings/cargo-timing.html (the only machine-readable place stable
# cargo puts them; `--timings=json` is gone). Which units are integration tests comes from
# `cargo metadata`: the package's targets of kind "test".
set -euo pipefail

keep=0
if [[ ${1:-} == --keep ]]; then
    keep=1
    shift
fi
if [[ $# -ne 1 || ! -f $1/Cargo.toml ]]; then
    echo "usage: $0 [--keep] CHECKOUT   (a directory with a Cargo.toml)" >&2
    exit 2
fi
checkout=$(cd "$1" && pwd)
target=$(mktemp -d "${TMPDIR:-/tmp}/test-build-timings.XXXXXX")
if [[ $keep -eq 0 ]]; then
    trap 'rm -rf "$target"' EXIT
fi

cd "$checkout"
echo "checkout: $checkout ($(git rev-parse --short HEAD 2>/dev/null || echo 'not a git checkout'))"
echo "target:   $target"
CARGO_TARGET_DIR=$target cargo test --no-run --timings --quiet >/dev/null
metadata=$target/metadata.json
CARGO_TARGET_DIR=$target cargo metadata --no-deps --format-version 1 >"$metadata"

python3 - "$target/cargo-timings/cargo-timing.html" "$metadata" <<'PY'
import json
import sys

report, metadata = sys.argv[1], sys.argv[2]

html = open(report, encoding="utf-8").read()
marker = "const UNIT_DATA = "
start = html.find(marker)
if start < 0:
    sys.exit(f"{report}: no UNIT_DATA in cargo's timings report (its format changed?)")
# raw_decode parses the one JSON value that starts there and stops where it ends.
units, _ = json.JSONDecoder().raw_decode(html, start + len(marker))

meta = json.load(open(metadata, encoding="utf-8"))
root = meta["resolve"]["root"] if meta.get("resolve") else None
packages = [p for p in meta["packages"] if root is None or p["id"] == root] or meta["packages"]
tests = {}  # package name -> names of its integration-test targets
for p in packages:
    tests[p["name"]] = {t["name"] for t in p["targets"] if "test" in t["kind"]}


def test_target(unit):
    """The integration-test target a unit compiles, or None. A unit's "target" is a label such
    as ` it "test" (test)`: the target's name, then its kind in quotes."""
    names = tests.get(unit["name"])
    if not names:
        return None
    words = unit["target"].split()
    if len(words) >= 2 and words[0] in names and words[1] == '"test"':
        return words[0]
    return None


rows = sorted(
    ((test_target(u), u["duration"]) for u in units if test_target(u)),
    key=lambda row: -row[1],
)
found = {name for name, _ in rows}
expected = set().union(*tests.values())
for name, seconds in rows:
    print(f"  {seconds:8.2f} s  {name}")
print(f"integration-test units: {len(rows)}, summed compile time {sum(s for _, s in rows):.1f} s")
missing = expected - found
if missing:
    # A target behind a feature that is off is not built; say so rather than hide it.
    print(f"not built (no unit in the report): {', '.join(sorted(missing))}")
PY

echo "target directory size: $(du -sh "$target" | cut -f1) ($(du -sb "$target" | cut -f1) bytes)"
if [[ $keep -eq 1 ]]; then
    echo "kept: $target"
fi
