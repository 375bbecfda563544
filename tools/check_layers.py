#!/usr/bin/env python3
"""Checks the layer rule of CONTRIBUTING.md: a file includes qpipe headers of its own layer and
the layers below it only, never a higher one.

  core/base < core/io < core/model < core/sdk < core/host
  dist/ builds on base, io and model; scheduler/ on those and dist; core/host also sees
  scheduler; plugins/ see base, io, model, sdk, dist and scheduler (not host);
  tools/ and tests/ may include anything.

Usage: tools/check_layers.py [repository root]. Prints one line per violation and exits 1 if any.
The build enforces the same rule through include paths; this check also covers headers that no
source of their layer includes, and names the file and line.
"""
import pathlib
import re
import sys

ORDER = ["base", "io", "model", "sdk", "host"]
# What each place may include, by the layer names of the headers.
ALLOWED = {f"core/{layer}": set(ORDER[: i + 1]) for i, layer in enumerate(ORDER)}
ALLOWED["core/host"] |= {"scheduler"}
ALLOWED["dist"] = {"base", "io", "model", "dist"}
ALLOWED["scheduler"] = {"base", "io", "model", "dist", "scheduler"}
ALLOWED["plugins"] = {"base", "io", "model", "sdk", "dist", "scheduler"}
INCLUDE = re.compile(r'^\s*#\s*include\s+"(qpipe/[^"]+)"')


def header_layers(root):
    """qpipe/<name> → the layer that holds it."""
    owner = {}
    for layer in ORDER:
        base = root / "core" / layer / "include"
        for header in base.rglob("*.h"):
            owner[header.relative_to(base).as_posix()] = layer
    for folder in ["dist", "scheduler"]:
        for header in (root / folder / "include").rglob("*.h"):
            owner[header.relative_to(root / folder / "include").as_posix()] = folder
    owner["qpipe/version.h"] = "base"  # generated from core/base/version.h.in
    return owner


def place_of(path):
    parts = path.parts
    if parts[0] == "core" and len(parts) > 1:
        return f"core/{parts[1]}"
    return parts[0]


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parents[1])
    owner = header_layers(root)
    violations = []
    for top in ["core", "dist", "scheduler", "plugins"]:
        for path in sorted((root / top).rglob("*")):
            if path.suffix not in {".h", ".cpp"}:
                continue
            relative = path.relative_to(root)
            allowed = ALLOWED.get(place_of(relative))
            if allowed is None:
                violations.append(f"{relative}: not in a layer folder ({', '.join(sorted(ALLOWED))})")
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                match = INCLUDE.match(line)
                if not match:
                    continue
                header = match.group(1)
                layer = owner.get(header)
                if layer is None:
                    violations.append(f"{relative}:{number}: includes {header}, which is in no layer")
                elif layer not in allowed:
                    violations.append(f"{relative}:{number}: includes {header} of layer '{layer}'; "
                                      f"{place_of(relative)} may include {', '.join(sorted(allowed))} only")
    for violation in violations:
        print(violation)
    if violations:
        print(f"check_layers: {len(violations)} include(s) break the layer rule (CONTRIBUTING.md)")
        return 1
    print("check_layers: every include follows the layer rule")
    return 0


if __name__ == "__main__":
    sys.exit(main())
