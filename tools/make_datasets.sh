#!/usr/bin/env bash
# Makes qpipe's default calibration and evaluation sets (docs/data.md) from Jane Austen's six
# novels as Debian's r-cran-janeaustenr ships them (public-domain texts, MIT-licensed package):
#
#   calib.jsonl  512 paragraphs from Emma, Mansfield Park, Northanger Abbey, Pride and Prejudice,
#                and Sense and Sensibility, evenly spaced through the books
#   eval.jsonl   the opening of Persuasion, paragraph by paragraph, at least 150,000 characters;
#                no calibration book, so the two sets are disjoint
#
#   tools/make_datasets.sh [OUT_DIR]     (default: .cache/data)
#
# Idempotent: a stamp records the package version and this script's hash, and a second run with
# both unchanged does nothing. The package's dependencies (all of GNU R) are not needed: unless the
# package is installed, its .deb is downloaded with apt-get and unpacked under .cache/debs.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=$(realpath -m "${1:-$root/.cache/data}")
package=r-cran-janeaustenr
rdb_path=usr/lib/R/site-library/janeaustenr/data/Rdata.rdb

step() { printf '\033[1m[datasets]\033[0m %s\n' "$*"; }
die() { printf '[datasets] error: %s\n' "$*" >&2; exit 1; }

command -v python3 >/dev/null || die "python3 is required"
mkdir -p "$out"

if dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
  version=$(dpkg-query -W -f='${Version}' "$package")
  rdb=/$rdb_path
else
  deb_dir=$root/.cache/debs
  mkdir -p "$deb_dir"
  if ! compgen -G "$deb_dir/${package}_*.deb" >/dev/null; then
    step "downloading $package"
    sudo_cmd=()
    [[ $(id -u) -ne 0 ]] && command -v sudo >/dev/null && sudo_cmd=(sudo)
    # Unprivileged apt cannot write into root-owned folders; it downloads anyway, with a warning.
    if ! (cd "$deb_dir" && apt-get download -qq "$package" 2>/dev/null); then
      "${sudo_cmd[@]}" apt-get update -qq || die "apt-get update failed (no network or no package mirror?)"
      (cd "$deb_dir" && apt-get download -qq "$package" 2>/dev/null) || die "apt-get download $package failed"
    fi
  fi
  deb=$(compgen -G "$deb_dir/${package}_*.deb" | head -n 1)
  version=$(dpkg-deb -f "$deb" Version)
  [[ -f $deb_dir/root/$rdb_path ]] || dpkg-deb -x "$deb" "$deb_dir/root"
  rdb=$deb_dir/root/$rdb_path
fi
[[ -f $rdb ]] || die "$rdb is missing from $package $version"

stamp="$package $version $(md5sum "${BASH_SOURCE[0]}" | cut -c1-12)"
if [[ -f $out/calib.jsonl && -f $out/eval.jsonl && $(cat "$out/.stamp" 2>/dev/null) == "$stamp" ]]; then
  step "present: $out/calib.jsonl, $out/eval.jsonl ($package $version)"
  exit 0
fi

step "writing $out/calib.jsonl and $out/eval.jsonl from $package $version"
python3 - "$rdb" "$out" <<'EOF'
import json, struct, sys, zlib

rdb, out = sys.argv[1], sys.argv[2]
CALIB_SAMPLES = 512
CALIB_CHARS = (400, 2500)  # whole paragraphs of narrative, not headings or one-line replies
EVAL_CHARS = 150_000


def read_strings(blob):
    """One R character vector in R's XDR serialization (what R's lazy-load database holds)."""
    assert blob[:2] == b"X\n", "not an XDR-serialized R object"
    version, = struct.unpack(">i", blob[2:6])
    pos = 14
    if version == 3:  # native encoding name follows the header
        length, = struct.unpack(">i", blob[pos:pos + 4])
        pos += 4 + length
    flags, = struct.unpack(">i", blob[pos:pos + 8][:4])
    count, = struct.unpack(">i", blob[pos + 4:pos + 8])
    pos += 8
    assert flags & 0xFF == 16, "not a character vector"
    strings = []
    for _ in range(count):
        flags, length = struct.unpack(">ii", blob[pos:pos + 8])
        pos += 8
        if length < 0:  # NA
            strings.append("")
            continue
        encoding = "utf-8" if flags & (1 << 15) else "latin-1"
        strings.append(blob[pos:pos + length].decode(encoding))
        pos += length
    return strings


# The database is a run of [big-endian length][zlib stream] records, one per book.
data = open(rdb, "rb").read()
books, pos = {}, 0
while pos < len(data):
    inflater = zlib.decompressobj()
    lines = read_strings(inflater.decompress(data[pos + 4:]))
    pos = len(data) - len(inflater.unused_data)
    books[next(line for line in lines if line.strip()).upper()] = lines
expected = {"EMMA", "MANSFIELD PARK", "NORTHANGER ABBEY", "PERSUASION", "PRIDE AND PREJUDICE", "SENSE AND SENSIBILITY"}
assert set(books) == expected, f"unexpected books: {sorted(books)}"


def paragraphs(lines):
    """Runs of non-blank lines, joined with spaces; headings (no lower-case letter) dropped."""
    result, current = [], []
    for line in lines + [""]:
        if line.strip():
            current.append(line.strip())
        elif current:
            text = " ".join(current)
            if any(c.islower() for c in text):
                result.append(text)
            current = []
    return result


def write(name, texts):
    with open(f"{out}/{name}", "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    print(f"[datasets] {name}: {len(texts)} samples, {sum(map(len, texts))} characters")


calib_pool = [p for title in sorted(expected - {"PERSUASION"}) for p in paragraphs(books[title])
              if CALIB_CHARS[0] <= len(p) <= CALIB_CHARS[1]]
assert len(calib_pool) >= CALIB_SAMPLES
write("calib.jsonl", [calib_pool[i * len(calib_pool) // CALIB_SAMPLES] for i in range(CALIB_SAMPLES)])

# Persuasion from its first chapter on; the title page is not prose.
persuasion = paragraphs(books["PERSUASION"])
start = next(i for i, p in enumerate(persuasion) if len(p) > 200)
eval_texts, chars = [], 0
for text in persuasion[start:]:
    if chars >= EVAL_CHARS:
        break
    eval_texts.append(text)
    chars += len(text)
write("eval.jsonl", eval_texts)
EOF
echo "$stamp" >"$out/.stamp"
